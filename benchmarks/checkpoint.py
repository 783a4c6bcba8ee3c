"""What a checkpoint save costs the training step, for a config's state size.

    python benchmarks/checkpoint.py [--config configs/125m.yaml] [--saves 3] [--dir /tmp/zerolm-ckpt-bench]

Builds the config's ZeRO-1 train state on the local devices (params replicated, AdamW state sharded
on dp) and saves it with orbax, as training does. "blocking" is the time `save()` holds the training
loop (device-to-host copies); "total" runs until the checkpoint is committed on disk. The state is
filled with noise first, so it compresses like a trained one.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import tempfile
import time
from pathlib import Path

import jax

from zerolm import model as gpt_model
from zerolm.checkpoint import Checkpoints, directory_size
from zerolm.config import load_config
from zerolm.mesh import make_mesh
from zerolm.zero import Zero1, make_optimizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/125m.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--saves", type=int, default=3, help="saves timed (default: %(default)s)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()

    cfg = load_config(args.config, ["train.micro_batch_size=1", *args.set], device_count=jax.device_count())
    if cfg.model.vocab_size == "auto":
        cfg = cfg.resolve(model__vocab_size=cfg.data.default_vocab_size)
    model = gpt_model.GPT(cfg.model)
    init_fn = functools.partial(gpt_model.init_params, model)
    tx, _ = make_optimizer(cfg.train)
    zero = Zero1(make_mesh(cfg.dp), functools.partial(gpt_model.lm_loss, model), tx,
                 jax.eval_shape(init_fn, jax.random.key(0)))
    state = zero.init(init_fn, jax.random.key(0))
    # A freshly initialised AdamW state is zeros, which compress to nothing: add noise so the bytes
    # written are those of a trained state.
    noisy = jax.jit(lambda s: jax.tree.map(
        lambda x: x + 1e-3 * jax.random.normal(jax.random.key(1), x.shape, x.dtype)
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, s), out_shardings=zero.state_shardings)
    state = jax.block_until_ready(noisy(state))
    root = Path(args.dir or tempfile.mkdtemp(prefix="zerolm-ckpt-bench-"))
    shutil.rmtree(root, ignore_errors=True)
    ckpts = Checkpoints(root, keep=args.saves + 1)
    rows = []
    for i in range(args.saves):
        t = time.perf_counter()
        ckpts.save(state, {"step": i + 1, "time": time.time()})
        blocking = time.perf_counter() - t
        ckpts.wait()
        rows.append((blocking, time.perf_counter() - t))
    size = directory_size(ckpts.directory / str(args.saves))
    ckpts.close()
    if args.dir is None:
        shutil.rmtree(root)

    print(f"\n{args.config}: {gpt_model.count_params(zero.abstract_params) / 1e6:.2f}M params, "
          f"{jax.device_count()} × {jax.devices()[0].device_kind}, dp={cfg.dp}, jax {jax.__version__}; "
          f"checkpoint {size / 2**20:,.0f} MiB on disk\n")
    print("| save | blocking the step (s) | total until committed (s) |")
    print("|---|---|---|")
    for i, (blocking, total) in enumerate(rows, 1):
        print(f"| {i} | {blocking:.2f} | {total:.2f} |")


if __name__ == "__main__":
    main()
