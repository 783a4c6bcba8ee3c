"""One run per checkpoint directory: the local OS lock and the object-store lease."""

import json
import time

import pytest

from zerolm.runlock import LEASE_FILE, LOCK_FILE, LockHeld, RunLock


def test_local_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    with RunLock.acquire(str(tmp_path / "ckpt")) as lock:
        holder = json.loads((tmp_path / "ckpt" / LOCK_FILE).read_text())
        with pytest.raises(LockHeld, match=rf"^{tmp_path}/ckpt: in use by another run \(host {holder['host']}, "
                                           rf"pid {holder['pid']}, since .+ UTC\); wait for it to end or stop it"):
            RunLock.acquire(str(tmp_path / "ckpt"))
        assert lock.taken_over is None
    RunLock.acquire(str(tmp_path / "ckpt")).release()  # released: free again


def test_lease_is_refused_while_fresh_and_taken_over_when_stale(tmp_path):
    directory = str(tmp_path / "bucket" / "run")
    first = RunLock.acquire(directory, lease=True, stale_after_s=60, heartbeat_s=0.05)
    lease = tmp_path / "bucket" / "run" / LEASE_FILE
    beat = json.loads(lease.read_text())["heartbeat"]
    time.sleep(0.3)
    assert json.loads(lease.read_text())["heartbeat"] > beat  # the heartbeat thread renews it
    with pytest.raises(LockHeld, match=r"in use by another run \(host .+, pid \d+, since .+\), lease renewed 0 s ago"):
        RunLock.acquire(directory, lease=True, stale_after_s=60, heartbeat_s=0.05)
    first.release()
    assert not lease.exists()

    # A dead run's lease: its heartbeat stopped long ago.
    lease.write_text(json.dumps({"host": "old-host", "pid": 1, "since": "then", "heartbeat": time.time() - 3600,
                                 "token": "dead"}))
    second = RunLock.acquire(directory, lease=True, stale_after_s=60, heartbeat_s=0.05)
    assert second.taken_over["host"] == "old-host"
    second.release()


def test_a_lease_being_renewed_is_never_seen_half_written(tmp_path):
    # A half-written lease reads as no lease, and a second run would take a live run's directory.
    directory = str(tmp_path / "bucket" / "run")
    with RunLock.acquire(directory, lease=True, stale_after_s=60, heartbeat_s=0.001):
        lease = tmp_path / "bucket" / "run" / LEASE_FILE
        for _ in range(3000):
            assert "token" in json.loads(lease.read_text())
    assert list(lease.parent.iterdir()) == []  # released: no lease and no staged copy left behind
