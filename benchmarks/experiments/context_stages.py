"""Staged context at small scale (train.context_stages): the seed project's experiment on the embedded corpus.

    JAX_PLATFORMS=cpu python -m benchmarks.experiments.context_stages [--steps 400] [--write BENCHMARKS.md]

A tiny ALiBi model (configs/tiny.yaml, model.position alibi, seq_len 128, one CPU device) trained four ways
through `zerolm train`, each from the same init and data order:
- baseline: every step at 128 tokens;
- truncate: the first quarter of the steps at 32 tokens, each sample cut to its first 33 (the seed project's
  way: sequences per step fixed, three quarters of those samples' tokens never trained on), then 128;
- truncate, as many tokens: the same, with the steps it takes to train on as many tokens as the baseline
  (the seed project's second run);
- split: the first quarter at 32 tokens, each sample cut into 4 rows (every token trained, tokens per step
  fixed), then 128.
For each: steps, tokens trained, the training wall time (the sum of the logged step times: compiling and
evaluating left out), the final validation loss (the same 128 held-out sequences, at 128 tokens), and the
validation loss at equal tokens: at the fewest any run trained on (the truncated run's), interpolated between
each run's evaluations (eight per run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.lib import REPO
from benchmarks.lib.markdown import write_block

SEQ, SHORT, GLOBAL = 128, 32, 32


def train(work: Path, name: str, steps: int, sets: list[str], more: list[str]) -> list[dict]:
    every = max(steps // 8, 1)
    args = ["--set", "model.position=alibi", "--set", f"train.steps={steps}", "--set", f"train.eval_every={every}",
            "--set", "train.eval_sequences=128", "--set", f"checkpoint.every={steps}", "--set", "sample.tokens=0",
            "--set", "mesh.dp=1", "--set", "train.micro_batch_size=8", "--set", f"train.global_batch_size={GLOBAL}",
            "--set", f"logging.dir={work / name / 'log'}", "--set", f"checkpoint.dir={work / name / 'ckpt'}",
            "--set", "logging.wandb=disabled", *[a for s in [*sets, *more] for a in ("--set", s)]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_MODE": "disabled",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "train", "--config", str(REPO / "configs" / "tiny.yaml"),
                           *args], env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"{name}: zerolm train failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (work / name / "log" / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict], equal_tokens: float) -> dict:
    steps = [r for r in records if "step_time_s" in r]
    evals = [r for r in records if "val_loss" in r]
    at = np.interp(equal_tokens, [r["tokens_seen"] for r in evals], [r["val_loss"] for r in evals])
    return {"steps": steps[-1]["step"], "tokens": int(steps[-1]["tokens_seen"]),
            "train_s": sum(r["step_time_s"] for r in steps), "val_loss": evals[-1]["val_loss"], "val_at": float(at)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--write", type=Path, default=None)
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="more settings for every `zerolm train` of the experiment, after its own (a smaller model, for a quick run)")
    args = p.parse_args()
    n, stage = args.steps, args.steps // 4
    staged = f"train.context_stages=[{{steps: {stage}, seq_len: {SHORT}}}]"
    # Truncate trains stage × G × 32 tokens fewer: (its steps) more at 128 tokens make them up.
    extra = stage * (SEQ - SHORT) // SEQ
    runs = [("baseline", n, []),
            ("truncate", n, [staged, "train.context_rows=truncate"]),
            ("truncate, as many tokens", n + extra, [staged, "train.context_rows=truncate"]),
            ("split", n, [staged, "train.context_rows=split"])]
    with tempfile.TemporaryDirectory() as work:
        results = {}
        for name, steps, sets in runs:
            records = train(Path(work), name.replace(" ", "_").replace(",", ""), steps, sets, args.set)
            results[name] = records
            print(f"{name}: done", flush=True)
    equal = min(int([r for r in records if "step_time_s" in r][-1]["tokens_seen"]) for records in results.values())
    command = f"JAX_PLATFORMS=cpu python -m benchmarks.experiments.context_stages --steps {n}" + "".join(f" --set {s}" for s in args.set)
    lines = [f"`{command}`", "",
             f"| run | steps | tokens trained | training time (s) | final val loss | val loss at {equal:,} tokens |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, records in results.items():
        s = summary(records, equal)
        lines.append(f"| {name} | {s['steps']} | {s['tokens']:,} | {s['train_s']:.1f} | {s['val_loss']:.4f} | "
                     f"{s['val_at']:.4f} |")
    print("\n".join(lines))
    if args.write:
        write_block(args.write, "<!-- context_stages:begin -->", "<!-- context_stages:end -->", lines)


if __name__ == "__main__":
    main()
