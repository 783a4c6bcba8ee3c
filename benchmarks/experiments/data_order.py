"""The data order (zerolm.data.order): what a run learns does not depend on how the corpus was cut into
shards, and reading it in that order stays fast, locally and from gs://.

    JAX_PLATFORMS=cpu python -m benchmarks.experiments.data_order curves [--steps 2000]
    JAX_PLATFORMS=cpu python -m benchmarks.experiments.data_order loader [--seq-len 2048] [--batch 64] [--steps 20]

curves: the King James Bible prepared at seq_len 64 twice, with 1 and with 4,096 samples per shard; the same
4-layer, 128-wide model trained on each with one recipe (lr 1e-3, 100 warmup steps, cosine to 1e-4,
AdamW beta2 0.99, weight decay 0.1, clip 1.0, batch 12 x 64 tokens); the validation loss every 250 steps
on the same 128 held-out samples. Prints both curves and their largest relative difference.

loader: BatchLoader's samples/s on one process (all local devices), in the old order (version 1, shard
by shard) and the new one (version 2, a global permutation), reading a dataset of many shards from local
disk and from a GCS server on this machine (fake-gcs-server, as the tests start it), each through the
loader's prefetch thread as training reads it; beside it, what a v3-32 host consumes in the 125m and
1_3b configs at the tokens/s `zerolm plan` predicts (the step must never wait: the loader must exceed it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax

from benchmarks.lib import REPO
from zerolm.config.load import load_config
from zerolm.data.loader import BatchLoader
from zerolm.data.prepare import prepare
from zerolm.data.shards import PreparedDataset
from zerolm.parallel.mesh import make_mesh
from zerolm.train.trainer import train

RECIPE = ["model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.seq_len=64", "model.dtype=float32",
          "train.global_batch_size=12", "train.micro_batch_size=12", "mesh.dp=1", "train.lr=1e-3",
          "train.min_lr_ratio=0.1", "train.warmup_steps=100", "train.beta2=0.99", "train.weight_decay=0.1",
          "train.grad_clip=1.0", "train.eval_every=250", "train.eval_sequences=128", "sample.tokens=0",
          "checkpoint.every=100000", "logging.wandb=disabled"]


def curves(steps: int, workdir: Path) -> None:
    results = {}
    for per_shard in (1, 4096):
        data = workdir / f"kjv-{per_shard}"
        t0 = time.perf_counter()
        prepare("default", data, seq_len=64, samples_per_shard=per_shard, progress=False)
        print(f"prepared {data.name}: {len(list(data.rglob('*.tar')))} shards in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
        cfg = load_config(REPO / "configs" / "tiny.yaml",
                          [*RECIPE, f"train.steps={steps}", f"data.dataset={data}", f"logging.dir={workdir / 'log'}"
                           f"{per_shard}", f"checkpoint.dir={workdir / 'ckpt'}{per_shard}"], device_count=1)
        train(cfg, out=io.StringIO())
        records = [json.loads(line) for line in (workdir / f"log{per_shard}" / "metrics.jsonl").read_text().splitlines()]
        results[per_shard] = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    evals = sorted(results[1])
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; {steps} steps\n")
    print("| samples per shard | " + " | ".join(str(s) for s in evals) + " |")
    print("|---|" + "---|" * len(evals))
    for per_shard, losses in results.items():
        print(f"| {per_shard:,} | " + " | ".join(f"{losses[s]:.3f}" for s in evals) + " |")
    worst = max(abs(results[4096][s] / results[1][s] - 1) for s in evals)
    print(f"\nlargest relative difference at an evaluation: {worst:.4%}")


def _rate(split, mesh, batch: int, steps: int, version: int, prefetch: int) -> float:
    loader = BatchLoader(split, mesh, batch, batch // mesh.size, seed=0, order=version)
    jax.block_until_ready(loader.global_batch(1000))  # shards opened by another step first do not count
    it = loader.batches(start_step=0, prefetch=prefetch)
    t = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(next(it)[0])
    it.close()
    return steps * batch / (time.perf_counter() - t)


def _planned_samples_per_s(config: str) -> float:
    """What one v3-32 host (8 cores, a quarter of the batch) consumes at the step time `zerolm plan`
    predicts for the config (50% of peak, its own model of the step)."""
    from zerolm.plan import PlanRequest, planner_for

    plan = planner_for(PlanRequest(config=str(REPO / "configs" / config), device="v3-core", dp=32)).report(None).to_json()
    return plan["layout"]["global_batch"] / plan["step"]["step_s"] / 4


def loader(seq_len: int, batch: int, steps: int, workdir: Path) -> None:
    from benchmarks.lib.gcs import GCSServer

    mesh = make_mesh(jax.device_count())
    server = GCSServer(workdir / "gcs").start()
    os.environ.update(server.env())
    try:
        bucket = server.make_bucket("bench")
        local = workdir / "local"
        prepare("default", local, seq_len=seq_len, samples_per_shard=16, progress=False)
        prepare("default", f"{bucket}/ds", seq_len=seq_len, samples_per_shard=16, progress=False)
        rows = []
        for where, location in (("local disk", str(local)), ("gs:// (GCS server on this machine)", f"{bucket}/ds")):
            for version in (1, 2):
                split = PreparedDataset(location).split("train")
                rate = _rate(split, mesh, batch, steps, version, prefetch=2)
                rows.append((where, version, len(split.shards), rate))
    finally:
        server.stop()
    print(f"\n{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}; seq_len {seq_len}, "
          f"global batch {batch}, {steps} batches, 16 samples per shard, prefetch 2\n")
    print("| dataset | order | shards | samples/s |")
    print("|---|---|---|---|")
    for where, version, shards, rate in rows:
        name = "1 (shard by shard)" if version == 1 else "2 (global permutation)"
        print(f"| {where} | {name} | {shards} | {rate:,.0f} |")
    print("\n| config | a v3-32 host consumes (samples/s, `zerolm plan`'s step time) |")
    print("|---|---|")
    for config in ("125m.yaml", "1_3b.yaml"):
        print(f"| {config} | {_planned_samples_per_s(config):,.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("curves")
    c.add_argument("--steps", type=int, default=2000, help="(default: %(default)s)")
    ld = sub.add_parser("loader")
    ld.add_argument("--seq-len", type=int, default=2048, help="(default: %(default)s)")
    ld.add_argument("--batch", type=int, default=64, help="sequences per global batch (default: %(default)s)")
    ld.add_argument("--steps", type=int, default=20, help="batches timed (default: %(default)s)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.what == "curves":
            curves(args.steps, Path(tmp))
        else:
            loader(args.seq_len, args.batch, args.steps, Path(tmp))


if __name__ == "__main__":
    main()
