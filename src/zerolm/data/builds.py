"""Where `zerolm prepare` builds a dataset before it is published, so that it appears whole or not at all:
a local sibling directory renamed into place, a gs:// build prefix published by writing the manifest last,
or the shared directory of an N-part prepare (zerolm.data.prepare's docstring tells the whole story); and
what an earlier prepare, killed, left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

from etils import epath

from zerolm.core import storage
from zerolm.core.errors import ZerolmError
from zerolm.data.manifest import MANIFEST, DataError, Manifest


class PrepareError(ZerolmError):
    """A prepare that cannot go ahead; one line naming the path or source at fault."""


class LocalBuild:
    """A local dataset is built in a sibling directory and renamed into place."""

    prefix = ""  # shard names are relative to the dataset directory

    def __init__(self, out: Path):
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.removed = remove_dead_partials(out)
        self.directory = out.parent / f".{out.name}.partial-{socket.gethostname()}-{os.getpid()}"
        self.directory.mkdir()

    def publish(self, manifest: str) -> None:
        (self.directory / MANIFEST).write_text(manifest)
        _move_into_place(self.directory, self.out)

    def abandon(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# gs:// builds: OUT/build-<time>-<host>-<pid>/
_BUILD = re.compile(r"^build-\d{8}T\d{6}-(?P<host>.+)-(?P<pid>\d+)$")
_PARTS = re.compile(r"^parts-of-\d+$")


class BucketBuild:
    """A gs:// dataset is built under a prefix of its own inside OUT and published by writing the
    manifest last (GCS has no rename; a single object write is atomic)."""

    def __init__(self, out: epath.Path):
        self.out = out
        host = socket.gethostname()
        self.removed = []
        for p in out.iterdir() if out.exists() else ():
            match = _BUILD.match(p.name)
            if match and match["host"] == host and not _alive(int(match["pid"])) and not _published(out, p.name):
                storage.remove_tree(p)
                self.removed.append(p.name)
        name = f"build-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{host}-{os.getpid()}"
        self.directory, self.prefix = out / name, f"{name}/"

    def publish(self, manifest: str) -> None:
        _publish_over(self.out, manifest, keep=self.prefix.rstrip("/"))

    def abandon(self) -> None:
        storage.remove_tree(self.directory)


SETTINGS = "settings.json"
FINALIZE_LOCK = "finalize.lock"
FINALIZE_STALE_S = 600.0  # a finalize takes seconds: a lock this old was left by a part that died


class PartsBuild:
    """One part of an N-part prepare: units go to `OUT/parts-of-N/`, shared by every part; the first part
    to start writes the settings there, every other part must bring the same."""

    @staticmethod
    def name(parts: int) -> str:
        return f"parts-of-{parts}"

    def __init__(self, out: Path | epath.Path, parts: int, settings: dict):
        self.out, self.prefix = out, f"{self.name(parts)}/"
        self.directory = out / self.name(parts)
        where = self.directory / SETTINGS
        self.removed: list[str] = []  # a part's leftovers are its own units: write_unit replaces them
        self._locked: epath.Path | Path | None = None  # the finalize lock, while this part holds it
        mine = json.dumps(settings, indent=1, sort_keys=True)
        ours = json.loads(mine)  # the settings as JSON has them (tuples are lists)
        theirs = json.loads(storage.create_once(where, mine))
        if theirs != ours:
            key = next(k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k))
            fix = ("prepare into another --out" if self.published() is not None
                   else f"or remove {self.directory} to start again")
            raise PrepareError(f"{where}: the parts already there were prepared with {key} = "
                               f"{_short(theirs.get(key))}, this one with {_short(settings.get(key))}; every part takes "
                               f"the same source and settings ({fix})")

    def published(self) -> Manifest | None:
        """The dataset these parts published, if they did."""
        try:
            manifest = Manifest.parse((self.out / MANIFEST).read_text(), str(self.out / MANIFEST))
        except (FileNotFoundError, DataError):
            return None
        return manifest if manifest.tokenizer.file.startswith(self.prefix) else None

    def may_finalize(self) -> bool:
        """Whether this part publishes the dataset: not if it is published already, and only one part at a
        time (a lock file; one a dead process left, on this host, or older than FINALIZE_STALE_S, is taken
        over)."""
        if self.published() is not None:
            return False
        lock = self.directory / FINALIZE_LOCK
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()})
        for _ in range(2):
            if storage.create_once(lock, me) == me.encode():
                self._locked = lock
                return True
            try:
                holder = json.loads(lock.read_text())
            except (FileNotFoundError, ValueError):
                continue
            dead = holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", 0)))
            if not (dead or time.time() - float(holder.get("time", 0)) > FINALIZE_STALE_S):
                return False
            storage.remove_tree(lock)
        return False

    def publish(self, manifest: str) -> None:
        _publish_over(self.out, manifest, keep=self.prefix.rstrip("/"))
        self.abandon()

    def abandon(self) -> None:
        # The unit being packed removed itself; complete ones stay for the next run of this part.
        if self._locked is not None:
            storage.remove_tree(self._locked)
            self._locked = None


Build = LocalBuild | BucketBuild | PartsBuild  # where a dataset is built before it is published


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _publish_over(out, manifest: str, keep: str) -> None:
    """Write OUT/manifest.json (the moment the dataset appears), then delete what the dataset it replaced
    held, but `keep`."""
    old = _dataset_files(out) if (out / MANIFEST).exists() else set()
    storage.write_atomic(out / MANIFEST, manifest)
    for name in sorted(old - {MANIFEST, keep}):  # --overwrite: the old one goes now
        storage.remove_tree(out / name)


def _ours(out, parts: int) -> bool:
    try:
        return PartsBuild.name(parts) in _dataset_files(out)
    except (OSError, DataError):
        return False


def _dataset_files(out) -> set[str]:
    """The top-level names of a prepared dataset's files (a gs:// build is one name)."""
    manifest = Manifest.parse((out / MANIFEST).read_text(), str(out / MANIFEST))
    # `zerolm contamination`'s results (zerolm.data.contamination) describe the dataset: they go with it
    return {MANIFEST, "contamination", *(name.split("/", 1)[0] for name in manifest.files())}


