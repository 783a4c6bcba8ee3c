"""`python -m zerolm.lm_eval_cli ARGS`: the harness's own `lm_eval` command with the zerolm backend registered
and zerolm's tasks (zerolm.tasks) indexed beside the harness's, so that

    python -m zerolm.lm_eval_cli --model zerolm --model_args checkpoint=checkpoints/tiny --tasks zerolm_cloze

runs as `lm_eval --model hf ...` would. lm-eval 0.4.13 finds external models only among the classes
already imported (its registry reads no entry points), which a plain `lm_eval` process never does for zerolm;
this module is that import. Every argument is lm_eval's (`--include_path DIR` adds DIR as well).
"""

from __future__ import annotations

import sys

from zerolm.downstream import missing_harness


def main() -> None:
    if problem := missing_harness():
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    import lm_eval.tasks
    from lm_eval.__main__ import cli_evaluate

    import zerolm.harness  # noqa: F401  (registers the "zerolm" model)
    from zerolm.tasks import DIRECTORY

    class WithZerolmTasks(lm_eval.tasks.TaskManager):
        """The harness's task index, zerolm's tasks in it too (its commands import TaskManager when they run)."""

        def __init__(self, *args, include_path=None, **kwargs):
            paths = include_path if isinstance(include_path, list | tuple) else [include_path] if include_path else []
            super().__init__(*args, include_path=[DIRECTORY, *paths], **kwargs)

    lm_eval.tasks.TaskManager = WithZerolmTasks
    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
