"""Several slices (`mesh.slices`, Cloud TPU Multislice): the config's refusals, the (slice, dp, tp) mesh, and runs
whose processes are grouped as slices giving what one slice gives. The step's own equalities and collectives
are in test_zero_stages.py; the compiled multi-slice TPU step's data-center-network bytes in test_dcn.py."""

import importlib.util
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from conftest import REPO, TINY, requires_devices
from runs import env, logged_steps, losses, shared_run, train
from zerolm.checkpoint.store import Checkpoints
from zerolm.config.load import load_config
from zerolm.config.section import ConfigError
from zerolm.core.exitcodes import EXIT_PEER_LOST
from zerolm.parallel.mesh import SLICE, SliceError, data_axes, data_ranks, make_mesh, slice_groups


@pytest.mark.parametrize("overrides, devices, message", [
    (["mesh.slices=3"], 8, "mesh.slices: 3 slices do not divide the 8 devices"),
    (["mesh.slices=2", "mesh.dp=8"], 8, "mesh.dp: dp × tp = 8 × 1 = 8 devices, but each of the 2 slices has 4: dp and "
                                        "tp are the mesh inside one slice (dp may not cross a slice)"),
    (["mesh.slices=2", "mesh.tp=8"], 8, "mesh.tp: tp=8 does not divide the 4 devices of each of 2 slices"),
    (["mesh.slices=0"], 8, "mesh.slices: Input should be greater than 0 (got 0)"),
    (["mesh.slices=2", "train.global_batch_size=12", "train.micro_batch_size=2"], 8,
     "train.global_batch_size: 12 is not divisible by micro_batch_size × slices × dp = 2 × 2 × 4 = 16"),
])
def test_a_bad_slice_count_is_one_line_naming_the_key(overrides, devices, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides, device_count=devices)
    assert str(e.value).endswith(message) and "\n" not in str(e.value), str(e.value)


def test_dp_auto_is_each_slices_devices_less_tp_and_the_batch_splits_over_slices_and_dp():
    cfg = load_config(TINY, ["mesh.slices=2", "mesh.tp=2", "train.global_batch_size=16", "train.micro_batch_size=2"],
                      device_count=8)
    assert (cfg.mesh.slices, cfg.dp, cfg.mesh.tp, cfg.data_ranks, cfg.device_count) == (2, 2, 2, 4, 8)
    assert cfg.accum_steps == 2  # 16 rows over 4 data ranks, 2 a micro-batch


