"""Downstream tasks through lm-evaluation-harness: what `zerolm eval --tasks` and training's `eval.tasks` run
(the model is zerolm.harness's backend; the tasks the harness's own, zerolm's (zerolm.tasks), or a
directory of the user's).

Offline by design: the harness reads a task's data from the Hugging Face hub, which a machine without
internet cannot reach and would retry. Unless `download` is asked for (or HF_DATASETS_OFFLINE / HF_HUB_OFFLINE
are already set), both are set, so a task whose data is not in this machine's Hugging Face cache fails at
once, in one line that names it. Every task's data is loaded before the model is, so such a run stops
in seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import unittest.mock
from typing import Any

from zerolm.errors import UsageError, ZerolmError, first_line
from zerolm.exitcodes import EXIT_USAGE

# The harness bootstraps a perplexity's standard error in forked processes, which JAX's threads make unsafe:
# serially instead, with 1,000 draws (its command's default is 100,000).
BOOTSTRAP_ITERS = 1000
OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


class TaskError(ZerolmError):
    """A task that cannot run here: unknown, or its data not on this machine."""

    exit_code = EXIT_USAGE


def missing_harness() -> str | None:
    """Why the harness cannot be imported (one line), or None."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        return f"lm-evaluation-harness is not installed ({first_line(e)}): pip install 'zerolm[eval]'"
    return None


def go_offline(download: bool = False) -> None:
    """Hugging Face's offline switches on (unless `download`, or the user set them), before datasets is imported."""
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notes; the errors stay
    if not download:
        for variable in OFFLINE:
            os.environ.setdefault(variable, "1")


@dataclasses.dataclass(frozen=True)
class Keys:
    """What the user named the tasks and their directory with, for the one-line errors."""

    tasks: str = "--tasks"
    include_path: str = "--include-path"


TRAINING = Keys("eval.tasks", "eval.include_path")


def task_manager(names: list[str], include_path: str | None = None, keys: Keys = Keys()):
    """The harness's task index over zerolm's tasks and the directory `include_path` (--include-path), and
    over the harness's own tasks too unless those hold every name (indexing its thousands takes seconds)."""
    from lm_eval.tasks import TaskManager

    from zerolm.tasks import DIRECTORY

    paths = [str(DIRECTORY)]
    if include_path is not None:
        if not os.path.isdir(include_path):
            raise UsageError(f"{keys.include_path}: {include_path} is not a directory of task definitions")
        paths.append(include_path)
    ours = TaskManager(include_path=paths, include_defaults=False)
    return ours if set(names) <= set(ours.all_tasks) else TaskManager(include_path=paths)


def check_tasks(names: list[str], manager, keys: Keys = Keys()) -> None:
    """Each task is known and its data loads here (TaskError, one line, otherwise)."""
    from zerolm.tasks import NAMES

    if not names:
        raise UsageError(f"{keys.tasks}: no task named (e.g. {keys.tasks} zerolm_cloze,zerolm_choice)")
    for name in names:
        if name not in manager.all_tasks:
            raise TaskError(f"{keys.tasks}: unknown task {name!r} (zerolm's: {', '.join(NAMES)}; the harness's: "
                            f"`lm-eval ls tasks`; your own: {keys.include_path} DIR)")
    for name in names:
        try:
            with no_progress_bars():
                manager.load([name])
        except OSError as e:  # datasets' ConnectionError (offline) and DatasetNotFoundError (a FileNotFoundError)
            offline = os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("0", "false", "")
            raise TaskError(f"{keys.tasks}: {name}: its data is not on this machine ({first_line(e, 160)})"
                            + ("; download it on a machine with internet (zerolm eval --tasks "
                               f"{name} --download, which fills ~/.cache/huggingface) and copy that cache here"
                               if offline else "")) from None


