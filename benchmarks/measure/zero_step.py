"""Speed and memory of one optimizer step: ZeRO-1 (all_reduce, reduce_scatter) vs naive single-jit DP.

All variants run in one process on the same devices, model and batches, so their ratios hold.

    python -m benchmarks.measure.zero_step --config configs/tiny.yaml [--set key=value ...] [--steps 10]

MFU = (6·N + 12·L·d·T) · tokens/s / peak FLOP/s       (PaLM, Chowdhery et al. 2022, appendix B)
  N: parameters without the position embeddings (the tied token embedding counts: it is the output
  matmul), L layers, d model width, T sequence length. The peak is the accelerator's dense datasheet
  rate for the compute dtype (summed over devices) or, on CPU, a float32 matmul measured here on the
  whole machine (fake devices share the same cores), which the table names.
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.lib.steps import bytes_per_device, to_accum_layout
from zerolm.compile import collectives as comms
from zerolm.config.load import load_config
from zerolm.model import decoder as gpt_model
from zerolm.model import losses
from zerolm.model.flops import flops_per_token as model_flops_per_token
from zerolm.observe.mfu import peak_for
from zerolm.parallel.build import build_step
from zerolm.parallel.mesh import make_mesh
from zerolm.parallel.naive_step import naive_data_parallel_step
from zerolm.parallel.optim import make_optimizer
from zerolm.parallel.sharding import with_shardings


def peak_flops() -> tuple[float, str]:
    """The whole machine's peak: the datasheet's per device × devices, or on CPU a measured matmul."""
    kind = jax.devices()[0].device_kind
    if (peak := peak_for(kind)) is not None:
        return peak.flops * jax.device_count(), f"{peak.source} × {jax.device_count()}"
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x).lower(a).compile()
    mm(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(5):
        mm(a).block_until_ready()
    rate = 5 * 2 * n**3 / (time.perf_counter() - t)
    return rate, f"measured f32 {n}² matmul on this CPU: {rate / 1e9:.0f} GFLOP/s"


def flops_per_token(cfg, n_params_no_pos: int) -> float:
    m = cfg.model
    return model_flops_per_token(n_params_no_pos, m.n_layer, m.d_model, m.seq_len)


def memory_of(compiled) -> int:
    """Bytes one device needs while the program runs: arguments + outputs + temporaries − aliased."""
    ma = compiled.memory_analysis()
    if ma is None:
        return 0
    return (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes)


def held_bytes(tree) -> int:
    """Bytes the first device holds of a pytree."""
    return bytes_per_device(tree)[jax.devices()[0]]


def time_steps(step, state, batches, warmup: int, steps: int):
    for i in range(warmup):
        state, metrics = step(state, batches[i % len(batches)])
    jax.block_until_ready(metrics)
    t = time.perf_counter()
    for i in range(steps):
        state, metrics = step(state, batches[i % len(batches)])
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - t) / steps, state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default: %(default)s)")
    p.add_argument("--memory-only", action="store_true",
                   help="compile and report memory without running steps (for models too slow to step here)")
    args = p.parse_args()

    cfg = load_config(args.config, args.set, device_count=jax.device_count())
    if cfg.model.vocab_size == "auto":
        cfg = cfg.with_values({"model.vocab_size": cfg.data.default_vocab_size})
    mesh = make_mesh(cfg.dp, cfg.mesh.tp)
    model, _, init_fn = build_step(cfg, mesh)
    loss_fn = functools.partial(losses.lm_loss, model)
    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    tx, _ = make_optimizer(cfg.train)
    G, T = cfg.train.global_batch_size, cfg.model.seq_len
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, cfg.model.vocab_size, (G, T + 1)).astype(np.int32) for _ in range(2)]
    fpt = flops_per_token(cfg, gpt_model.count_params(abstract, matmul_only=True))
    peak, peak_note = peak_flops()

    results = []
    for variant in ("all_reduce", "reduce_scatter", "naive"):
        variant_cfg = cfg.with_values({"zero.grad_reduce": "reduce_scatter" if variant == "naive" else variant})
        _, zero, _ = build_step(variant_cfg, mesh)
        batches = [jax.device_put(to_accum_layout(r, cfg.dp, cfg.accum_steps, cfg.train.micro_batch_size),
                                  zero.table.batch_sharding) for r in rows]
        if variant == "naive":
            naive = naive_data_parallel_step(mesh, loss_fn, tx)
            params = jax.jit(init_fn, out_shardings=zero.table.replicated)(jax.random.key(0))
            state = (params, jax.jit(tx.init, out_shardings=zero.table.replicated)(params))
            compiled = naive.lower(*state, batches[0]).compile()
            programs, state_bytes = [compiled], held_bytes(state)

            def step(s, b):
                p_, o_, m_ = compiled(*s, b)
                return (p_, o_), m_
        else:
            state = zero.init(init_fn, jax.random.key(0))
            grads = jax.eval_shape(zero.programs.grad, state.params, batches[0])[0]
            grads_view = jax.eval_shape(zero.programs.reshard, grads) if variant == "all_reduce" else grads
            programs = [zero.programs.grad.lower(state.params, batches[0]).compile(),
                        zero.programs.reshard.lower(state.params).compile(),
                        zero.programs.update.lower(with_shardings(grads_view, zero.table.view_shardings),
                                          with_shardings(jax.eval_shape(zero.programs.reshard, state.params), zero.table.view_shardings),
                                          state.opt_state, state.step, state.params).compile()]
            state_bytes = held_bytes(state)
            del grads, grads_view
            step = zero.step
        in_loop = sum(c.in_loop for prog in programs for c in comms.read(prog.as_text()))
        if args.memory_only:
            step_time = float("nan")
        else:
            step_time, state = time_steps(step, state, batches, args.warmup, args.steps)
        tokens_per_s = G * T / step_time
        mem = max(memory_of(c) for c in programs)
        results.append(dict(variant=variant, step_s=step_time, tokens_per_s=tokens_per_s,
                            mfu=fpt * tokens_per_s / peak, state_mib=state_bytes / 2**20,
                            program_mib=mem / 2**20, in_loop=in_loop))
        del state

    base = results[0]["tokens_per_s"]
    print(f"\nconfig {args.config} {' '.join(args.set)}: {gpt_model.count_params(abstract) / 1e6:.2f}M params, "
          f"{jax.device_count()} × {jax.devices()[0].device_kind} ({platform.processor() or platform.machine()}), "
          f"dp={cfg.dp}, global batch {G} × {T} tokens, {cfg.accum_steps} accumulation step(s) of "
          f"{cfg.train.micro_batch_size}, compute {jnp.dtype(model.cfg.dtype).name}, jax {jax.__version__}")
    print(f"MFU peak: {peak_note}; {fpt / 1e6:.2f} MFLOP/token\n")
    print("| variant | step time (s) | tokens/s | vs all_reduce | MFU | state held per device (MiB) "
          "| largest program per device (MiB) | collectives inside the loop |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        speed = ("| — | — | — | — " if args.memory_only else
                 f"| {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}× | {r['mfu']:.1%} ")
        print(f"| {r['variant']} {speed}| {r['state_mib']:.2f} | {r['program_mib']:.2f} | {r['in_loop']} |")


if __name__ == "__main__":
    main()