@requires_devices(8)
def test_the_mesh_lays_each_slice_on_its_own_devices():
    """In one process (no slice_index, one process): the devices in halves, slice-major; dp and tp inside each."""
    mesh = make_mesh(2, 2, jax.devices()[:8], slices=2)
    assert mesh.axis_names == (SLICE, "dp", "tp") and dict(mesh.shape) == {SLICE: 2, "dp": 2, "tp": 2}
    assert [sorted(d.id for d in mesh.devices[s].flat) for s in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert data_axes(mesh) == (SLICE, "dp") and data_ranks(mesh) == 4
    flat = make_mesh(8, 1, jax.devices()[:8])
    assert data_axes(flat) == "dp" and data_ranks(flat) == 8


def test_tpu_devices_are_grouped_by_their_slice_and_a_wrong_count_is_refused():
    devices = [SimpleNamespace(id=i, slice_index=i % 2, process_index=0, platform="tpu") for i in range(8)]  # interleaved on purpose: grouped by slice_index, not by position
    assert [[d.id for d in g] for g in slice_groups(devices, 2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(SliceError, match=r"^mesh.slices: 4, but the devices are in 2 slice\(s\) \(0, 1\); set "
                                         r"mesh.slices to 2$"):
        slice_groups(devices, 4)


def test_a_process_told_another_slice_is_refused_naming_the_key(monkeypatch):
    """A process's MEGASCALE_SLICE_ID (a TPU VM's, or launch-local --slices's) must be its group of consecutive
    processes: process 0 of two slices of one process each is in slice 0."""
    from zerolm.parallel import mesh

    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    with pytest.raises(SliceError, match=r"^mesh.slices: process 0 is told it is in slice 1 \(MEGASCALE_SLICE_ID\), "
                                         r"but the slices are 2 groups of 1 consecutive processes: it would be in "
                                         r"slice 0$"):
        mesh._check_told_slice([0, 1], 1)
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "0")
    mesh._check_told_slice([0, 1], 1)


# Processes grouped as slices through `zerolm launch-local --slices N` (test_launch.py's runs: the tiny model,
# 8 devices in all, a checkpoint every 4 steps of a 16-step schedule; SHORT of them run).
SHORT = 8


def launched_slices(run_dir, *sets, slices: int, processes: int, devices: int, steps: int = SHORT, expect=0):
    from test_launch import launch_command

    cmd = launch_command(run_dir, *sets, steps=steps, processes=processes, devices=devices)
    cmd[cmd.index("--"):cmd.index("--")] = ["--slices", str(slices)]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def one_slice(tmp_path_factory):
    run_dir = shared_run(tmp_path_factory, "straight")  # test_launch's and test_checkpoint's reference: 1 × 8
    return run_dir, losses(run_dir)


@pytest.fixture(scope="module")
def two_slices(tmp_path_factory):
    """Two processes of 4 devices, each its own slice (slice 2 × dp 4)."""
    run_dir = tmp_path_factory.mktemp("two-slices")
    out, err = launched_slices(run_dir, slices=2, processes=2, devices=4)
    return run_dir, losses(run_dir), out, err


@pytest.mark.slow  # multi-process training runs
def test_two_slices_of_processes_train_as_one_slice(one_slice, two_slices):
    """The same global batch on slice 2 × dp 4 (a process each, told its slice) as on one process of dp 8: the same
    losses to float32 summation order (a reduce-scatter inside each slice, then an all-reduce across: gloo's
    here); the header says the mesh and the one cross-slice reduction; the checkpoint records the slices."""
    (_, reference), (run_dir, got, out, err) = one_slice, two_slices
    assert "launch-local: 2 process(es) in 2 slices × 4 CPU device(s)" in err
    assert "mesh slices=2 × dp=4 tp=1" in out and "each of the 2 slices holds all of it" in out
    grad = next(line for line in out.splitlines() if line.startswith("collectives per step: grad: "))
    assert "all-reduce over slice" in grad and "INSIDE" not in grad, grad
    assert sorted(got) == list(range(1, SHORT + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [reference[s] for s in sorted(got)], rtol=2e-5)
    meta = Checkpoints(run_dir / "ckpt", read_only=True).meta(SHORT)
    assert (meta.slices, meta.dp) == (2, 4)


@pytest.mark.slow  # multi-process training runs
def test_a_two_slice_checkpoint_resumes_on_four_slices_and_on_one(one_slice, two_slices, tmp_path):
    """Saved by slice 2 × dp 4 at step 4, resumed by 4 slices of one process × 2 devices (dp 2: the optimizer state
    laid out again) for two steps, then by one process of dp 8: the losses of one slice throughout."""
    (_, reference), (run_dir, *_) = one_slice, two_slices
    shutil.copytree(run_dir / "ckpt", tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / str(SHORT))
    out, _ = launched_slices(tmp_path, slices=4, processes=4, devices=2, steps=6)
    assert "resumed from" in out and "slices changed: 2 -> 4" in out and "dp 4 -> 2" in out
    proc = train(tmp_path, steps=SHORT)  # one process, one slice
    assert "slices changed: 4 -> 1" in proc.stdout and "resumed from" in proc.stdout
    got = losses(tmp_path)
    np.testing.assert_allclose([got[s] for s in range(5, SHORT + 1)], [reference[s] for s in range(5, SHORT + 1)],
                               rtol=2e-5)


@pytest.mark.slow  # multi-process training runs
def test_kill_9_of_one_slice_stops_every_slice_and_a_relaunch_resumes_bit_identical(two_slices, tmp_path):
    from test_launch import launch_command, pids, read_launcher_err, wait_for

    _, reference, *_ = two_slices
    cmd = launch_command(tmp_path, steps=SHORT, processes=2, devices=4)
    cmd[cmd.index("--"):cmd.index("--")] = ["--slices", "2"]
    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_line = read_launcher_err(proc)
    wait_for(proc, lambda: (Checkpoints(tmp_path / "ckpt", read_only=True).latest_step() or 0) >= 4
             and logged_steps(tmp_path) >= 5)
    subprocess.run(["kill", "-9", str(pids(first_line)[1])], check=True)  # slice 1's one process
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PEER_LOST, err[-2000:]
    assert "launch-local: process 1 was killed by SIGKILL" in err
    launched_slices(tmp_path, slices=2, processes=2, devices=4)
    assert losses(tmp_path) == reference  # bit-identical to the uninterrupted two-slice run


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]'): no TPU compiler here")


def compiled_for_two_slices(*sets: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "compile", "--config", str(TINY), "--target", "v5e-8",
                           "--slices", "2", "--json", "--set", "train.global_batch_size=64", *[
                               a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, cwd=REPO, timeout=900,
                          env={k: v for k, v in env().items() if k != "XLA_FLAGS"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@needs_libtpu
@pytest.mark.slow  # four TPU compiles
@pytest.mark.parametrize("stage", [1, 3])
def test_compiled_for_two_tpu_slices_only_each_devices_block_crosses_once_per_step(stage):
    """`zerolm compile --target v5e-8 --slices 2`: libtpu compiles one program per slice, every collective inside it
    (over dp); what crosses slices (its Megascale transfers, read as DCN) is one all-reduce of each device's block of
    the gradient and the loss, after the loop, the planner's count to the compiler's padding; the same bytes at one
    accumulation step and at two; the modeled step charges them at the DCN rate."""
    one, two = (compiled_for_two_slices(f"zero.stage={stage}", f"train.micro_batch_size={micro}") for micro in (4, 2))
    assert (one["accum_steps"], two["accum_steps"], one["slices"], one["mesh"]) == (1, 2, 2, {"slice": 2, "dp": 8,
                                                                                              "tp": 1})
    for r in (one, two):
        dcn = [c for c in r["collectives"] if c["link"] == "dcn"]
        assert {(c["program"], c["op"], c["in_loop"], tuple(c["span"])) for c in dcn} == {
            ("grad", "all-reduce", False, ("slice",))}
        assert all("slice" not in c["axes"] for c in r["collectives"] if c["link"] == "ici")
        assert r["dcn_bytes_per_device_per_step"] == sum(c["bytes_per_run"] for c in dcn)
        predicted = next(p for p in r["predicted"] if p["span"] == ["slice"])
        assert predicted["bytes_per_step"] == pytest.approx(r["dcn_bytes_per_device_per_step"], rel=0.01)
        assert r["step_model"]["dcn_bytes"] == r["dcn_bytes_per_device_per_step"] and r["step_model"]["dcn_s"] > 0
    assert one["dcn_bytes_per_device_per_step"] == two["dcn_bytes_per_device_per_step"]  # not per micro-step
    planned = plan_json("--config", str(TINY), "--device", "v5e", "--dp", "8", "--slices", "2", "--global-batch", "64",
                        "--set", f"zero.stage={stage}", "--json")  # `zerolm plan`'s count, before any compile
    assert planned["step"]["dcn_bytes"] == pytest.approx(one["dcn_bytes_per_device_per_step"], rel=0.01)


def plan_json(*args: str, expect=0) -> dict | str:
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "plan", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env=env())
    assert proc.returncode == expect, proc.stderr[-3000:]
    return json.loads(proc.stdout) if expect == 0 else proc.stderr


def test_the_planner_charges_each_devices_block_across_slices_at_the_dcn_rate():
    """`zerolm plan --slices N`: the batch over slices × dp, the memory of one slice's ZeRO, and across slices each
    device's block of the gradient (the whole over dp: 1/dp of it) at the device's share of its host's DCN."""
    args = ("--config", str(TINY), "--device", "v5e", "--dp", "8", "--global-batch", "64", "--micro-batch", "2",
            "--json")
    one, two = plan_json(*args), plan_json(*args, "--slices", "2")
    assert (two["layout"]["slices"], two["layout"]["devices"], one["step"]["dcn_bytes"]) == (2, 16, 0)
    assert two["stages"]["1"]["total_bytes"] == one["stages"]["1"]["total_bytes"]  # a slice holds it all, as one does
    grads = two["stages"]["0"]["grads_bytes"]  # whole over dp: what a device reduces
    assert two["step"]["dcn_bytes"] == round(grads / 8)
    assert two["step"]["dcn_s"] == pytest.approx(two["step"]["dcn_bytes"] / two["device"]["dcn_bw"])
    stderr = plan_json("--config", str(TINY), "--device", "h100", "--slices", "2", expect=2)
    assert stderr.strip() == ("error: --slices: 2, but h100 devices are not joined across slices (Cloud TPU "
                              "Multislice: v4, v5e, v5p)")
