"""zerolm.step_time: the matmul FLOPs of a compiled program, loop-aware, against the analytic count; the
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
from zerolm import step_time
from zerolm.hardware import preset


def _scan_of_matmuls(k: int) -> str:
    def f(x, ws):
        return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]

    x, ws = jnp.zeros((8, 16)), jnp.zeros((k, 16, 16))
    return jax.jit(f).lower(x, ws).compile().as_text()


def test_the_flops_of_a_scan_of_k_matmuls_are_k_times_one_matmuls():
    for k in (3, 7):
        assert step_time.flops(_scan_of_matmuls(k)).total == k * 2 * 8 * 16 * 16


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
