"""What a checkpoint costs, for a config's state size: the time a save blocks the training loop, save and
restore throughput, and the same bytes written and read by TensorStore alone (what the storage itself
allows).

    python -m benchmarks.measure.checkpoint [--config configs/125m.yaml] [--saves 3] [--dir DIR | gs://BUCKET/PATH]
    python -m benchmarks.measure.checkpoint --local-gcs     # to a fake-gcs-server on 127.0.0.1 (the test extra's)

Builds the config's ZeRO-1 train state on the local devices (params replicated, AdamW state sharded on
dp) and saves it with zerolm's checkpoints (orbax), as training does. "blocking" is the time `save()`
holds the training loop (device-to-host copies); "until committed" runs until the checkpoint is durable.
A restore reads the whole state back into its shardings. The baseline writes every array's bytes, as
one value per array, through TensorStore's key-value store (the driver orbax uses: `file` or `gcs`),
32 at a time, and reads them back. The state is filled with noise first, so it compresses like a
trained one.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import tensorstore as ts

from zerolm.checkpoint.listing import directory_size
from zerolm.checkpoint.meta import CheckpointMeta
from zerolm.checkpoint.store import Checkpoints
from zerolm.config.load import load_config
from zerolm.core import storage
from zerolm.model import decoder as gpt_model
from zerolm.parallel.build import build_step
from zerolm.parallel.mesh import make_mesh


def kvstore(location: str) -> dict:
    if storage.is_remote(location):
        bucket, prefix = storage.split_gs(location)
        return {"driver": "gcs", "bucket": bucket, "path": f"{prefix}/"}
    return {"driver": "file", "path": f"{location}/"}


def plain_tensorstore(state, location: str) -> tuple[float, float, int]:
    """Seconds to write, then read, every array of `state` (its bytes on this host) as one value each."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(state) if hasattr(x, "shape")]
    store = ts.KvStore.open(kvstore(location)).result()
    t = time.perf_counter()
    for start in range(0, len(leaves), 32):
        futures = [store.write(f"leaf-{i}", leaves[i].tobytes()) for i in range(start, min(start + 32, len(leaves)))]
        for f in futures:
            f.result()
    write = time.perf_counter() - t
    t = time.perf_counter()
    for start in range(0, len(leaves), 32):
        futures = [store.read(f"leaf-{i}") for i in range(start, min(start + 32, len(leaves)))]
        for f in futures:
            f.result()
    return write, time.perf_counter() - t, sum(x.nbytes for x in leaves)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/125m.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--saves", type=int, default=3, help="saves timed (default: %(default)s)")
    p.add_argument("--dir", default=None, help="where to write: a directory or gs:// URL (default: a temporary "
                                               "directory)")
    p.add_argument("--local-gcs", action="store_true",
                   help="start a fake-gcs-server on 127.0.0.1 (benchmarks/lib/gcs.py, the test extra) and write there")
    args = p.parse_args()

    server = None
    if args.local_gcs:
        import os

        from benchmarks.lib.gcs import GCSServer

        server = GCSServer(Path(tempfile.mkdtemp(prefix="zerolm-gcs-")) / "root").start()
        os.environ.update(server.env())
        args.dir = f"{server.make_bucket('bench')}/ckpt"
    cfg = load_config(args.config, ["train.micro_batch_size=1", *args.set], device_count=jax.device_count())
    if cfg.model.vocab_size == "auto":
        cfg = cfg.with_values({"model.vocab_size": cfg.data.default_vocab_size})
    model, zero, init_fn = build_step(cfg, make_mesh(cfg.dp, cfg.mesh.tp))
    state = zero.init(init_fn, jax.random.key(0))
    # A freshly initialised AdamW state is zeros, which compress to nothing: add noise so the bytes
    # written are those of a trained state.
    noisy = jax.jit(lambda s: jax.tree.map(
        lambda x: x + (1e-3 * jax.random.normal(jax.random.key(1), x.shape, jax.numpy.float32)).astype(x.dtype)
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, s), out_shardings=zero.state_shardings)
    state = jax.block_until_ready(noisy(state))
    local_tmp = args.dir is None
    location = args.dir or tempfile.mkdtemp(prefix="zerolm-ckpt-bench-")
    if not storage.is_remote(location):
        shutil.rmtree(location, ignore_errors=True)
    ckpts = Checkpoints(location, keep=args.saves + 1)
    def meta(step: int) -> CheckpointMeta:
        return CheckpointMeta(step=step, time=time.time(), config=cfg.model_dump(), dp=cfg.dp, tp=cfg.mesh.tp,
                              accum_steps=1, dataset={}, tokens_seen=0, loss=None, wandb_id="")

    rows = []
    for i in range(args.saves):
        t = time.perf_counter()
        ckpts.save(state, meta(i + 1))
        blocking = time.perf_counter() - t
        ckpts.wait()
        rows.append((blocking, time.perf_counter() - t))
    size = directory_size(ckpts.directory / str(args.saves))
    t = time.perf_counter()
    restored, _ = ckpts.restore(args.saves, zero, cfg.model.model_dump())
    jax.block_until_ready(restored)
    restore = time.perf_counter() - t
    ckpts.close()
    write, read, nbytes = plain_tensorstore(state, f"{location.rstrip('/')}-plain")
    if local_tmp:
        shutil.rmtree(location, ignore_errors=True)
        shutil.rmtree(f"{location}-plain", ignore_errors=True)
    if server is not None:
        server.stop()

    mib = 2**20
    where = "a fake-gcs-server on 127.0.0.1" if server else location
    print(f"\n{args.config}: {gpt_model.count_params(zero.abstract_params) / 1e6:.2f}M params, "
          f"{jax.device_count()} × {jax.devices()[0].device_kind}, dp={cfg.dp}, precision {cfg.zero.precision}, "
          f"jax {jax.__version__}; to {where}; checkpoint {size / mib:,.0f} MiB stored, the state's arrays "
          f"{nbytes / mib:,.0f} MiB on this host\n")
    print("| save | blocking the step (s) | until committed (s) | MiB/s stored |")
    print("|---|---|---|---|")
    for i, (blocking, total) in enumerate(rows, 1):
        print(f"| {i} | {blocking:.2f} | {total:.2f} | {size / mib / total:,.0f} |")
    print(f"| restore | | {restore:.2f} | {size / mib / restore:,.0f} |")
    print(f"| TensorStore alone, write | | {write:.2f} | {nbytes / mib / write:,.0f} |")
    print(f"| TensorStore alone, read | | {read:.2f} | {nbytes / mib / read:,.0f} |")


if __name__ == "__main__":
    main()