@contextlib.contextmanager
def no_progress_bars():
    """While this holds, datasets' progress bars ("Generating test split") and the harness's own (building a
    task's requests) are off. tqdm reads TQDM_DISABLE once, when it is imported: the harness's bar is turned
    off where the harness makes it."""
    import datasets
    import lm_eval.api.task

    bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with unittest.mock.patch.object(lm_eval.api.task, "tqdm", functools.partial(lm_eval.api.task.tqdm, disable=True)):
            yield
    finally:
        if bars:
            datasets.enable_progress_bars()


def prepare(names: list[str], include_path: str | None = None, download: bool = False, keys: Keys = Keys()):
    """The harness's task index for `names`, each checked known and its data here, before any model is loaded
    or compiled (TaskError or UsageError, one line, otherwise; the harness not installed too)."""
    if problem := missing_harness():
        raise UsageError(f"{keys.tasks}: {problem}")
    go_offline(download)
    manager = task_manager(names, include_path, keys)
    check_tasks(names, manager, keys)
    return manager


class DuringTraining:
    """Training's eval.tasks (zerolm.train): the tasks evaluated with a training run's current parameters on
    its own mesh, sharded as trained. The backend is made once, so its programs compile at the first
    evaluation only; standard errors are not bootstrapped (a number per metric, as the loss is)."""

    def __init__(self, names: list[str], manager, loaded, limit: int | None):
        """`loaded`: a zerolm.harness.Loaded of the run's model, mesh and tokenizer (its params replaced at
        each evaluation). Batches are the backend's default rows (rounded up to a multiple of dp): the
        scores' float32 logits are whole rows × length × vocab, which the training step never holds."""
        from zerolm.harness import ZerolmLM

        self.names, self.manager, self.limit = names, manager, limit
        self.lm = ZerolmLM(loaded=loaded)
        self.lm.quiet = True

    def __call__(self, params: Any, step: int) -> dict[str, float]:
        """The `tasks/<task>/<metric>` numbers of the model with `params` (the state after step `step`), with
        the harness's and datasets' progress bars off: the run's own bar and its one line per evaluation say it."""
        self.lm.use_params(params, step)
        with no_progress_bars():
            return metrics(evaluate(self.lm, self.names, self.manager, self.limit, bootstrap_iters=0))


def evaluate(lm, names: list[str], manager, limit: int | None = None, bootstrap_iters: int = BOOTSTRAP_ITERS,
             log_samples: bool = False) -> dict[str, Any]:
    """The harness's results for `names` with the model `lm` (a zerolm.harness.ZerolmLM); their config
    records the rows of lm's batches (the harness's own batch_size is its argument's, None here). What the
    harness prints ("bootstrapping for stddev: ...") goes to stderr: stdout is the command's."""
    import lm_eval

    with no_git(), contextlib.redirect_stdout(sys.stderr):
        results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                          bootstrap_iters=bootstrap_iters, log_samples=log_samples)
    assert results is not None  # None only on ranks other than 0 of the harness's own multi-process runs
    results["config"]["batch_size"] = lm.scorer.batch_rows
    return results


def no_git():
    """The harness records the git commit of the working directory by running git, whose "fatal: not a git
    repository" reaches the terminal outside a checkout: not while this holds (zerolm's results record the
    checkpoint instead)."""
    import lm_eval.evaluator

    return unittest.mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None)


def metrics(results: dict[str, Any]) -> dict[str, float]:
    """The results as `tasks/<task>/<metric>` numbers (the harness's metric names, its ",none" filter suffix
    dropped; other filters keep theirs; standard errors and alias/name fields left out)."""
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or "_stderr" in metric or not isinstance(value, int | float):
                continue
            name = metric if filter_name == "none" else f"{metric},{filter_name}"
            out[f"tasks/{task}/{name}"] = float(value)
    return out


def table(results: dict[str, Any]) -> str:
    from lm_eval.utils import make_table

    return make_table(results) + ("\n" + make_table(results, "groups") if results.get("groups") else "")
