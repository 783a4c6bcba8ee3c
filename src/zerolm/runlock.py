"""One run per checkpoint directory: a lock that a training run holds for its whole life.

Local directories get an OS lock (`flock`) on `<dir>/zerolm.lock`. The kernel releases it when the
process ends, however it ends (`kill -9` included), so a local lock is never stale; the file's
content only names the holder for the message a second run prints.

Object stores (`gs://...`) have no OS lock, and orbax offers none, so there the lock is a lease:
`<dir>/zerolm.lease` holds the holder and a heartbeat that a background thread renews every
`heartbeat_s`. A lease whose heartbeat is older than `stale_after_s` belongs to a dead run and is
taken over (and the new holder says so). Object stores give no atomic create here, so two runs
starting within a second of each other are told apart by writing, waiting, and reading back. The
lease is written beside itself and renamed into place, so a reader never sees a half-written one
(which it would take for no lease at all).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

from etils import epath

LOCK_FILE = "zerolm.lock"
LEASE_FILE = "zerolm.lease"


class LockHeld(Exception):
    """Another live run holds the directory; the message names it (host, pid, since when). Also raised,
    naming the directory and the reason, when the lock cannot be taken at all (a read-only disk)."""


def _holder_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": " ".join(sys.argv)[:300]}


def _describe(holder: dict) -> str:
    if not holder:
        return "another run (it is still starting)"
    return f"another run (host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')})"


class RunLock:
    """Held from `acquire` until `release` (or until the process ends)."""

    def __init__(self, directory: str, release_fn, taken_over: dict | None = None):
        self.directory = directory
        self._release = release_fn
        self.taken_over = taken_over  # a remote lease of a dead run that this run took over

    @staticmethod
    def acquire(directory: str, *, stale_after_s: float = 120.0, heartbeat_s: float = 20.0,
                lease: bool | None = None, what: str = "checkpoint directory") -> RunLock:
        """Lock `directory` (created if missing); raises LockHeld when a live run holds it, or when
        the lock cannot be made there (its message names the directory and the reason).

        `lease` picks the mechanism; by default the OS lock for local paths and the lease for URLs.
        `what` names the directory's role in the messages (checkpoint directory, logging directory).
        """
        remote = "://" in directory
        try:
            if lease if lease is not None else remote:
                return _acquire_lease(epath.Path(directory), stale_after_s, heartbeat_s, what)
            return _acquire_local(Path(directory), what)
        except OSError as e:
            raise LockHeld(f"{directory}: cannot take the run lock of this {what} "
                           f"({e.strerror or e}{': ' + e.filename if getattr(e, 'filename', None) else ''}); "
                           "is it writable?") from None

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _acquire_local(directory: Path, what: str) -> RunLock:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        raise LockHeld(f"{directory}: in use by {_describe(holder)}; wait for it to end or stop it "
                       f"(one run per {what})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_holder_record()).encode(), 0)

    def release():
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    return RunLock(str(directory), release)


def _acquire_lease(directory: epath.Path, stale_after_s: float, heartbeat_s: float, what: str) -> RunLock:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LEASE_FILE

    def read() -> dict | None:
        with contextlib.suppress(FileNotFoundError, ValueError, OSError):
            return json.loads(path.read_text())
        return None

    current = read()
    taken_over = None
    if current is not None:
        age = time.time() - float(current.get("heartbeat", 0))
        if age < stale_after_s:
            raise LockHeld(f"{directory}: in use by {_describe(current)}, lease renewed {age:.0f} s ago; wait "
                           f"for it to end or stop it (a lease older than {stale_after_s:.0f} s is taken over)")
        taken_over = current
    token = secrets.token_hex(8)
    record = {**_holder_record(), "token": token}

    def write() -> None:
        staged = directory / f".{LEASE_FILE}.{token}"
        staged.write_text(json.dumps({**record, "heartbeat": time.time()}))
        staged.replace(path)

    write()
    time.sleep(min(1.0, heartbeat_s))  # a run that wrote at the same moment: the last writer wins
    if (read() or {}).get("token") != token:
        raise LockHeld(f"{directory}: in use by {_describe(read() or {})}, which started at the same moment")

    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(heartbeat_s):
            if (read() or {}).get("token") != token:
                print(f"warning: {path}: the lease was taken over by {_describe(read() or {})}", file=sys.stderr)
                return
            write()

    thread = threading.Thread(target=heartbeat, name="zerolm-lease", daemon=True)
    thread.start()

    def release():
        stop.set()
        thread.join()
        if (read() or {}).get("token") == token:
            path.unlink(missing_ok=True)

    return RunLock(str(directory), release, taken_over)
