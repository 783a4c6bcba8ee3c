"""Downstream tasks through lm-evaluation-harness: what `zerolm eval --tasks` and training's `eval.tasks` run
(the model is zerolm.eval.harness's backend; the tasks the harness's own, zerolm's (zerolm.eval.tasks), or a
directory of the user's).

Offline by design: the harness reads a task's data from the Hugging Face hub, which a machine without
internet cannot reach and would retry for half a minute. Unless `download` is asked for (or HF_DATASETS_OFFLINE /
HF_HUB_OFFLINE are already set), both are set, so a task whose data is not in this machine's Hugging Face cache
fails at once, in one line that names it; where downloading is allowed, the hub is asked once, briefly, first,
and no answer is one line saying there is no internet. Every task is loaded before the model is, so such a
run stops in seconds, as does a mistake in a task file of the user's (one line naming the file and its key).
A task file's relative `data_files` are relative to the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import sys
import unittest.mock
from typing import Any

from zerolm.core.errors import UsageError, ZerolmError, first_line
from zerolm.core.exitcodes import EXIT_USAGE

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
    """Hugging Face's offline switches on (unless the user set them), or with `download` off, before datasets
    is imported."""
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notes; the errors stay
    for variable in OFFLINE:
        if download:
            os.environ[variable] = "0"  # asked for on the command line: over the environment's setting
        else:
            os.environ.setdefault(variable, "1")


def offline() -> bool:
    """Whether Hugging Face's libraries will not download (either switch on, as they read it)."""
    return any(os.environ.get(variable, "").upper() in ("1", "ON", "YES", "TRUE") for variable in OFFLINE)


@dataclasses.dataclass(frozen=True)
class Keys:
    """What the user named the tasks, their directory and downloading with, for the one-line errors."""

    tasks: str = "--tasks"
    include_path: str = "--include-path"
    download: str = "--download"


TRAINING = Keys("eval.tasks", "eval.include_path", "HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0")
HUB_TIMEOUT_S = 10  # how long the hub may take to answer when downloading is allowed


