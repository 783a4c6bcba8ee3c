"""Memory and bytes moved of the training step, compiled for a GPU on this machine (no GPU needed).

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \
      python -m benchmarks.compiler.census --target h100 --config 125m --micro-batch 16 [--variants ...] [--write BENCHMARKS.md]

For one config at one micro-batch (two accumulation steps, no remat, bfloat16, mixed precision, dp 1,
cuDNN's attention), compiles with XLA's GPU compiler (zerolm.compile.aot) and prints per variant: the step's
compiled peak per device (zerolm.parallel.build.CompiledStep.memory, the rule `zerolm compile` and a run use), the
bytes the step moves (zerolm.compile.bytes_moved: every kernel's operands and results, times its loops' trip counts),
the largest kinds of kernel, and the compile time. Variants:

- `shipped`: zerolm as configured (the config's and the device's defaults);
- `scan`: zerolm with its layers in a `nn.scan` loop (`model.scan_layers: true`);
- `unrolled`: zerolm with the layer loop unrolled (`model.scan_layers: false`);
- `plain`: a plain JAX GPT of the same shape, as a user would write it without zerolm: layers in a
  Python loop, float32 parameters cast to bfloat16 in the forward pass, the whole micro-batch's float32
  logits into optax's cross-entropy, the two micro-batches' gradients summed in float32 inside one jit,
  then optax's AdamW; the same attention (cuDNN's through `jax.nn.dot_product_attention`).

Without a GPU there is no GEMM autotuning; `--xla_gpu_enable_triton_gemm=false` keeps XLA's default
Triton GEMMs (which a tuned H100 run does not pick) out of the bytes; memory is the same either way.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.lib import config_path
from benchmarks.lib.markdown import write_block
from zerolm.compile import aot
from zerolm.compile import bytes_moved as census
from zerolm.config.load import load_config
from zerolm.parallel.build import build_step, compile_step
from zerolm.parallel.mesh import make_mesh

VARIANTS = ("shipped", "scan", "unrolled", "plain")


def zerolm_step(cfg, devices) -> dict:
    mesh = make_mesh(cfg.dp, cfg.mesh.tp, devices)
    _, zero, _ = build_step(cfg, mesh)
    micro, seq, accum = cfg.train.micro_batch_size, cfg.model.seq_len, cfg.accum_steps
    t0 = time.perf_counter()
    compiled = compile_step(zero, micro, seq, accum)
    seconds = time.perf_counter() - t0
    memory = compiled.memory(zero, micro, seq, accum)
    return {"peak": max(m["peak_bytes"] for m in memory.values()), "compile_s": seconds,
            "census": census.merge(census.census(t) for t in compiled.texts.values())}


def plain_step(cfg, devices) -> dict:
    """A plain JAX GPT's training step (see the module docstring), compiled for the same device."""
    m = cfg.model
    V, D, L, H, T = m.padded_vocab_size, m.d_model, m.n_layer, m.n_head, m.seq_len
    f32, bf16 = jnp.float32, jnp.bfloat16

    def layer_shapes():
        return {"ln1_g": (D,), "ln1_b": (D,), "qkv_w": (D, 3 * D), "qkv_b": (3 * D,), "proj_w": (D, D), "proj_b": (D,),
                "ln2_g": (D,), "ln2_b": (D,), "fc_w": (D, 4 * D), "fc_b": (4 * D,), "out_w": (4 * D, D), "out_b": (D,)}

    shapes = {"wte": (V, D), "wpe": (T, D), "lnf_g": (D,), "lnf_b": (D,),
              "layers": [layer_shapes() for _ in range(L)]}

    def ln(x, g, b):
        x32 = x.astype(f32)
        mean = x32.mean(-1, keepdims=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
        return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(bf16)

    def forward(params, tokens):
        p = jax.tree.map(lambda a: a.astype(bf16), params)
        B = tokens.shape[0]
        x = p["wte"][tokens] + p["wpe"][:T]
        for lp in p["layers"]:
            h = ln(x, lp["ln1_g"], lp["ln1_b"])
            q, k, v = jnp.split(h @ lp["qkv_w"] + lp["qkv_b"], 3, axis=-1)
            q, k, v = (a.reshape(B, T, H, D // H) for a in (q, k, v))
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").reshape(B, T, D)
            x = x + y @ lp["proj_w"] + lp["proj_b"]
            h = ln(x, lp["ln2_g"], lp["ln2_b"])
            x = x + jax.nn.gelu(h @ lp["fc_w"] + lp["fc_b"], approximate=True) @ lp["out_w"] + lp["out_b"]
        x = ln(x, p["lnf_g"], p["lnf_b"])
        return jnp.einsum("btd,vd->btv", x, p["wte"], preferred_element_type=f32)

    def loss(params, batch):
        logits = forward(params, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    tx = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)

    def step(params, opt_state, batches):
        grads = jax.tree.map(jnp.zeros_like, params)
        for i in range(batches.shape[0]):
            grads = jax.tree.map(jnp.add, grads, jax.grad(loss)(params, batches[i]))
        grads = jax.tree.map(lambda g: g / batches.shape[0], grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
    whole = NamedSharding(mesh, P())
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, f32, sharding=whole), shapes,
                          is_leaf=lambda s: isinstance(s, tuple))
    opt_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole),
                             jax.eval_shape(tx.init, params))
    batches = jax.ShapeDtypeStruct((cfg.accum_steps, cfg.train.micro_batch_size, T + 1), jnp.int32, sharding=whole)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batches).compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    return {"peak": peak, "compile_s": seconds, "census": census.census(compiled.as_text())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="h100", help="a GPU target of `zerolm compile` (one device)")
    p.add_argument("--config", default="125m")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--remat", default="none")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="more config overrides (zerolm's)")
    p.add_argument("--write", type=Path, help="put the table into this markdown file between its markers")
    args = p.parse_args()
    target = aot.parse_target(args.target)
    devices = aot.target_devices(target)
    sets = [f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={2 * args.micro_batch}",
            f"model.remat={args.remat}", "mesh.dp=1", "zero.stage=1", *args.set]
    config = str(config_path(args.config))
    results = {}
    for variant in args.variants:
        loop = {"scan": ["model.scan_layers=true"], "unrolled": ["model.scan_layers=false"]}.get(variant, [])
        cfg = load_config(config, [*sets, *loop], device_count=1)
        results[variant] = (plain_step if variant == "plain" else zerolm_step)(cfg, devices)
        r = results[variant]
        print(f"{variant}: peak {r['peak'] / 2**30:.2f} GiB, {r['census'].bytes / 1e9:,.1f} GB moved, compiled in "
              f"{r['compile_s']:.0f} s", flush=True)
        for line in census.describe(r["census"], top=8):
            print("  " + line, flush=True)
    plain = results.get("plain")
    flags = os.environ.get("XLA_FLAGS", "")
    lines = [f"`{' '.join(['XLA_FLAGS=' + flags] if flags else [])} python -m benchmarks.compiler.census --target {args.target} "
             f"--config {args.config} --micro-batch {args.micro_batch}"
             + (f" --remat {args.remat}" if args.remat != "none" else "")
             + "".join(f" --set {s}" for s in args.set) + "`",
             f"jax {jax.__version__}; {devices[0].device_kind}; micro-batch {args.micro_batch} × 2 accumulation steps, "
             f"remat {args.remat}, dp 1",
             "",
             "| step | compiled peak (GiB) | bytes moved per step (GB) | vs plain | copies (GB) | dynamic slices and updates "
             "(GB) | compile (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for variant, r in results.items():
        c = r["census"]
        slices = sum(row.bytes for row in c.rows if "dynamic-" in row.kind)
        ratio = f"{c.bytes / plain['census'].bytes:.2f}×" if plain else "—"
        lines.append(f"| {variant} | {r['peak'] / 2**30:.2f} | {c.bytes / 1e9:,.1f} | {ratio} | {c.of('copy') / 1e9:,.1f} "
                     f"| {slices / 1e9:,.1f} | {r['compile_s']:.0f} |")
    print("\n".join(lines))
    if args.write:
        marker = f"census:{args.target}:{args.config}"
        write_block(args.write, f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->", lines)


if __name__ == "__main__":
    main()
