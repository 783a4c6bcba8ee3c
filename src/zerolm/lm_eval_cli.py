"""`python -m zerolm.lm_eval_cli ARGS`: the harness's own `lm_eval` command with the zerolm backend registered
and zerolm's tasks (zerolm.eval.tasks) indexed beside the harness's, so that

    python -m zerolm.lm_eval_cli --model zerolm --model_args checkpoint=checkpoints/tiny --tasks zerolm_cloze

runs as `lm_eval --model hf ...` would. lm-eval 0.4.13 finds external models only among the classes
already imported (its registry reads no entry points), which a plain `lm_eval` process never does for zerolm;
this module is that import. Every argument is lm_eval's (`--include_path DIR` adds DIR as well).

Before the harness loads the model, the tasks named get `zerolm eval --tasks`'s checks (zerolm.eval.downstream): an
unknown task, one whose data is not on this machine, or a mistake in a task file of yours is one line and exit
code 2. As there, the harness runs offline unless HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 are set (then with no
internet, that is one line too). Its bootstrapped standard errors are computed in processes started afresh,
not forked from this one, whose JAX threads a fork would copy mid-flight.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any

from zerolm.core.errors import ZerolmError
from zerolm.core.exitcodes import EXIT_USAGE
from zerolm.eval import downstream

KEYS = ("--tasks", "--include_path", "HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0")


def main() -> None:
    if problem := downstream.missing_harness():
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    downstream.go_offline()  # before the harness imports Hugging Face's libraries, which read the switches once
    import lm_eval.tasks
    from lm_eval.__main__ import cli_evaluate
    from lm_eval._cli.harness import HarnessCLI

    import zerolm.eval.harness  # noqa: F401  (registers the "zerolm" model)
    from zerolm.eval.tasks import DIRECTORY

    try:
        check(HarnessCLI().parse_args())  # (its `run` inserted into sys.argv where the command was left out)
    except ZerolmError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None

    manager: Any = downstream.task_manager_class()

    class WithZerolmTasks(manager):
        """The harness's task index, zerolm's tasks in it too (its commands import TaskManager when they run)."""

        def __init__(self, *args, include_path=None, **kwargs):
            paths = include_path if isinstance(include_path, list | tuple) else [include_path] if include_path else []
            super().__init__(*args, include_path=[DIRECTORY, *paths], **kwargs)

    lm_eval.tasks.TaskManager = WithZerolmTasks
    multiprocessing.set_start_method("spawn", force=True)
    sys.argv[0] = "lm_eval"
    with downstream.no_git():
        cli_evaluate()


def check(args: Any) -> None:
    """`zerolm eval --tasks`'s checks of the tasks `run` names (`args`: the harness's parsed command line),
    before the harness loads the model: those named by name (not a YAML file, a directory or a pattern,
    which the harness resolves itself)."""
    if getattr(args, "command", None) != "run" or not args.tasks:
        return
    keys = downstream.Keys(*KEYS)
    names = [name for name in args.tasks if name and not (name.endswith(".yaml") or os.path.isdir(name)
                                                              or any(c in name for c in "*?["))]
    if not downstream.offline():
        downstream.check_internet(keys)
    if names:
        downstream.check_tasks(names, downstream.task_manager(names, args.include_path, keys), keys)


if __name__ == "__main__":
    main()