def check_internet(keys: Keys = Keys()) -> None:
    """The Hugging Face hub answers (with any HTTP status), or TaskError saying that there is no internet: in
    seconds, where the harness's clients would retry for half a minute and then say the data is missing."""
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:  # an opener of its own: the proxies of the environment now (urlopen's keeps those of its first call)
        opener = urllib.request.build_opener()
        opener.open(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return  # it answered
    except OSError as e:  # no route, no name, refused, timed out: the same for a proxy in between
        raise TaskError(f"{keys.download}: no internet ({endpoint}: {first_line(getattr(e, 'reason', e))}): task "
                        f"data cannot be downloaded here; without {keys.download} the harness reads this machine's "
                        "Hugging Face cache (~/.cache/huggingface), which `zerolm eval --tasks ... --download` fills on "
                        "a machine with internet") from None


def task_manager(names: list[str], include_path: str | None = None, keys: Keys = Keys()):
    """The harness's task index over zerolm's tasks and the directory `include_path` (--include-path), and
    over the harness's own tasks too unless those hold every name (indexing its thousands takes seconds).
    Each task file's relative data paths are relative to the file."""
    from zerolm.eval.tasks import DIRECTORY

    paths = [str(DIRECTORY)]
    if include_path is not None:
        if not os.path.isdir(include_path):
            raise UsageError(f"{keys.include_path}: {include_path} is not a directory of task definitions")
        paths.append(include_path)
    manager_class = task_manager_class()
    ours = manager_class(include_path=paths, include_defaults=False)
    return ours if set(names) <= set(ours.all_tasks) else manager_class(include_path=paths)


DATA_PATHS = ("data_files", "data_dir")  # dataset_kwargs' local paths (datasets reads them from the working directory)


def local_data(config: dict) -> bool:
    """Whether a task reads its data from this machine's files: its dataset_path is one of datasets' own
    builders (json, csv, parquet, text, ...), not a repository on the hub, whose data_files are its own paths."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return config.get("dataset_path") in _PACKAGED_DATASETS_MODULES


def relative_to_file(config: dict, yaml_path) -> dict:
    """A task's config with its dataset_kwargs' relative local paths (data_files: a path, a list, or a dict of
    either; data_dir) made relative to its YAML file, not to the working directory (a task whose data is on
    the hub: as it is)."""
    from pathlib import Path

    def resolve(value):
        if isinstance(value, dict):
            return {key: resolve(v) for key, v in value.items()}
        if isinstance(value, list | tuple):
            return [resolve(v) for v in value]
        if isinstance(value, str) and "://" not in value and not os.path.isabs(value):
            return str(Path(yaml_path).parent / value)
        return value

    kwargs = config.get("dataset_kwargs")
    if not local_data(config) or not isinstance(kwargs, dict) or not any(key in kwargs for key in DATA_PATHS):
        return config
    return {**config, "dataset_kwargs": {**kwargs, **{key: resolve(kwargs[key]) for key in DATA_PATHS if key in kwargs}}}


@functools.cache
def task_manager_class():
    """The harness's TaskManager, its task files' data paths relative to each file (relative_to_file), the index
    of its own tasks read from zerolm's cache (zerolm.eval.task_index)."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._factory import TaskFactory

    from zerolm.eval.task_index import cached_harness_tasks

    class Factory(TaskFactory):
        def _load_full_config(self, entry, overrides=None):
            config = super()._load_full_config(entry, overrides)
            return relative_to_file(config, entry.yaml_path) if entry.yaml_path else config

    class Manager(TaskManager):
        def __init__(self, *args, **kwargs):
            with cached_harness_tasks():  # the harness's own thousands of task files: their index from zerolm's cache
                super().__init__(*args, **kwargs)
            self._factory = Factory(meta=self.metadata)

    return Manager


def check_tasks(names: list[str], manager, keys: Keys = Keys()) -> None:
    """Each task is known, and loads here with its data (TaskError, one line, otherwise)."""
    from zerolm.eval.tasks import NAMES

    if not names:
        raise UsageError(f"{keys.tasks}: no task named (e.g. {keys.tasks} zerolm_cloze,zerolm_choice)")
    for name in names:
        if name not in manager.all_tasks:
            raise TaskError(f"{keys.tasks}: unknown task {name!r} (zerolm's: {', '.join(NAMES)}; the harness's: "
                            f"`lm-eval ls tasks`; your own: {keys.include_path} DIR)")
    for name in names:
        load_task(name, manager, keys)


def load_task(name: str, manager, keys: Keys = Keys()) -> None:
    """The harness's task `name` made, its data read (TaskError, one line, if that is not here; or, for a
    task file of the user's, if the file is wrong: the file and its key named)."""
    import jinja2

    entry = manager.task_index[name]
    yours = entry.yaml_path if users_file(manager, entry.yaml_path) else None
    if yours is not None:
        missing_data_file(name, yours, entry.cfg or {}, keys)
    try:
        with no_progress_bars():
            manager.load([name])
    except OSError as e:  # datasets' ConnectionError (offline) and DatasetNotFoundError (a FileNotFoundError)
        raise TaskError(f"{keys.tasks}: {name}: its data is not on this machine ({first_line(e, 160)})"
                        + ("; download it on a machine with internet (zerolm eval --tasks "
                           f"{name} --download, which fills ~/.cache/huggingface) and copy that cache here"
                           if offline() else "")) from None
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as e:  # what the harness raises on a bad file
        if yours is None:
            raise  # the harness's or zerolm's own task: not the user's mistake
        raise TaskError(f"{keys.tasks}: {name}: {yours}: {task_file_mistake(e)}") from None


def users_file(manager, yaml_path) -> bool:
    """Whether a task file is one of the user's: under a directory of task_manager's include path other than
    zerolm's (not the harness's own, nor zerolm's)."""
    from pathlib import Path

    from zerolm.eval.tasks import DIRECTORY

    if yaml_path is None:
        return False
    roots = {Path(p).resolve() for p in manager.include_path or ()} - {DIRECTORY.resolve()}
    return bool(roots & set(Path(yaml_path).resolve().parents))


def missing_data_file(name: str, yaml_path, config: dict, keys: Keys) -> None:
    """TaskError naming the file and key if a task file's local data_files (no wildcards) are not there."""
    from pathlib import Path

    if not local_data(config):
        return
    files = relative_to_file(config, yaml_path).get("dataset_kwargs", {}).get("data_files")
    listed = files.values() if isinstance(files, dict) else [files]
    for path in (p for value in listed for p in (value if isinstance(value, list) else [value])):
        if isinstance(path, str) and "://" not in path and not any(c in path for c in "*?[") and not Path(path).exists():
            raise TaskError(f"{keys.tasks}: {name}: {yaml_path}: dataset_kwargs.data_files: {path} does not exist "
                            f"(a relative path is relative to the task file)")


def task_file_mistake(error: BaseException) -> str:
    """What the harness found wrong in a task file, naming the key: a template's (doc_to_text, doc_to_target,
    doc_to_choice, ...) from the harness's frame that applied it, with the documents' fields; an unknown key;
    others' as the harness says them (its messages name the key: "Got invalid output_type 'nonsense', ...")."""
    import traceback

    if isinstance(error, TypeError) and (unknown := re.search(r"unexpected keyword argument '(\w+)'", str(error))):
        return f"{unknown[1]}: not a setting of the harness's task files"
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__) if frame.f_code.co_name.startswith("doc_to_")]
    if not frames:
        return first_line(error)
    doc = frames[-1].f_locals.get("doc")
    fields = f" (the documents' fields: {', '.join(map(str, doc))})" if isinstance(doc, dict) else ""
    return f"{frames[-1].f_code.co_name}: {first_line(error)}{fields}"


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
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # (BOOTSTRAP_ITERS)
    go_offline(download)
    if not offline():
        check_internet(keys)
    manager = task_manager(names, include_path, keys)
    check_tasks(names, manager, keys)
    return manager


class DuringTraining:
    """Training's eval.tasks (zerolm.train.loop): the tasks evaluated with a training run's current parameters on
    its own mesh, sharded as trained. The backend is made once, so its programs compile at the first
    evaluation only; standard errors are not bootstrapped (a number per metric, as the loss is)."""

    def __init__(self, names: list[str], manager, loaded, limit: int | None):
        """`loaded`: a zerolm.eval.harness.Loaded of the run's model, mesh and tokenizer (its params replaced at
        each evaluation). Batches are the backend's default rows (rounded up to a multiple of dp): the
        scores' float32 logits are whole rows × length × vocab, which the training step never holds."""
        from zerolm.eval.harness import ZerolmLM

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
    """The harness's results for `names` with the model `lm` (a zerolm.eval.harness.ZerolmLM); their config
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
