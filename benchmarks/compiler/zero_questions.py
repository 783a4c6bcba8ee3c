"""Evidence for docs/zero-questions.md: the four questions of docs/design.md, asked of the compiler.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.compiler.zero_questions [--layers 2 8 32]
    JAX_PLATFORMS=cpu python -m benchmarks.compiler.zero_questions --target v3-8     # the TPU compiler, no TPU

Runs on whatever backend JAX has (8 fake CPU devices above; a GPU or TPU slice as it is), or, with
--target, compiles ahead of time for a TPU slice (libtpu, zerolm.compile.aot; nothing runs), and prints:
1. whether a sum over data-parallel gradients plus a sharding constraint becomes a reduce-scatter,
   next to an explicit `lax.psum_scatter` and a plain sum;
2. whether the collectives are asynchronous (`-start`/`-done` pairs the scheduler can overlap) and
   what separates the gradient reduction from the backward pass in zerolm's step;
3. the gradient step's compile time as the depth grows (layers under `nn.scan`);
4. where the optimizer update sits relative to the accumulation loop, in the naive single jit with
   1 and with 2 accumulation steps.
"""

from __future__ import annotations

import argparse
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.lib.steps import ops_in_loops
from zerolm.compile import collectives as comms
from zerolm.compile import hlo
from zerolm.config.load import load_config
from zerolm.model import losses
from zerolm.parallel import naive_step as naive
from zerolm.parallel.build import build_step, compile_step
from zerolm.parallel.mesh import DP, make_mesh
from zerolm.parallel.scatter import two_stage_inner, two_stage_reduce_scatter


def collectives(text: str, mesh) -> str:
    rows = comms.traffic({"program": text}, dict(mesh.shape))
    return ", ".join(f"{r.count} {r.op} over {'+'.join(r.span)}{' IN a loop' if r.in_loop else ''}" for r in rows) \
        or "no collective"


def question_1(mesh) -> None:
    n = mesh.shape[DP]
    stacked = jax.ShapeDtypeStruct((n, 512 * n, 128), np.float32, sharding=NamedSharding(mesh, P(DP)))  # 2 MiB a device
    out = NamedSharding(mesh, P(DP))

    def summed(x):
        return jnp.sum(x, axis=0)

    def constrained(x):
        return lax.with_sharding_constraint(jnp.sum(x, axis=0), out)

    scatter = jax.shard_map(lambda x: lax.psum_scatter(x[0], DP, tiled=True), mesh=mesh, in_specs=P(DP),
                            out_specs=P(DP))
    inner = two_stage_inner(mesh)
    two_stages = jax.shard_map(lambda x: two_stage_reduce_scatter(x[0], 0, n, inner), mesh=mesh, in_specs=P(DP),
                               out_specs=P(DP))
    print("1. per-device gradients (stacked on dp) summed over dp:")
    for name, fn, kw in [("jnp.sum", summed, {}), ("jnp.sum + with_sharding_constraint(P('dp'))", constrained, {}),
                         ("jnp.sum, out_shardings=P('dp')", summed, {"out_shardings": out}),
                         ("shard_map + lax.psum_scatter (zerolm)", scatter, {}),
                         (f"... as two, over dp sub-groups (inner {inner})", two_stages, {})]:
        print(f"   {name:45s} -> {collectives(hlo.compiled_text(jax.jit(fn, **kw), stacked), mesh)}")


def _cfg(layers: int, accum: int, dp: int):
    cfg = load_config("configs/tiny.yaml", [f"model.n_layer={layers}", f"mesh.dp={dp}",
                                            f"train.micro_batch_size={32 // dp // accum}"], device_count=dp)
    return cfg.with_values({"model.vocab_size": cfg.data.default_vocab_size})


def question_2(mesh) -> None:
    cfg = _cfg(4, 2, mesh.shape[DP])
    _, zero, _ = build_step(cfg, mesh)
    text = compile_step(zero, cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps).texts["grad"]
    asynchronous = sorted(set(re.findall(r"\b((?:all-reduce|reduce-scatter|all-gather|collective-permute)-start)\(",
                                         text)))
    print(f"2. {mesh.devices.flat[0].device_kind}: asynchronous collectives in zerolm's gradient step: "
          f"{', '.join(asynchronous) or 'none (each collective blocks until done)'}")
    reductions = [c for c in comms.read(text) if c.op in ("reduce-scatter", "collective-permute")]
    loops = len(re.findall(r"\bwhile\(", text))
    print(f"   {loops} while loops; the dp reduction: {len(reductions)} "
          f"{'/'.join(sorted({c.op for c in reductions}))}s, {sum(c.in_loop for c in reductions)} of them inside a loop")
    pairs = comms.read_async(text)
    if pairs:
        overlapped = [a for a in pairs if a.overlaps]
        print(f"   {len(pairs)} start/done pairs in the scheduled HLO; {len(overlapped)} of them with a matmul or a "
              "loop of the model scheduled between start and done")


def question_3(mesh, depths: list[int]) -> None:
    print("3. compile time of the gradient step (layers under nn.scan):")
    for layers in depths:
        cfg = _cfg(layers, 2, mesh.shape[DP])
        _, zero, _ = build_step(cfg, mesh)
        start = time.perf_counter()
        text = compile_step(zero, cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps).texts["grad"]
        seconds = time.perf_counter() - start
        print(f"   {layers:3d} layers: {seconds:6.2f} s to lower and compile grad+reshard+update, "
              f"HLO {len(text.splitlines()):6d} lines")


def question_4(mesh) -> None:
    print("4. the naive single jit: where the AdamW update sits")
    for accum in (1, 2):
        cfg = _cfg(4, accum, mesh.shape[DP])
        model, zero, _ = build_step(cfg, mesh)
        text = naive.naive_text(zero, functools.partial(losses.lm_loss, model), cfg.train.micro_batch_size,
                                cfg.model.seq_len, accum)
        inside, outside = ops_in_loops(text, "sqrt")
        loops = len(re.findall(r"\bwhile\(", text))
        print(f"   accumulation {accum}: {loops} while loop(s); collectives: {collectives(text, mesh)}; "
              f"Adam's sqrt: {inside} inside a loop, {outside} after the loops")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--target", help="a TPU slice to compile for ahead of time (e.g. v3-8), instead of JAX's devices")
    args = p.parse_args()
    if args.target:
        from zerolm.compile import aot

        devices = aot.target_devices(aot.parse_target(args.target))
    else:
        devices = jax.devices()
    mesh = make_mesh(len(devices), 1, devices)
    print(f"{len(devices)} {devices[0].device_kind} device(s), jax {jax.__version__}")
    question_1(mesh)
    question_2(mesh)
    question_3(mesh, args.layers)
    question_4(mesh)


if __name__ == "__main__":
    main()
