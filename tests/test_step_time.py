"""zerolm.compile.step_time: the matmul FLOPs of a compiled program, loop-aware, against the analytic count; the
modeled time rises with FLOPs and with exposed bytes; `zerolm compile --fastest` finds a plan that fits."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from conftest import REPO, TINY
from zerolm.compile import collectives as comms
from zerolm.compile import step_time
from zerolm.core.hardware import preset


def _scan_of_matmuls(k: int) -> str:
    def f(x, ws):
        return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]

    x, ws = jnp.zeros((8, 16)), jnp.zeros((k, 16, 16))
    return jax.jit(f).lower(x, ws).compile().as_text()


def test_the_flops_of_a_scan_of_k_matmuls_are_k_times_one_matmuls():
    for k in (3, 7):
        assert step_time.flops(_scan_of_matmuls(k)).total == k * 2 * 8 * 16 * 16


def test_the_blockwise_attentions_causal_key_block_loops_count_at_their_real_trip_counts():
    """Query block i reads key blocks 0..i: a loop bound the compiler cannot state. Counted once, the 4-block
    attention's FLOPs came out at 2 of the 10 block pairs it computes; at the mean trip count, exactly the
    analytic count: per (query, key) block pair 2 matmuls forward, 5 backward (QKᵀ again, dV, dP, dQ, dK)."""
    from zerolm.model import attention

    B, T, H, K, block = 2, 512, 4, 32, 128
    q = jnp.ones((B, T, H, K), jnp.float32)
    grad = jax.jit(jax.grad(lambda q, k, v: attention.blockwise_attention(q, k, v, attention.NO_BIAS, block).sum(),
                            argnums=(0, 1, 2)))
    counted = step_time.flops(grad.lower(q, q, q).compile().as_text())
    n = T // block
    pairs = n * (n + 1) // 2
    assert counted.total == pairs * (2 + 5) * 2 * B * H * block * block * K
    assert counted.triangular_loops == 2 and counted.unknown_loops == 0


# The TPU compiler's form of a batched matmul: a convolution whose window, stride and dilation line up one
# kernel position per output (4 × 4 batch positions of a 128 × 32 by 32 × 128 product).
_CONV = """HloModule m, entry_computation_layout={()->f32[4,4,128,128]}

ENTRY %main () -> f32[4,4,128,128] {
  %a = bf16[4,4,128,32]{3,2,1,0} parameter(0)
  %b = bf16[4,4,128,32]{3,2,1,0} parameter(1)
  ROOT %c = f32[4,4,128,128]{3,2,1,0} convolution(%a, %b), window={size=4x4 stride=3x3 lhs_dilate=4x4}, dim_labels=01bf_01oi->01bf
}
"""


def test_a_batched_matmul_written_as_a_convolution_counts_its_matmuls_only():
    assert step_time.flops(_CONV).total == 4 * 4 * 2 * 128 * 128 * 32


def _psum_text(n: int) -> str:
    mesh = Mesh(np.array(jax.devices()[:8]), ("dp",))
    x = jax.ShapeDtypeStruct((8, n), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("dp")))
    f = jax.shard_map(lambda v: jax.lax.psum(v, "dp"), mesh=mesh, in_specs=PartitionSpec("dp"),
                      out_specs=PartitionSpec("dp"))
    return jax.jit(f).lower(x).compile().as_text()


def test_the_modeled_time_rises_with_exposed_bytes_and_with_flops():
    h100 = preset("h100")
    small, large = (step_time.comms(_psum_text(n), h100, 8) for n in (1024, 4096))
    assert small.exposed_bytes == small.bytes == 4 * 1024 and large.exposed_bytes == 4 * small.exposed_bytes
    assert large.exposed_s > small.exposed_s > 0
    few, many = (step_time.model({"grad": _scan_of_matmuls(k)}, h100, 1, 1024, 1.0) for k in (3, 7))
    assert many.step_s > few.step_s > 0 and many.compute_s == pytest.approx(few.compute_s * 7 / 3)
    assert many.flops_per_token == 7 * 2 * 8 * 16 * 16 / 1024


# libtpu's asynchronous collective fusion as its scheduled HLO writes it (the 6.7B's layer gathers with
# OVERLAP_FLAGS, benchmarks/compiler/zero_stages.py), cut to one gather with a matmul between its start and its done.
_ASYNC_FUSION = """HloModule m, is_scheduled=true

