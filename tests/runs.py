"""Training runs in subprocesses, shared by the checkpoint and launch tests: a small model on the tiny
config, 16 steps, a checkpoint every 4."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

from conftest import REPO, TINY
from xla_flags import cpu_flags

STEPS = 16
SMALL = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.seq_len=32", "model.dtype=float32",
         "train.global_batch_size=16", "train.micro_batch_size=1", "train.warmup_steps=2", "train.eval_every=1000",
         "checkpoint.every=4", "sample.tokens=0", f"train.schedule_steps={STEPS}"]


def command(run_dir, *extra_sets, steps=STEPS, script="main_zero.py", args=()):
    sets = [*SMALL, f"train.steps={steps}", f"checkpoint.dir={run_dir / 'ckpt'}", f"logging.dir={run_dir / 'log'}",
            *extra_sets]
    return [sys.executable, str(REPO / script if script == "main_zero.py" else REPO / "tests" / script),
            "--config", str(TINY), *[a for s in sets for a in ("--set", s)], *args]


def env(devices=8, **extra):
    return {**os.environ, "XLA_FLAGS": cpu_flags(devices), "PYTHONUNBUFFERED": "1",
            **extra}


def train(run_dir, *extra_sets, devices=8, expect=0, extra_env=None, **kw):
    proc = subprocess.run(command(run_dir, *extra_sets, **kw), env=env(devices, **(extra_env or {})),
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return proc


def shared_run(tmp_path_factory, name: str, *extra_sets, **kw):
    """A run made once per test session, whichever xdist worker asks first (the others wait on its lock, then
    read it): the reference runs several files compare with. Read-only: a test copies what it changes."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common directory
    run_dir = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (run_dir / "complete").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            train(run_dir, *extra_sets, **kw)
            (run_dir / "complete").touch()
    return run_dir


def losses(run_dir) -> dict[int, float]:
    """step -> loss; each step is logged once, also after a restart."""
    out = {}
    for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            assert record["step"] not in out, f"step {record['step']} logged twice"
            out[record["step"]] = record["loss"]
    return out


def logged_steps(run_dir) -> int:
    """How many training steps metrics.jsonl holds (saves and evaluations write lines of their own)."""
    path = run_dir / "log" / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    return sum("loss" in json.loads(line) for line in lines if line.endswith("}"))  # the last may be half-written


def start_and_wait(run_dir, cmd_env, until, timeout=240):
    """Start a training process and return once `until()` holds."""
    proc = subprocess.Popen(command(run_dir, **cmd_env.pop("kw", {})), env=cmd_env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait(proc, until, timeout)
    return proc


def start_held(run_dir, *extra_sets, before_step: int, until=None, extra_env=None, timeout=240, **kw):
    """Start a run (tests/held_train.py) and return it once it is held before step `before_step` (and
    `until()` holds, e.g. an asynchronous save has committed meanwhile): alive, at a known step, until
    `release(run_dir)`."""
    hold = run_dir / "held"
    hold_env = env(ZEROLM_TEST_HOLD=str(hold), ZEROLM_TEST_HOLD_BEFORE_STEP=str(before_step), **(extra_env or {}))
    proc = subprocess.Popen(command(run_dir, *extra_sets, script="held_train.py", **kw), env=hold_env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait(proc, lambda: hold.exists() and (until is None or until()), timeout)
    return proc


def release(run_dir) -> None:
    """Let a run started by `start_held` go on."""
    (run_dir / "held").unlink()


def _wait(proc, until, timeout):
    deadline = time.time() + timeout
    while not until():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "timed out waiting for the run"
        time.sleep(0.02)


def checkpoint_params(run_dir, step: int):
    """The params of a run's checkpoint, restored onto this process's 8 devices, flattened."""

    import jax
    import numpy as np

    from zerolm.checkpoint.store import Checkpoints
    from zerolm.config.load import load_config
    from zerolm.parallel.build import build_step
    from zerolm.parallel.mesh import make_mesh

    cfg = load_config(TINY, [*SMALL, "model.vocab_size=2048"], device_count=8)
    _, zero, _ = build_step(cfg, make_mesh(8))
    state, _ = Checkpoints(run_dir / "ckpt", read_only=True).restore(step, zero, cfg.model.model_dump())
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.params)])


def snapshot(path):
    """Every file's size and content hash under `path` (the run lock's holder record aside)."""
    import hashlib

    from zerolm.checkpoint.run_lock import LOCK_FILE

    return {str(p.relative_to(path)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in path.rglob("*") if p.is_file() and p.name != LOCK_FILE}


def zerolm(*args, expect=0, devices=8, timeout=300, **env_extra):
    """`zerolm ARGS` in a subprocess; asserts its exit code."""
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", *map(str, args)], env=env(devices, **env_extra),
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == expect, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def committed(run_dir) -> bool:
    """Whether a checkpoint of the run has been committed (saves are asynchronous)."""
    return any(p.name.isdigit() for p in (run_dir / "ckpt").glob("*"))


def kill_9_after(run_dir, *extra_sets, before_step=10, **kw):
    """Start a run, kill -9 it while it is held before step `before_step`, once a checkpoint is committed."""
    import signal

    proc = start_held(run_dir, *extra_sets, before_step=before_step, until=lambda: committed(run_dir), **kw)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
