"""Multi-process runs through `zerolm launch-local`: real processes joined by jax.distributed on 127.0.0.1.

2 processes × 4 CPU devices against 1 × 8, elastic restore 1 process -> 2 -> 1, SIGTERM to one process
(a preempted host), Ctrl-C to the launcher, kill -9 of one process, and the launch's bad inputs."""

import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, TINY
from runs import SMALL, STEPS, checkpoint_params, env, logged_steps, losses, shared_run, train
from zerolm.checkpoint.store import Checkpoints
from zerolm.core.exitcodes import EXIT_PEER_LOST, EXIT_PREEMPTED
from zerolm.train.launch_local import KEPT_LAUNCHES, _rotate_logs, _WithoutGloo

pytestmark = pytest.mark.slow  # multi-process training runs


def launch_command(run_dir, *extra_sets, steps=STEPS, processes=2, devices=4):
    sets = [*SMALL, f"train.steps={steps}", f"checkpoint.dir={run_dir / 'ckpt'}", f"logging.dir={run_dir / 'log'}",
            *extra_sets]
    return [sys.executable, "-m", "zerolm.cli", "launch-local", "--processes", str(processes),
            "--devices-per-process", str(devices), "--", "--config", str(TINY), *[a for s in sets for a in ("--set", s)]]