%fused_gather (param_0: bf16[128,64]) -> (bf16[128,64], bf16[1024,64]) {
  %param_0 = bf16[128,64]{1,0} parameter(0)
  %all-gather.1 = bf16[1024,64]{1,0} all-gather(%param_0), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %tuple.1 = (bf16[128,64]{1,0}, bf16[1024,64]{1,0}) tuple(%param_0, %all-gather.1)
}

%fused_done (param_0.1: bf16[1024,64]) -> bf16[1024,64] {
  ROOT %param_0.1 = bf16[1024,64]{1,0} parameter(0)
}

%fused_dot (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: bf16[128,64], x: bf16[64,64]) -> (bf16[1024,64], bf16[64,64]) {
  %w = bf16[128,64]{1,0} parameter(0)
  %x = bf16[64,64]{1,0} parameter(1)
  %async-collective-start.1 = (bf16[128,64]{1,0}, bf16[1024,64]{1,0}) fusion(%w), kind=kCustom, calls=%fused_gather
  %get-tuple-element.1 = bf16[1024,64]{1,0} get-tuple-element(%async-collective-start.1), index=1
  %fusion.1 = bf16[64,64]{1,0} fusion(%x, %x), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/closed_call/h/mlp/c_fc/dot_general"}
  %async-collective-done.1 = bf16[1024,64]{1,0} fusion(%get-tuple-element.1), kind=kCustom, calls=%fused_done
  ROOT %tuple.2 = (bf16[1024,64]{1,0}, bf16[64,64]{1,0}) tuple(%async-collective-done.1, %fusion.1)
}
"""


def test_a_gather_in_an_async_collective_fusion_with_a_matmul_between_is_not_exposed():
    """The fusion's all-gather sits in its own computation (collectives.read), the start and done in the
    caller's (collectives.read_async): matched, it is hidden; the same gather with nothing between is not."""
    (a,) = comms.read_async(_ASYNC_FUSION)
    assert a.called == "fused_gather" and a.overlaps == ("h/mlp/c_fc",)
    c = step_time.comms(_ASYNC_FUSION, preset("v3-core"), 8)
    assert c.bytes == 1024 * 64 * 2 and c.exposed_bytes == 0 and c.exposed_s == 0
    bare = _ASYNC_FUSION.replace('metadata={op_name="jit(step)/closed_call/h/mlp/c_fc/dot_general"}', "")
    assert step_time.comms(bare, preset("v3-core"), 8).exposed_bytes == c.bytes


@pytest.mark.slow  # GPU compiles (about 15 s)
def test_fastest_on_the_tiny_config_for_an_h100_prints_a_winner_that_fits():
    import os

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    sets = ["model.vocab_size=1024", "model.n_layer=2", "model.seq_len=128", "model.dtype=bfloat16"]
    proc = subprocess.run([sys.executable, "-m", "zerolm.cli", "compile", "--config", str(TINY), "--target", "h100",
                           "--fastest", "--remats", "none,full", *[a for s in sets for a in ("--set", s)], "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["compiles"] == len(r["candidates"]) >= 2
    remats = {c["remat"] for c in r["candidates"]}
    assert remats == {"none", "full"}
    winner = next(c for c in r["candidates"] if [f"zero.stage={c['stage']}", f"train.micro_batch_size={c['micro']}",
                                                  f"model.remat={c['remat']}"] == r["winner"])
    assert winner["fits"] and winner["model"]["step_s"] == min(c["model"]["step_s"] for c in r["candidates"] if c["fits"])
    full = [c for c in r["candidates"] if c["remat"] == "full"]
    assert all(c["model"]["flops_ratio"] > 1.05 * winner["model"]["flops_ratio"] for c in full)  # recomputation seen


def test_a_modeled_mfu_over_100_percent_is_not_reported():
    """The model times matmuls at peak and MFU counts the attention's whole T × T: where that bound passes 100%
    it says nothing, and the output says so instead of a number over 100%."""
    flops = {"grad": step_time.Flops(total=9 * 10**12, kernels=0, uncounted_kernels=0, unknown_loops=0)}
    comms = {"grad": step_time.Comms(0, 0, 0.0)}
    h100 = preset("h100")
    under = step_time.StepModel(flops, comms, h100.flops, 1000, 1, 8 * 10**9)  # 0.9 of the model's FLOPs per token
    over = step_time.StepModel(flops, comms, h100.flops, 1000, 1, 10 * 10**9)
    assert under.mfu == pytest.approx(8 / 9)  # the model's FLOPs over the compiled ones, at peak with nothing exposed
    assert over.mfu is None and "MFU not modeled (its bound exceeds 100%)" in over.describe()
    assert json.loads(json.dumps(over.to_json()))["mfu"] is None
