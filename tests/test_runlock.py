"""One run per checkpoint directory: the local OS lock. (The gs:// lease, on a real GCS server: test_storage.py.)"""

import json

import pytest

from zerolm.runlock import LOCK_FILE, LockHeld, RunLock


def test_local_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    with RunLock.acquire(str(tmp_path / "ckpt")) as lock:
        holder = json.loads((tmp_path / "ckpt" / LOCK_FILE).read_text())
        with pytest.raises(LockHeld, match=rf"^{tmp_path}/ckpt: in use by another run \(host {holder['host']}, "
                                           rf"pid {holder['pid']}, since .+ UTC\); wait for it to end or stop it"):
            RunLock.acquire(str(tmp_path / "ckpt"))
        assert lock.taken_over is None
    RunLock.acquire(str(tmp_path / "ckpt")).release()  # released: free again
