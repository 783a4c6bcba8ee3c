"""fp32 against ZeRO's mixed precision, with a float32 or a bfloat16 gradient accumulator: the loss curves.

    python -m benchmarks.experiments.precision [--config configs/tiny.yaml] [--steps 300] [--set K=V ...] [--out DIR]

Trains the same config (same seed, same data order) three times through `zerolm train`:
zero.precision=fp32; mixed with zero.accumulate_dtype=float32; mixed with bfloat16. Prints, per variant,
the training loss at a few steps, the mean over the last tenth of the run, the final validation loss
and the largest gap to fp32's loss at any step. The compute dtype is the config's (on CPU: float32, so
what differs is only what mixed precision changes: the bfloat16 working parameters, gradients,
accumulator and collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = {"fp32": ["zero.precision=fp32"],
            "mixed, float32 accumulator": ["zero.precision=mixed", "zero.accumulate_dtype=float32"],
            "mixed, bfloat16 accumulator": ["zero.precision=mixed", "zero.accumulate_dtype=bfloat16"]}


def run(config: str, sets: list[str], out: Path) -> list[dict]:
    args = [sys.executable, "-m", "zerolm.cli", "train", "--config", config, "--overwrite",
            "--set", f"checkpoint.dir={out / 'ckpt'}", "--set", f"logging.dir={out / 'log'}",
            "--set", "sample.tokens=0", *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    subprocess.run(args, check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--set", action="append", default=[], metavar="K=V")
    p.add_argument("--out", type=Path, default=Path("runs/precision"))
    args = p.parse_args()
    curves, val = {}, {}
    for name, sets in VARIANTS.items():
        records = run(args.config, [*args.set, *sets], args.out / name.split(",")[0].replace(" ", "") /
                      (sets[-1].split("=")[1]))
        curves[name] = {r["step"]: r["loss"] for r in records if "loss" in r}
        val[name] = [r["val_loss"] for r in records if "val_loss" in r]
    steps = sorted(curves["fp32"])
    marks = sorted({steps[0], *steps[len(steps) // 4::len(steps) // 4], steps[-1]})
    tail = steps[-max(1, len(steps) // 10):]
    print(f"config {args.config} {' '.join(args.set)}: training loss at steps {', '.join(map(str, marks))}; "
          f"mean of the last {len(tail)} steps; final validation loss; largest |loss - fp32 loss| at any step")
    print("| variant | " + " | ".join(f"step {s}" for s in marks) + " | last 10% | val | max gap |")
    print("|---|" + "---|" * (len(marks) + 3))
    for name, curve in curves.items():
        gap = max(abs(curve[s] - curves["fp32"][s]) for s in steps)
        mean_tail = sum(curve[s] for s in tail) / len(tail)
        print(f"| {name} | " + " | ".join(f"{curve[s]:.4f}" for s in marks)
              + f" | {mean_tail:.4f} | {val[name][-1] if val[name] else float('nan'):.4f} | {gap:.4f} |")


if __name__ == "__main__":
    main()
