"""Warmup-stable-decay with a decay branch against cosine of the same length, measured through `zerolm train`.

    JAX_PLATFORMS=cpu python -m benchmarks.experiments.wsd [--steps 300] [--decay 0.2] [--warmup 20] [--write BENCHMARKS.md]

The tiny config (4 layers, 128 wide, seq_len 128, batches of 32 on the King James Bible, lr 3e-3 after 20 warmup
steps, min_lr_ratio 0.1), on one device, three ways: cosine over N steps; a constant-lr run of (1 - decay) N
steps; and from that run's last checkpoint, decay branches (train.branch_from) of the last decay N steps with
train.schedule wsd, one linear and one 1 - sqrt. Each run's final validation loss (the config's 128 held-out
sequences) and wall-clock seconds (the `zerolm train` process, compiling included); the wsd rows' seconds are the
constant run's plus the branch's.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import REPO
from benchmarks.lib.markdown import write_block

BEGIN, END = "<!-- wsd:begin -->", "<!-- wsd:end -->"


def _train(run: Path, *sets: str, more: tuple[str, ...] = ()) -> float:
    """`zerolm train` of the tiny config with `sets`, into `run`; its wall-clock seconds."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "train", "--config", "configs/tiny.yaml", *[
        a for s in [*sets, f"checkpoint.dir={run / 'ckpt'}", f"logging.dir={run / 'log'}", "sample.tokens=0",
                    "logging.wandb=disabled", "mesh.dp=1", *more] for a in ("--set", s)]],
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return time.perf_counter() - t0


def last_val(run: Path) -> tuple[int, float]:
    rows = [json.loads(line) for line in (run / "log" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val_loss" in r][-1]
    return last["step"], last["val_loss"]


def measure(steps: int, decay: int, warmup: int, tmp: Path, more: tuple[str, ...] = ()) -> list[list[str]]:
    stable, warm = steps - decay, f"train.warmup_steps={warmup}"
    train = functools.partial(_train, more=more)
    runs = {"cosine": train(tmp / "cosine", f"train.steps={steps}", warm)}
    runs["constant"] = train(tmp / "constant", "train.schedule=constant", f"train.steps={stable}", warm)
    for shape in ("linear", "sqrt"):
        runs[f"wsd-{shape}"] = runs["constant"] + train(
            tmp / f"wsd-{shape}", f"train.branch_from={tmp / 'constant' / 'ckpt'}", "train.schedule=wsd",
            f"train.steps={steps}", f"train.decay_steps={decay}", f"train.decay_shape={shape}", warm)
    how = {"cosine": f"cosine over {steps} steps",
           "constant": f"constant lr for {stable} steps (the branches' source)",
           "wsd-linear": f"constant to step {stable}, then a linear decay branch of {decay} steps",
           "wsd-sqrt": f"constant to step {stable}, then a 1 - sqrt decay branch of {decay} steps"}
    rows = []
    for name, seconds in runs.items():
        step, loss = last_val(tmp / name)
        rows.append([how[name], str(step), f"{loss:.4f}", f"{seconds:.0f}"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="N, the length of the cosine and wsd runs (default: "
                   "%(default)s, the tiny config's)")
    p.add_argument("--decay", type=float, default=0.2, help="the decay branch's share of N (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="train.warmup_steps of every run (default: %(default)s, "
                   "the tiny config's)")
    p.add_argument("--write", type=Path, default=None, metavar="FILE.md",
                   help="also write the table into FILE.md between its markers (default: print only)")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="more settings for every `zerolm train` of the experiment, after its own (a smaller model, for a quick run)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args.steps, round(args.decay * args.steps), args.warmup, Path(tmp), tuple(args.set))
    lines = ["| run | step | validation loss | wall s |", "|---|---|---|---|",
             *("| " + " | ".join(row) + " |" for row in rows)]
    print("\n".join(lines))
    if args.write:
        write_block(args.write, BEGIN, END, lines)


if __name__ == "__main__":
    main()
