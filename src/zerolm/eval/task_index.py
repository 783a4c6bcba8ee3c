"""The harness's index of its own tasks, kept in zerolm's cache.

lm-evaluation-harness reads every task file it ships (some 14,000 YAML files) to learn their names each time
a TaskManager is made: 7 s on this project's 2-core machine, paid by every `zerolm eval --tasks` that names a
harness task or misspells one, and twice by `python -m zerolm.lm_eval_cli`. The index is a function of those
files alone, so zerolm keeps it under its cache ($ZEROLM_CACHE/lm-eval), keyed by the harness's version and
each file's path, size and modification time (checked in about 0.1 s), and builds it again when any of them
changes. Kept per entry: its name, kind, file and tags; the harness reads a task's file again to make the
task, so the parsed file the index holds in memory is not kept. Directories other than the harness's own
(zerolm's tasks, a user's --include-path) are read as the harness reads them, each time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zerolm.core.storage import cache_dir


def harness_directory() -> Path:
    """Where the harness's own task files are (what its TaskManager indexes with include_defaults)."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def fingerprint(root: Path) -> str:
    """The harness's version and every task file's path, size and modification time under `root`, hashed."""
    import lm_eval

    digest = hashlib.sha256(f"{getattr(lm_eval, '__version__', '?')}\0{root}\n".encode())
    for directory, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(".yaml"):
                stat = os.stat(path := os.path.join(directory, name))
                digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def cached_index(root: Path, build) -> dict[str, Any]:
    """The harness's index of the task files under `root` (`build([root])`, the harness's TaskIndex.build),
    read from the cache when one was built from the same files, else built and written there."""
    from lm_eval.tasks._index import Entry, Kind

    path = cache_dir() / "lm-eval" / f"task-index-{fingerprint(root)}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return {row["name"]: Entry(name=row["name"], kind=Kind[row["kind"]],
                                   yaml_path=Path(row["yaml_path"]) if row["yaml_path"] else None,
                                   tags=set(row["tags"]))
                for row in json.loads(path.read_text())}
    index = build([root])
    rows = [{"name": e.name, "kind": e.kind.name, "yaml_path": str(e.yaml_path) if e.yaml_path else None,
             "tags": sorted(e.tags)} for e in index.values()]
    if all(e.yaml_path is not None or e.cfg is None for e in index.values()):  # nothing that lives only in memory
        with contextlib.suppress(OSError):  # a cache that cannot be written: the index built, as the harness does
            _write(path, json.dumps(rows))
    return index


def _write(path: Path, text: str) -> None:
    """`text` at `path` whole or not at all (several processes may build the index at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@contextlib.contextmanager
def cached_harness_tasks() -> Iterator[None]:
    """Inside: the harness's TaskIndex.build reads its own task directory's index from the cache
    (`cached_index`); every other directory it reads as before, later ones overriding earlier ones."""
    from lm_eval.tasks._index import TaskIndex

    build = TaskIndex.build
    harness = harness_directory()

    def with_cache(paths, *, resolve_includes=True):
        index: dict[str, Any] = {}
        for root in paths:
            if resolve_includes and Path(root) == harness:
                index.update(cached_index(harness, build))
            else:
                index.update(build([root], resolve_includes=resolve_includes))
        return index

    TaskIndex.build = staticmethod(with_cache)
    try:
        yield
    finally:
        TaskIndex.build = staticmethod(build)
