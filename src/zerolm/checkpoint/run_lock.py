"""One run per checkpoint directory: a lock that a training run holds for its whole life.

Local directories get an OS lock (`flock`) on `<dir>/zerolm.lock`. The kernel releases it when the
process ends, however it ends (`kill -9` included), so a local lock is never stale; the file's
content only names the holder for the message a second run prints.

On gs:// there is no OS lock and no rename, so the lock is a lease: the object `<dir>/zerolm.lease`
names the holder and carries a heartbeat that a background thread renews every `heartbeat_s`. Every
write of it is conditional on the object's generation (`storage.Versioned`): it is created only if
absent, and renewed or taken over only if it is still the version this run last saw. Of several runs
that start at once, or that find the same stale lease, exactly one wins; the others are refused with
one line naming the winner. A lease whose heartbeat is older than `stale_after_s` belongs to a dead
run and is taken over (the new holder says so), as is at once one whose holder ran on this host and
is gone; a live holder's lease is never older than that. A
holder that can no longer renew its lease (storage unreachable past its clients' retries, or the
lease taken over after all) records why, and `check()` raises it as a StorageFault: the run stops
rather than write a directory it may no longer own. Heartbeats compare the holder's clock with the
reader's: the hosts' clocks must agree to well within `stale_after_s` (NTP; a TPU VM's are).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

from zerolm.core.errors import ZerolmError
from zerolm.core.storage import StorageFault, Versioned, is_remote

LOCK_FILE = "zerolm.lock"
LEASE_FILE = "zerolm.lease"


class LockHeld(ZerolmError):
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
        self.failure: str | None = None  # set by a lease that could not be renewed

    @staticmethod
    def acquire(directory: str, *, stale_after_s: float = 120.0, heartbeat_s: float = 20.0,
                what: str = "checkpoint directory") -> RunLock:
        """Lock `directory` (created if missing; a gs:// URL gets a lease); raises LockHeld when a live
        run holds it, or when the lock cannot be made there (its message names the directory and the
        reason). `what` names the directory's role in the messages (checkpoint directory, logging
        directory)."""
        try:
            if is_remote(directory):
                return _acquire_lease(directory.rstrip("/"), stale_after_s, heartbeat_s, what)
            return _acquire_local(Path(directory), what)
        except OSError as e:
            raise LockHeld(f"{directory}: cannot take the run lock of this {what} "
                           f"({e.strerror or e}{': ' + e.filename if getattr(e, 'filename', None) else ''}); "
                           "is it writable?") from None

    def check(self) -> None:
        """Raise StorageFault if the lease could not be kept (called every step: cheap)."""
        if self.failure is not None:
            raise StorageFault(self.failure)

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int, wait_s: float = 2.0) -> dict:
    """The lock holder's record; a holder that has just taken the lock writes it a moment later."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return json.loads(os.pread(fd, 4096, 0))
        except ValueError:  # not written yet, or caught half-written
            if time.monotonic() > deadline:
                return {}
            time.sleep(0.02)


def _acquire_local(directory: Path, what: str) -> RunLock:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise LockHeld(f"{directory}: in use by {_describe(holder)}; wait for it to end or stop it "
                       f"(one run per {what})") from None
    record = json.dumps(_holder_record()).encode()
    os.pwrite(fd, record, 0)  # written over the last holder's record, then cut to length: never empty
    os.ftruncate(fd, len(record))

    def release():
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    return RunLock(str(directory), release)


def _dead_here(holder: dict) -> bool:
    """A holder on this host whose process is gone (a run killed here, restarted here): no need to wait
    for its lease to go stale."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _acquire_lease(directory: str, stale_after_s: float, heartbeat_s: float, what: str) -> RunLock:
    lease = _Lease(directory, stale_after_s)
    generation, taken_over = lease.take(what)
    lock = RunLock(directory, None, taken_over)
    lock._release = lease.keep(lock, generation, heartbeat_s)
    return lock


@dataclasses.dataclass
class _Renewal:
    """The lease's generation this run wrote last, and when."""

    generation: int
    at: float


class _Lease:
    """The lease object's protocol against a storage with conditional writes (zerolm.core.storage.Versioned): take
    it (absent, or stale), renew it every heartbeat while the run holds it, delete it at the end."""

    def __init__(self, directory: str, stale_after_s: float):
        self.directory, self.stale_after_s = directory, stale_after_s
        self.url = f"{directory}/{LEASE_FILE}"
        self.lease = Versioned(self.url)
        self.holder = {**_holder_record(), "token": secrets.token_hex(8)}

    def record(self) -> bytes:
        return json.dumps({**self.holder, "heartbeat": time.time()}).encode()

    def holder_now(self, found: tuple[bytes, int] | None = None) -> dict:
        """The lease's holder record as found (or as read now); {} if unreadable."""
        found = found if found is not None else self.lease.read()
        try:
            return json.loads(found[0]) if found is not None else {}
        except ValueError:
            return {}

    def take(self, what: str) -> tuple[int, dict | None]:
        """(the generation written, the holder taken over from, if the lease was stale); LockHeld if in use."""
        current = self.lease.read()
        if current is None:
            generation = self.lease.write(self.record(), 0)
            if generation is None:
                raise LockHeld(f"{self.directory}: in use by {_describe(self.holder_now())}, which started at the "
                               f"same moment (one run per {what})")
            return generation, None
        taken_over = self.holder_now(current)
        age = time.time() - float(taken_over.get("heartbeat", 0))
        if age < self.stale_after_s and not _dead_here(taken_over):
            raise LockHeld(f"{self.directory}: in use by {_describe(taken_over)}, lease renewed {max(age, 0):.0f} s "
                           f"ago; wait for it to end or stop it (a lease older than {self.stale_after_s:.0f} s is "
                           "taken over)")
        generation = self.lease.write(self.record(), current[1])
        if generation is None:
            raise LockHeld(f"{self.directory}: in use by {_describe(self.holder_now())}, which took over the "
                           "stale lease at the same moment")
        return generation, taken_over

    def keep(self, lock: RunLock, generation: int, heartbeat_s: float):
        """Renew the lease every `heartbeat_s` on a thread (a renewal that fails sets `lock.failure`, which the
        run checks); returns the release: stop renewing, and delete the lease unless it was lost."""
        stop = threading.Event()
        held = _Renewal(generation, time.time())

        def heartbeat() -> None:
            while not stop.wait(heartbeat_s):
                try:
                    renewed = self.lease.write(self.record(), held.generation)
                except StorageFault as e:
                    lock.failure = (f"{e}; the run's lease went {time.time() - held.at:.0f} s without renewal, so "
                                    f"the run stops (another run may take {self.directory} over once it is "
                                    f"{self.stale_after_s:.0f} s old)")
                    return
                if renewed is None:
                    lock.failure = (f"{self.url}: the lease was taken over by {_describe(self.holder_now())}; this "
                                    "run stops so that two runs never write one directory")
                    return
                held.generation, held.at = renewed, time.time()

        thread = threading.Thread(target=heartbeat, name="zerolm-lease", daemon=True)
        thread.start()

        def release():
            stop.set()
            thread.join()
            if lock.failure is None:
                try:
                    self.lease.delete(held.generation)
                except StorageFault as e:  # the lease goes stale and is taken over; nothing else is lost
                    print(f"warning: {e}; the lease will be taken over once stale", file=sys.stderr)

        return release