def _published(out, name: str) -> bool:
    try:
        return name in _dataset_files(out)
    except (OSError, DataError):
        return False


def check_out(out: Path | epath.Path, overwrite: bool, parts: int | None = None) -> None:
    """prepare writes only into a missing or empty directory, or (--overwrite) over an earlier prepared
    dataset that holds nothing else: never over files of the user's. (Builds that a prepare into gs://
    left unfinished are its own files.)"""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"{out}: exists and is not a directory")
    names = {p.name for p in out.iterdir()} if out.exists() else set()
    names = {n for n in names if not (storage.is_remote(out) and _BUILD.match(n)) and not _PARTS.match(n)}
    if not names:
        return
    if MANIFEST in names and parts is not None and _ours(out, parts):
        return  # these parts' own dataset: the settings decide (a part run again after it was published)
    if MANIFEST not in names:
        raise PrepareError(f"{out}: is not empty and holds no prepared dataset ({MANIFEST}); prepare writes only "
                           "into a missing or empty directory: choose another --out")
    if not overwrite:
        raise PrepareError(f"{out}: already holds a prepared dataset; pass --overwrite to replace it")
    try:
        ours = _dataset_files(out)
    except (DataError, OSError) as e:
        raise PrepareError(f"{out}/{MANIFEST}: unreadable ({e}); --overwrite replaces only a prepared dataset, "
                           "so nothing was touched") from None
    foreign = sorted(names - ours)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise PrepareError(f"{out}: holds {foreign[0]}{more}, which no prepare wrote; --overwrite replaces only a "
                           "prepared dataset: move them out first")


def remove_dead_partials(out: Path) -> list[str]:
    """Partial directories of `out` left by a prepare on this host whose process is gone."""
    removed = []
    prefix = f".{out.name}.partial-{socket.gethostname()}-"
    for path in out.parent.glob(f".{out.name}.partial-*"):
        pid = path.name.removeprefix(prefix)
        if path.name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _move_into_place(tmp: Path, out: Path) -> None:
    """Swap the finished directory in; the old dataset (if any) is removed only after."""
    if out.exists() and any(out.iterdir()):
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
