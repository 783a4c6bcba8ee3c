"""Real multi-process runs: 2 processes × 4 CPU devices, joined by jax.distributed on 127.0.0.1."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, free_port, requires_devices
from zerolm.data import prepare as prep
from zerolm.data.loader import BatchLoader
from zerolm.data.shards import PreparedDataset
from zerolm.parallel.mesh import make_mesh

pytestmark = pytest.mark.slow  # multi-process runs through jax.distributed


def launch(task_args: list[str], n: int = 2, timeout: int = 300) -> None:
    """Start n worker processes and wait for all; fail with their output if any fails."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "multihost_worker.py"), *task_args,
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(n)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{outputs[i][-3000:]}"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("mh") / "kjv"
    prep.prepare("default", out, seq_len=32, samples_per_shard=1000, progress=False)
    return out


@requires_devices(8)
def test_two_processes_build_the_same_batches_as_one(dataset, tmp_path):
    resume = int(np.random.default_rng().integers(1, 6))  # a random restart step (in the message on failure)
    launch(["loader", "--devices", "4", "--dataset", str(dataset), "--out", str(tmp_path), "--resume-step", str(resume)])
    results = [np.load(tmp_path / f"process{i}.npz") for i in range(2)]

    split = PreparedDataset(dataset).split("train")
    one_process = {"dp8_tp1": make_mesh(8, 1), "dp4_tp2": make_mesh(4, 2)}
    for name in ("dp8_tp1", "dp4_tp2", "dp4_tp2_tp_by_host"):
        mesh = one_process[name.removesuffix("_tp_by_host")]
        loader = BatchLoader(split, mesh, global_batch_size=16, micro_batch_size=2, seed=7)
        expected = np.stack([np.asarray(loader.global_batch(s)) for s in range(max(6, resume + 3))])
        for r in results:
            np.testing.assert_array_equal(r[f"{name}.straight"], expected[:6], err_msg=name)
            np.testing.assert_array_equal(r[f"{name}.resumed"], expected[resume:resume + 3],
                                          err_msg=f"{name} resumed at {resume}")

    # Each process reads only its own devices' rows: 6 steps of 16 rows, shared between the readers.
    assert [int(r["dp8_tp1.rows_read"]) for r in results] == [6 * 8, 6 * 8]
    assert [int(r["dp4_tp2.rows_read"]) for r in results] == [6 * 8, 6 * 8]
    # With every tp = 0 device on host 0, host 1 reads nothing and gets the rows over tp.
    assert [int(r["dp4_tp2_tp_by_host.rows_read"]) for r in results] == [6 * 16, 0]
    assert jax.process_count() == 1
