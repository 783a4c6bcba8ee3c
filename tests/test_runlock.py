"""One run per checkpoint directory: the local OS lock. (The gs:// lease, on a real GCS server: test_storage.py.)"""

import json

import pytest

from zerolm.checkpoint.run_lock import LOCK_FILE, LockHeld, RunLock


def test_local_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    with RunLock.acquire(str(tmp_path / "ckpt")) as lock:
        holder = json.loads((tmp_path / "ckpt" / LOCK_FILE).read_text())
        with pytest.raises(LockHeld, match=rf"^{tmp_path}/ckpt: in use by another run \(host {holder['host']}, "
                                           rf"pid {holder['pid']}, since .+ UTC\); wait for it to end or stop it"):
            RunLock.acquire(str(tmp_path / "ckpt"))
        assert lock.taken_over is None
    RunLock.acquire(str(tmp_path / "ckpt")).release()  # released: free again


def test_a_holder_caught_before_it_wrote_its_record_is_still_named(tmp_path):
    """The holder takes the lock, then writes who it is: a run racing it in between waits for the record
    instead of saying "still starting" (the race of test_checkpoint's two runs, made certain here)."""
    import fcntl
    import os
    import threading

    (tmp_path / "ckpt").mkdir()
    fd = os.open(tmp_path / "ckpt" / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held, its record not yet written
    record = {"host": "h1", "pid": 4242, "since": "2026-11-24 00:00:00 UTC"}
    threading.Timer(0.3, lambda: os.pwrite(fd, json.dumps(record).encode(), 0)).start()
    with pytest.raises(LockHeld, match=r"in use by another run \(host h1, pid 4242, since 2026-11-24 00:00:00 UTC\)"):
        RunLock.acquire(str(tmp_path / "ckpt"))
    os.close(fd)