def start(run_dir, *extra_sets, **kw):
    return subprocess.Popen(launch_command(run_dir, *extra_sets, **kw), env=env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def launched(run_dir, *extra_sets, expect=0, **kw):
    proc = start(run_dir, *extra_sets, **kw)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == expect, err[-3000:]
    return out, err


def pids(err_so_far: str) -> list[int]:
    return [int(p) for p in re.search(r"pids ([\d ]+);", err_so_far).group(1).split()]


def wait_for(proc, until, timeout=240):
    deadline = time.time() + timeout
    while not until():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "timed out waiting for the run"
        time.sleep(0.05)


def read_launcher_err(proc) -> str:
    """The launcher's first stderr line (its pids), read while it runs."""
    return proc.stderr.readline()


@pytest.fixture(scope="module")
def one_by_eight(tmp_path_factory):
    """One process of 8 devices: test_checkpoint's uninterrupted reference run, made once for both."""
    run_dir = shared_run(tmp_path_factory, "straight")
    return run_dir, losses(run_dir)


@pytest.fixture(scope="module")
def two_by_four(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two")
    out, _ = launched(run_dir)
    assert "in 2 process(es)" in out
    assert "[Gloo]" in (run_dir / "log" / "process-0.log").read_text() and "Gloo" not in out  # in the log only
    return run_dir, losses(run_dir)


def test_two_processes_train_as_one(one_by_eight, two_by_four):
    """Same global batch, data order and dp = 8: only gloo's summation order differs from the in-process
    all-reduce, a float32 rounding (~1e-7 relative per step) that grows slowly over 16 Adam steps."""
    (one_dir, one), (two_dir, two) = one_by_eight, two_by_four
    assert sorted(two) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=2e-5)
    assert sorted(p.name for p in (two_dir / "log").glob("process-*.log")) == ["process-0.log", "process-1.log"]
    # The same final checkpoint, to float32 rounding: Adam divides by sqrt(v), so on a parameter whose
    # gradient is ~0 the rounding shows at ~1e-6 absolute (lr is 3e-3 a step); the whole tree to 1e-5.
    a, b = checkpoint_params(one_dir, STEPS), checkpoint_params(two_dir, STEPS)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    assert np.linalg.norm(b - a) / np.linalg.norm(a) < 1e-5


# The layouts below train as 1 process × dp 8 does from the first step on (a wrong reduction, gather or
# update shows at step 2): their first 8 steps (of the same 16-step schedule, saving at 4 and 8) are
# compared, at half the time of 16 (a step of 2 processes costs 0.5 s over gloo, of ZeRO-3's 1.7 s).
SHORT = 8


def same_losses(got: dict[int, float], reference: dict[int, float]) -> None:
    """Steps 1..SHORT logged, each the 1 × dp 8 run's loss to float32 summation order."""
    assert sorted(got) == list(range(1, SHORT + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [reference[s] for s in sorted(got)], rtol=2e-5)


def test_tensor_parallel_in_two_processes_trains_as_dp8(one_by_eight, tmp_path):
    """(dp 4, tp 2) over 2 processes × 4 devices: tp groups inside a process, the loader's tp = 0 devices
    reading; the same losses as 1 process × dp 8, to float32 summation order. (tp 4 over the same 4 devices
    measured the same; tp groups across processes: below.)"""
    _, reference = one_by_eight
    tp = 2
    out, _ = launched(tmp_path, f"mesh.tp={tp}", "sample.tokens=8", steps=SHORT)
    assert f"mesh dp={8 // tp} tp={tp}" in out
    # Every process samples (the params span both), process 0 prints; the step's tp collectives are in the loop.
    assert [line for line in out.splitlines() if line.startswith("sample: And God said,")]
    grad_line = next(line for line in out.splitlines() if line.startswith("collectives per step: grad: "))
    assert "over tp" in grad_line and "INSIDE" in grad_line and "reduce-scatter over dp" in grad_line
    same_losses(losses(tmp_path), reference)


def test_zero_stage_3_in_two_processes_trains_as_dp8(one_by_eight, tmp_path):
    """ZeRO-3 over 2 processes × 4 devices: each layer's parameters gathered across the processes inside
    the loop; the same losses as ZeRO-1 in 1 process × dp 8, to float32 summation order."""
    _, reference = one_by_eight
    out, _ = launched(tmp_path, "zero.stage=3", steps=SHORT)
    assert "ZeRO-3" in out
    grad_line = next(line for line in out.splitlines() if line.startswith("collectives per step: grad: "))
    assert "all-gather over dp" in grad_line and "INSIDE" in grad_line, grad_line
    same_losses(losses(tmp_path), reference)


def test_two_stage_reduce_scatter_across_processes_trains_as_dp8(one_by_eight, tmp_path):
    """zero.scatter=two_stage (the TPU's reduce-scatter beyond one host) over 2 processes × 4 devices: the
    second stage over a host's worth of dp positions (4), the first across the processes; the same losses
    as 1 process × dp 8, to float32 summation order."""
    _, reference = one_by_eight
    out, _ = launched(tmp_path, "zero.scatter=two_stage", steps=SHORT)
    assert "grad_reduce=reduce_scatter (two_stage)" in out
    grad_line = next(line for line in out.splitlines() if line.startswith("collectives per step: grad: "))
    assert "reduce-scatter over dp(2/8)" in grad_line and "reduce-scatter over dp(4/8)" in grad_line, grad_line
    assert "INSIDE" not in grad_line
    same_losses(losses(tmp_path), reference)


@pytest.mark.parametrize("processes, tp", [(4, 2)])  # (dp 2, tp 2): also what (2, 2) showed, beside dp
def test_tensor_parallel_across_processes_trains_as_dp8(one_by_eight, tmp_path, processes, tp):
    """tp groups that span processes (one device each, as tp pairs spanning GPU hosts): the loader's hand-over
    over tp is then a collective between processes, run in step order with the step's own (it crashed gloo
    with a "collective mismatch" when the prefetch thread ran it)."""
    _, reference = one_by_eight
    out, _ = launched(tmp_path, f"mesh.tp={tp}", processes=processes, devices=1, steps=SHORT)
    assert f"mesh dp={processes // tp} tp={tp}" in out and f"in {processes} process(es)" in out
    same_losses(losses(tmp_path), reference)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_nothing_outlives_a_killed_launcher(tmp_path, sig):
    """kill -9 of the launcher (its children get SIGTERM from the kernel) or SIGHUP (a closed terminal,
    forwarded): every process saves the step reached and is gone within seconds. (With a fresh cache,
    process 0 prepares the default dataset first: that must not take SIGTERM from JAX's preemption notifier.)"""
    proc = start(tmp_path, "checkpoint.every=1000", steps=400)
    children = pids(read_launcher_err(proc))
    wait_for(proc, lambda: logged_steps(tmp_path) >= 5)
    proc.send_signal(sig)
    killed = time.time()
    while any(alive(p) for p in children) and time.time() - killed < 30:
        time.sleep(0.1)
    assert not any(alive(p) for p in children), f"still running {time.time() - killed:.0f} s after the launcher's {sig.name}"
    assert time.time() - killed < 20
    proc.communicate(timeout=30)
    if sig == signal.SIGHUP:
        assert proc.returncode == EXIT_PREEMPTED
    latest = Checkpoints(tmp_path / "ckpt", read_only=True).latest_step()
    assert latest is not None and 5 <= latest < 400  # saved on the way out
    for i in range(2):
        assert f"preempted: checkpoint saved at step {latest}" in (tmp_path / "log" / f"process-{i}.log").read_text()


def test_a_crash_is_not_a_restart(tmp_path):
    """A process that crashes by itself (SIGABRT, as a C++ abort does) ends the launch with its own code, 134, not 76:
    a scheduler that requeues on 76 would repeat the crash forever."""
    proc = start(tmp_path, "checkpoint.every=1000", steps=400)
    children = pids(read_launcher_err(proc))
    wait_for(proc, lambda: logged_steps(tmp_path) >= 3)
    subprocess.run(["kill", "-ABRT", str(children[1])], check=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGABRT, err[-2000:]
    assert re.search(r"^launch-local: process 1 was killed by SIGABRT \(it crashed by itself: a restart would repeat "
                     r"it, see its log\)", err, re.M), err[-2000:]


def test_kill_9_of_one_process_stops_the_other_and_a_relaunch_resumes_exactly(two_by_four, tmp_path):
    _, reference = two_by_four
    proc = start(tmp_path, steps=STEPS, **{})
    first_line = read_launcher_err(proc)
    wait_for(proc, lambda: (Checkpoints(tmp_path / "ckpt", read_only=True).latest_step() or 0) >= 4
             and logged_steps(tmp_path) >= 6)
    victim = pids(first_line)[1]
    subprocess.run(["kill", "-9", str(victim)], check=True)
    killed = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - killed < 10, "the survivor and the launcher took too long to stop"
    assert proc.returncode == EXIT_PEER_LOST, err[-2000:]
    assert re.search(r"^launch-local: process 1 was killed by SIGKILL(; killed the other 1 process\(es\) after 3 s)?; "
                     r"exit codes \[(76|-9), -9\]$", err, re.M), err[-2000:]
    assert "Traceback" not in (tmp_path / "log" / "process-0.log").read_text()
    assert subprocess.run(["pgrep", "-f", str(tmp_path / "ckpt")], capture_output=True).stdout == b""  # no orphan
    latest = Checkpoints(tmp_path / "ckpt", read_only=True).latest_step()
    crashed = [(tmp_path / "log" / f"process-{i}.log").read_text() for i in range(2)]
    out, _ = launched(tmp_path)
    assert f"resumed from {tmp_path / 'ckpt' / str(latest)} " in out
    assert losses(tmp_path) == reference  # bit-identical to the uninterrupted 2-process run
    # The crashed launch's logs outlive the relaunch (it truncated them), under the name logrotate would give
    assert [(tmp_path / "log" / f"process-{i}.log.1").read_text() for i in range(2)] == crashed


def test_a_process_that_loses_its_peer_stops_by_itself(tmp_path):
    """Failure detection inside the run, without the launcher's help (--grace 30): the survivor stops
    within seconds. Its step's collective either fails (gloo's broken connection: zerolm's line, exit 76)
    or hangs until JAX's coordination service misses the dead process's heartbeat (--heartbeat-timeout
    4) and aborts it with its own message."""
    cmd = launch_command(tmp_path, "checkpoint.every=1000", steps=400)
    cmd[cmd.index("--"):cmd.index("--") + 1] = ["--grace", "30", "--", "--heartbeat-timeout", "4"]
    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_line = read_launcher_err(proc)
    wait_for(proc, lambda: logged_steps(tmp_path) >= 6)
    subprocess.run(["kill", "-9", str(pids(first_line)[1])], check=True)
    killed = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - killed < 15, "the survivor took more than seconds to stop"
    assert proc.returncode == EXIT_PEER_LOST
    codes = re.search(r"^launch-local: process 1 was killed by SIGKILL; exit codes \[(-?\d+), -9\]$", err, re.M)
    assert codes and codes.group(1) in ("76", "-6"), err[-2000:]  # stopped by itself, not by the launcher
    log0 = (tmp_path / "log" / "process-0.log").read_text()
    if codes.group(1) == "76":
        last = log0.strip().splitlines()[-1]
        assert last.startswith("error: process 0 lost a peer process of the run (") and last.endswith(
            "the last complete checkpoint stays the latest; exiting with code 76 (restart the run to resume)")
    else:
        assert "Terminating process because the JAX distributed service detected fatal errors" in log0


def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    proc = start(tmp_path, steps=400)
    first_line = read_launcher_err(proc)
    wait_for(proc, lambda: logged_steps(tmp_path) >= 10)
    subprocess.run(["kill", "-TERM", str(pids(first_line)[1])], check=True)  # one host of a slice is preempted
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    latest = Checkpoints(tmp_path / "ckpt", read_only=True).latest_step()
    assert 10 < latest < 400
    for i in range(2):
        assert f"preempted: checkpoint saved at step {latest}" in (tmp_path / "log" / f"process-{i}.log").read_text()


def test_ctrl_c_to_the_launcher_saves_on_every_process(two_by_four, tmp_path):
    _, reference = two_by_four
    proc = start(tmp_path)
    wait_for(proc, lambda: logged_steps(tmp_path) >= 5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    latest = Checkpoints(tmp_path / "ckpt", read_only=True).latest_step()
    for i in range(2):
        assert f"interrupted: checkpoint saved at step {latest}" in (tmp_path / "log" / f"process-{i}.log").read_text()
    launched(tmp_path)
    assert losses(tmp_path) == reference


def test_one_process_to_two_and_back(one_by_eight, tmp_path):
    run_dir, reference = one_by_eight
    shutil.copytree(run_dir / "ckpt", tmp_path / "ckpt")
    for step in ("12", "16"):
        shutil.rmtree(tmp_path / "ckpt" / step)
    out, _ = launched(tmp_path, steps=12)  # saved by 1 process x 8 devices, restored by 2 x 4
    assert "in 2 process(es)" in out and "resumed from" in out
    assert Checkpoints(tmp_path / "ckpt", read_only=True).latest_step() == 12
    train(tmp_path)  # and back to 1 process
    resumed = losses(tmp_path)
    np.testing.assert_allclose([resumed[s] for s in range(9, 17)], [reference[s] for s in range(9, 17)], rtol=2e-5)


@pytest.mark.parametrize("args, message", [
    (["--processes", "0", "--devices-per-process", "4"], "error: --processes 0: must be at least 1"),
    (["--processes", "2", "--devices-per-process", "0"], "error: --devices-per-process 0: must be at least 1"),
    (["--processes", "2", "--devices-per-process", "4", "--", "--process-id", "1"],
     "error: --process-id: set by launch-local itself; leave it out of the train arguments"),
    (["--processes", "2", "--devices-per-process", "1", "--config", str(TINY)],
     "error: zerolm: unrecognized arguments: --config; put the train arguments after --: zerolm launch-local "
     "--processes P --devices-per-process D -- --config ... (see zerolm --help)"),
    (["--processes", "3", "--devices-per-process", "1", "--", "--config", str(TINY), "--set", "mesh.dp=2"],
     f"error: {TINY} (--set mesh.dp): mesh.dp: dp × tp = 2 × 1 = 2, but there are 3 devices"),
])
def test_bad_launches_are_one_line(args, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "launch-local", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env(), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == message, proc.stderr[-2000:]


def test_unreachable_coordinator_fails_in_time_naming_it(tmp_path):
    t = time.time()
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "train", "--coordinator", "127.0.0.1:9",
                           "--num-processes", "2", "--process-id", "1", "--init-timeout", "3"],
                          capture_output=True, text=True, cwd=tmp_path, env=env(4), timeout=60)
    assert proc.returncode == 2 and time.time() - t < 30
    assert proc.stderr.strip() == ("error: --coordinator 127.0.0.1:9: not reachable within 3 s (Connection refused); "
                                   "is process 0 running there? (--init-timeout sets the wait)")
    assert list(tmp_path.iterdir()) == []


# Process 0's output as a 2-process launch of 4 devices each wrote it: gloo's lines, two of them interleaved
# by its threads, one after a progress bar. The terminal gets the rest, byte for byte.
GLOO = "Expected number of connected peer ranks is : "
WRITTEN = (f"[Gloo] Rank 0 is connected to 1 peer ranks. {GLOO}1\nzerolm: tiny: 1.07M params\n"
           f"\rtiny:   0%|          | 0/2 [00:00<?, ?step/s][Gloo] Rank 0 is connected to 7 peer ranks. {GLOO}7\n"
           f"[Gloo] Rank 2[Gloo] Rank 1 is connected to 7 peer ranks. {GLOO}7\n"
           f"[Gloo] Rank 3 is connected to 7 peer ranks. {GLOO}7\n is connected to 7 peer ranks. {GLOO}7\n"
           "\rtiny:  50%|█████     | 1/2 [00:01<00:01,  1.83s/step]\n[Gloo] Rank 1 is NOT connected to: [0]\n")
SHOWN = ("zerolm: tiny: 1.07M params\n\rtiny:   0%|          | 0/2 [00:00<?, ?step/s]"
         "\rtiny:  50%|█████     | 1/2 [00:01<00:01,  1.83s/step]\n[Gloo] Rank 1 is NOT connected to: [0]\n")


def test_gloo_lines_stay_off_the_terminal_wherever_a_read_ends():
    for cut in range(len(WRITTEN) + 1):
        quiet = _WithoutGloo()
        assert quiet(WRITTEN[:cut]) + quiet(WRITTEN[cut:]) + quiet("", final=True) == SHOWN, cut


def test_each_relaunch_keeps_the_logs_of_the_launches_before(tmp_path):
    def launch(processes: int, name: str) -> None:
        _rotate_logs(tmp_path)
        for i in range(processes):
            (tmp_path / f"process-{i}.log").write_text(f"{name} {i}")

    launch(4, "first")
    launch(2, "crashed")  # fewer processes: .1 is still one launch's logs, the first's 2 and 3 move on too
    launch(2, "now")
    logs = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert logs == {"process-0.log": "now 0", "process-1.log": "now 1", "process-0.log.1": "crashed 0",
                    "process-1.log.1": "crashed 1", **{f"process-{i}.log.2": f"first {i}" for i in range(4)}}
    for n in range(KEPT_LAUNCHES + 1):  # "now" and "crashed" go, the oldest first
        launch(1, f"later {n}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["process-0.log", *(f"process-0.log.{n}" for n in
                                                                             range(1, KEPT_LAUNCHES + 1))]
