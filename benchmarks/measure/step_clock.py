"""Does `metrics.jsonl`'s `step_time_s` time each step, and what does the loop cost over the step alone?

    python -m benchmarks.measure.step_clock --devices 1 --steps 60
    python -m benchmarks.measure.step_clock --devices 8 --set mesh.dp=4 --set mesh.tp=2 --set zero.stage=3 --steps 40

1. `zerolm train` on the config (default: configs/tiny.yaml at its own shape) in a subprocess, on
   `--devices` CPU devices, for `--steps` steps with no evaluation, sample or checkpoint between steps:
   the logged `step_time_s` of every step after `--warmup`, their median, and the smallest and largest
   against it (a step timed by when the loop read it, not by when it ended, shows as one step near twice
   the median and the next near zero).
2. The same step built in this process from the same config (`zerolm.parallel.build.build_step`) and run alone,
   one step at a time, each waited for (`jax.block_until_ready`), on random batches: its median. This is the
   independent count: the loop's median over it is what the loop costs beyond the step (its data, its
   metrics, its progress bar), and should be at most 1.05.
3. With `--wall`, the loop by the wall clock alone, which no clock of zerolm's takes part in: `zerolm train` run
   twice more, for `--steps` and for `--warmup` steps, and the difference of the two processes' wall times over
   the difference of their steps (start, compile and exit cancel out), against the step alone's mean.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import REPO


def logged_times(args, work: Path, steps: int | None = None) -> list[float]:
    """Each step's logged step_time_s of a `zerolm train` of `steps` (default --steps)."""
    steps = steps or args.steps
    sets = [*args.set, f"train.steps={steps}", f"train.schedule_steps={max(args.steps, 100)}",
            "train.warmup_steps=1", f"train.eval_every={10 * steps}", f"checkpoint.every={10 * steps}",
            "sample.tokens=0", "logging.wandb=disabled", f"logging.dir={work / 'log'}", f"checkpoint.dir={work / 'ckpt'}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "train", "--config", str(args.config),
                           *[a for s in sets for a in ("--set", s)]], env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"zerolm train failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (work / "log" / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records if "step_time_s" in r]


def wall_per_step(args) -> float:
    """The loop's wall time per step: two `zerolm train` processes, of --steps and of --warmup steps."""
    walls = []
    for steps in (args.warmup, args.steps):
        with tempfile.TemporaryDirectory() as work:
            t = time.perf_counter()
            logged_times(args, Path(work), steps)
            walls.append(time.perf_counter() - t)
    return (walls[1] - walls[0]) / (args.steps - args.warmup)


def step_alone(args) -> list[float]:
    """The step run alone in this process (started with the same device count), each step waited for."""
    import jax
    import numpy as np

    from benchmarks.lib.steps import to_accum_layout
    from zerolm.config.load import load_config
    from zerolm.parallel.build import build_step
    from zerolm.parallel.mesh import make_mesh

    cfg = load_config(args.config, args.set, device_count=jax.device_count())
    if cfg.model.vocab_size == "auto":
        cfg = cfg.with_values({"model.vocab_size": cfg.data.default_vocab_size})
    _, zero, init_fn = build_step(cfg, make_mesh(cfg.dp, cfg.mesh.tp))
    rng = np.random.default_rng(0)
    G, T = cfg.train.global_batch_size, cfg.model.seq_len
    batches = [jax.device_put(to_accum_layout(rng.integers(0, cfg.model.vocab_size, (G, T + 1)).astype(np.int32),
                                              cfg.dp, cfg.accum_steps, cfg.train.micro_batch_size),
                              zero.table.batch_sharding) for _ in range(2)]
    state, times = zero.init(init_fn, jax.random.key(0)), []
    for i in range(args.steps):
        t = time.perf_counter()
        state, metrics = zero.step(state, batches[i % 2])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=REPO / "configs" / "tiny.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--devices", type=int, default=1, help="CPU devices (default: %(default)s)")
    p.add_argument("--steps", type=int, default=60, help="steps of each (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of each median (default: %(default)s)")
    p.add_argument("--wall", action="store_true", help="also the loop's wall time per step (two more runs)")
    args = p.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    with tempfile.TemporaryDirectory() as work:
        logged = logged_times(args, Path(work))[args.warmup:]
    wall = wall_per_step(args) if args.wall else None
    alone = step_alone(args)[args.warmup:]
    median, alone_median = statistics.median(logged), statistics.median(alone)
    print(f"`python -m benchmarks.measure.step_clock --devices {args.devices} --steps {args.steps}"
          + "".join(f" --set {s}" for s in args.set) + (" --wall" if args.wall else "") + "`\n")
    print("| logged median (ms) | smallest / median | largest / median | step alone, median (ms) | loop / step alone |"
          + (" loop's wall per step (ms) | ÷ step alone's mean |" if wall else ""))
    print("|---:|---:|---:|---:|---:|" + ("---:|---:|" if wall else ""))
    print(f"| {median * 1e3:.1f} | {min(logged) / median:.2f} | {max(logged) / median:.2f} | {alone_median * 1e3:.1f} "
          f"| {median / alone_median:.3f} |"
          + (f" {wall * 1e3:.1f} | {wall / statistics.mean(alone):.3f} |" if wall else ""))


if __name__ == "__main__":
    main()
