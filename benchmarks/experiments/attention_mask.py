"""Document-masked attention by implementation: values and gradients against a float32 reference, and
the time of a forward and backward pass, on this machine's first device (written for an NVIDIA GPU).

    python -m benchmarks.experiments.attention_mask [--batch 8] [--seq-len 2048] [--heads 12] [--head-dim 64]
                                        [--docs 8] [--repeat 20] [--json OUT.jsonl]

Each sample of the batch is cut into about `--docs` documents at random places (segment ids as
`zerolm.model.decoder.documents` makes them from end-of-text tokens). Rows: `zerolm.model.attention.causal_attention`
for each implementation this backend runs (xla and cudnn on a GPU; blockwise everywhere), with the
segment ids and without. Per row: the largest difference of the output and of dq, dk, dv from XLA's
masked attention in float32 on the same bfloat16 inputs, relative to that reference's largest value; the
median time of a jitted forward and backward over `--repeat` calls; whether the compiled program holds a
cuDNN fused-attention call (`__cudnn$fmha`).

That every implementation stays within its precision of the reference is a test (tests/test_documents.py, each
attention in bfloat16, cuDNN's where a GPU runs the suite); this script is the record of it on an H100
(BENCHMARKS.md, "Document-masked packing"), with the timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from zerolm.model.attention import Bias, causal_attention


def segments(rng: np.random.Generator, batch: int, seq_len: int, docs: int) -> np.ndarray:
    """(batch, seq_len) int32 segment ids: `docs - 1` random cuts per sample."""
    ids = np.zeros((batch, seq_len), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), size=docs - 1, replace=False))
        for c in cuts:
            ids[b, c:] += 1
    return ids


def loss_fn(implementation: str, segs):
    def f(q, k, v):
        y = causal_attention(q, k, v, implementation, bias=Bias(segs))
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.shape[-1], dtype=jnp.float32))), y
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq_len, args.heads, args.head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    segs = jnp.asarray(segments(rng, args.batch, args.seq_len, args.docs))
    ref_fn = loss_fn("xla", segs)
    (_, ref_y), ref_g = ref_fn(*(x.astype(jnp.float32) for x in (q, k, v)))
    ref = [np.asarray(x, np.float32) for x in (ref_y, *ref_g)]
    gpu = device.platform in ("gpu", "cuda")
    rows = []
    print(f"{device.device_kind}, jax {jax.__version__}: B={args.batch} T={args.seq_len} H={args.heads} "
          f"K={args.head_dim}, about {args.docs} documents a sample, bfloat16")
    print(f"{'implementation':<12} {'mask':<5} {'out err':>8} {'dq err':>8} {'dk err':>8} {'dv err':>8} "
          f"{'fwd+bwd ms':>10}  cudnn fmha")
    for implementation in (["xla", "cudnn"] if gpu else ["xla"]) + ["blockwise"]:
        for masked in (True, False):
            fn = loss_fn(implementation, segs if masked else None)
            row = {"device": device.device_kind, "jax": jax.__version__, "implementation": implementation,
                   "mask": masked, "batch": args.batch, "seq_len": args.seq_len, "heads": args.heads,
                   "head_dim": args.head_dim, "docs": args.docs}
            try:
                hlo = fn.lower(q, k, v).compile().as_text()
                (_, y), g = fn(q, k, v)
                jax.block_until_ready(g)
                times = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    jax.block_until_ready(fn(q, k, v))
                    times.append(time.perf_counter() - t)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(f"{implementation:<12} {masked!s:<5} failed: {row['error']}")
                rows.append(row)
                continue
            if masked:
                got = [np.asarray(x, np.float32) for x in (y, *g)]
                row["errors"] = [float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(got, ref, strict=True)]
            row["ms"] = 1e3 * statistics.median(times)
            row["cudnn_fmha"] = "__cudnn$fmha" in hlo
            rows.append(row)
            errs = " ".join(f"{e:8.4f}" for e in row.get("errors", [float("nan")] * 4))
            print(f"{implementation:<12} {masked!s:<5} {errs} {row['ms']:10.2f}  {row['cudnn_fmha']}")
    if args.json:
        with args.json.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
