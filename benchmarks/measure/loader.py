"""Loader throughput per host, standalone and against what training consumes.

    python -m benchmarks.measure.loader [--seq-len 2048] [--batch 64] [--steps 50] [--train-steps 40]

1. Standalone: the default corpus prepared at --seq-len (the 125m sequence length), read through
   BatchLoader on all local devices into global jax arrays: tokens/s per host.
2. While training the tiny config: the share of wall time the step waited on data (data_wait_s
   over the step times in metrics.jsonl), and the training step's own tokens/s.
The loader must deliver at least 10x what training consumes.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.lib import REPO
from zerolm.config.load import load_config
from zerolm.data.loader import BatchLoader
from zerolm.data.prepare import prepare
from zerolm.data.shards import PreparedDataset
from zerolm.parallel.mesh import make_mesh
from zerolm.train.trainer import train


def standalone(seq_len: int, batch: int, steps: int, workdir: Path) -> float:
    prepare("default", workdir / "ds", seq_len=seq_len, progress=False)
    split = PreparedDataset(workdir / "ds").split("train")
    n = jax.device_count()
    loader = BatchLoader(split, make_mesh(n), global_batch_size=batch, micro_batch_size=batch // n, seed=0)
    jax.block_until_ready(loader.global_batch(0))
    t = time.perf_counter()
    it = loader.batches(start_step=1)
    for _ in range(steps):
        jax.block_until_ready(next(it)[0])
    return steps * batch * (seq_len + 1) / (time.perf_counter() - t)


def while_training(train_steps: int, workdir: Path) -> tuple[float, float]:
    cfg = load_config(REPO / "configs" / "tiny.yaml",
                      [f"train.steps={train_steps}", f"train.eval_every={train_steps}", "train.warmup_steps=5",
                       f"logging.dir={workdir / 'run'}", f"checkpoint.dir={workdir / 'ckpt'}", "sample.tokens=0"],
                      device_count=jax.device_count())
    train(cfg, out=io.StringIO())
    records = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r][5:]  # past compilation
    step_time = sum(cfg.train.global_batch_size * cfg.model.seq_len / r["tokens_per_s"] for r in steps)
    wait = sum(r["data_wait_s"] for r in steps)
    return float(np.median([r["tokens_per_s"] for r in steps])), wait / step_time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=2048, help="(default: %(default)s, the 125m config's)")
    p.add_argument("--batch", type=int, default=64, help="sequences per global batch (default: %(default)s)")
    p.add_argument("--steps", type=int, default=50, help="batches timed (default: %(default)s)")
    p.add_argument("--train-steps", type=int, default=40, help="tiny training steps (default: %(default)s)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        loader_tps = standalone(args.seq_len, args.batch, args.steps, Path(tmp))
        train_tps, wait_share = while_training(args.train_steps, Path(tmp))
    print(f"\n{jax.device_count()} × {jax.devices()[0].device_kind}, jax {jax.__version__}\n")
    print("| measurement | value |")
    print("|---|---|")
    print(f"| loader alone, seq_len {args.seq_len}, batch {args.batch} | {loader_tps:,.0f} tokens/s |")
    print(f"| tiny training step (median) | {train_tps:,.0f} tokens/s |")
    print(f"| loader / training | {loader_tps / train_tps:,.1f}× |")
    print(f"| share of step time waiting on data while training tiny | {wait_share:.2%} |")


if __name__ == "__main__":
    main()
