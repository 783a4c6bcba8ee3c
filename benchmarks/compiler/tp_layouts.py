"""ZeRO-1 over (dp, tp) layouts: per-device bytes, compiled memory, and the step's collectives by mesh axis.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.compiler.tp_layouts --config configs/125m.yaml --set model.vocab_size=50257 --memory-only
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.compiler.tp_layouts --config configs/tiny.yaml --global-batch 64 --micro-batch 4   # + step times

For each layout, the three programs of a step are compiled from abstract, sharded inputs (nothing of
the model's size is allocated). Bytes per device come from the shardings: parameters, the gradients
the gradient program hands out, and AdamW's moments. Each collective of the compiled programs is
attributed to the mesh axes its replica groups span (`zerolm.compile.collectives.axis_of`), inside or outside the
accumulation loop, with the bytes of its result.
"""

from __future__ import annotations

import argparse
import collections
import platform
import time

import jax
import numpy as np

from benchmarks.lib.steps import to_accum_layout
from zerolm.compile import collectives
from zerolm.config.load import load_config
from zerolm.parallel import sharding
from zerolm.parallel.build import build_step
from zerolm.parallel.mesh import make_mesh
from zerolm.parallel.sharding import with_shardings


def shard_bytes(abstract, shardings) -> int:
    """Bytes one device holds of a tree, from its shardings."""
    return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True))


def memory_of(compiled) -> int:
    ma = compiled.memory_analysis()
    return 0 if ma is None else (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                                 - ma.alias_size_in_bytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--layouts", nargs="+", default=["8x1", "4x2", "2x4"], help="DPxTP (default: %(default)s)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per device per micro-step (default: %(default)s)")
    p.add_argument("--global-batch", type=int, default=16,
                   help="sequences per step, the same for every layout (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per layout (default: %(default)s)")
    p.add_argument("--memory-only", action="store_true", help="compile and count, do not run steps")
    p.add_argument("--vocab-parallel", action="store_true",
                   help="split the token embedding over tp (sharding.VOCAB_PARALLEL_RULES) instead of replicating it")
    args = p.parse_args()

    rows, times = [], {}
    for layout in args.layouts:
        dp, tp = map(int, layout.split("x"))
        cfg = load_config(args.config, [*args.set, f"mesh.tp={tp}", f"train.micro_batch_size={args.micro_batch}",
                                        f"train.global_batch_size={args.global_batch}"], device_count=dp * tp)
        accum = cfg.accum_steps
        if cfg.model.vocab_size == "auto":
            cfg = cfg.with_values({"model.vocab_size": cfg.data.default_vocab_size})
        model, zero, init_fn = build_step(cfg, make_mesh(dp, tp),
                                          rules=sharding.VOCAB_PARALLEL_RULES if args.vocab_parallel else sharding.RULES)
        abstract = zero.abstract_params
        T1 = cfg.model.seq_len + 1
        params = with_shardings(abstract, zero.table.param_shardings)
        batch = jax.ShapeDtypeStruct((accum, dp * args.micro_batch, T1), np.int32, sharding=zero.table.batch_sharding)
        grad = zero.programs.grad.lower(params, batch).compile()
        grads = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             jax.eval_shape(zero.programs.grad, params, batch)[0], grad.output_shardings[0])
        views = with_shardings(jax.eval_shape(zero.programs.reshard, params), zero.table.view_shardings)
        opt = with_shardings(jax.eval_shape(zero.tx.init, views), zero.table.opt_shardings)
        step = jax.ShapeDtypeStruct((), np.int32, sharding=zero.table.replicated)
        programs = {"grad": grad, "reshard": zero.programs.reshard.lower(params).compile(),
                    "update": zero.programs.update.lower(grads, views, opt, step, params).compile()}
        counts = collections.Counter()
        for name, compiled in programs.items():
            for c in collectives.read(compiled.as_text()):
                axes = "+".join(collectives.axis_of(c, dict(zero.mesh.shape))) or "none"
                key = (name, c.op, axes, "in loop" if c.in_loop else "after loop" if name == "grad" else "")
                counts[key + ("n",)] += 1
                counts[key + ("bytes",)] += c.bytes
        rows.append(dict(layout=f"({dp}, {tp})", params=shard_bytes(abstract, zero.table.param_shardings),
                         grads=shard_bytes(jax.tree.leaves(grads), [g.sharding for g in jax.tree.leaves(grads)]),
                         opt=shard_bytes(jax.tree.leaves(opt), [o.sharding for o in jax.tree.leaves(opt)]),
                         program=max(memory_of(c) for c in programs.values()), comms=counts))
        if not args.memory_only:
            state = zero.init(init_fn, jax.random.key(0))
            data = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (args.global_batch, T1))
            b = jax.device_put(to_accum_layout(data.astype(np.int32), dp, accum, args.micro_batch), zero.table.batch_sharding)
            for _ in range(2):
                state, m = zero(state, b)
            jax.block_until_ready(m)
            t = time.perf_counter()
            for _ in range(args.steps):
                state, m = zero(state, b)
            jax.block_until_ready((state, m))
            times[rows[-1]["layout"]] = (time.perf_counter() - t) / args.steps

    print(f"\nconfig {args.config} {' '.join(args.set)}{' (vocabulary-parallel embedding)' if args.vocab_parallel else ''}: {jax.device_count()} × {jax.devices()[0].device_kind} "
          f"({platform.processor() or platform.machine()}), global batch {args.global_batch}, micro-batch "
          f"{args.micro_batch} per device (accumulation steps = global / (dp × micro)), jax {jax.__version__}\n")
    mib = lambda b: f"{b / 2**20:,.2f}"
    print("| (dp, tp) | params / device (MiB) | grads / device (MiB) | AdamW state / device (MiB) "
          "| largest program / device (MiB) |" + (" step time (s) | vs (8, 1) |" if times else ""))
    print("|---|---|---|---|---|" + ("---|---|" if times else ""))
    for r in rows:
        timing = (f" {times[r['layout']]:.3f} | {times[r['layout']] / times[rows[0]['layout']]:.2f}× |" if times else "")
        print(f"| {r['layout']} | {mib(r['params'])} | {mib(r['grads'])} | {mib(r['opt'])} | {mib(r['program'])} |{timing}")
    print("\n| (dp, tp) | program | collective | mesh axis | where | count | bytes (result, per device) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for key in sorted({k[:4] for k in r["comms"]}):
            print(f"| {r['layout']} | {key[0]} | {key[1]} | {key[2]} | {key[3] or '—'} | {r['comms'][key + ('n',)]} "
                  f"| {r['comms'][key + ('bytes',)]:,} |")


if __name__ == "__main__":
    main()
