"""The blockwise and Pallas attentions against XLA's: the same outputs and gradients (the T×T buffers they
avoid on TPU are checked on the TPU compiler's output in test_compile)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import small_config, small_model
from zerolm.config.section import ConfigError
from zerolm.model.attention import Bias, alibi_slopes, block_size, causal_attention
from zerolm.parallel import auto
from zerolm.parallel.build import build_step
from zerolm.parallel.mesh import make_mesh


def _qkv(B, T, H, K, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (B, T, H, K), dtype) for k in keys]


def _by_the_formula(q, k, v, slopes):
    """softmax(q kᵀ/√K + m_h · (j − i)) v over j ≤ i, in numpy: Press et al. 2022's ALiBi (slopes None: none)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T = q.shape[1]
    s = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    if slopes is not None:
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        s = s + np.asarray(slopes, np.float64)[None, :, None, None] * (j - i)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshk->bthk", p / p.sum(-1, keepdims=True), v)


def test_alibi_slopes_are_the_papers():
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
    # 12 heads: the 8 of 2^3, then every other slope of 16 heads' sequence (2^(-0.5·(2k+1))), 4 of them
    np.testing.assert_allclose(alibi_slopes(12), [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + k) for k in range(4)])


@pytest.mark.parametrize("T, block, alibi", [(64, 16, False), (64, 64, False), (48, 16, False), (32, 8, False),
                                             (64, 16, True), (48, 16, True)])
def test_blockwise_equals_xla_attention_and_its_gradients(T, block, alibi):
    q, k, v = _qkv(2, T, 3, 8)
    w = jax.random.normal(jax.random.key(7), q.shape)  # a loss that weighs every output differently
    slopes = jnp.asarray([0.5, 0.25, 0.0625]) if alibi else None  # large, so that the bias matters

    def loss(impl):
        def f(q, k, v):
            y = causal_attention(q, k, v, impl, block, Bias(None, slopes))
            return jnp.sum(y * w), y
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (l_b, y_b), g_b = loss("blockwise")
    (l_x, y_x), g_x = loss("xla")
    np.testing.assert_allclose(y_x, _by_the_formula(q, k, v, slopes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y_b, y_x, rtol=1e-5, atol=1e-5)
    assert float(l_b) == pytest.approx(float(l_x), rel=1e-5)
    for a, b in zip(g_b, g_x, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_block_divides_the_sequence():
    assert block_size(2048) == 512 and block_size(16) == 16 and block_size(96) == 32


@pytest.mark.slow
def test_the_model_trains_the_same_with_blockwise_attention():
    """The whole model's loss and gradient (16 positions: 4 blocks of 4)."""
    rows = np.random.default_rng(0).integers(0, 100, (4, 17)).astype(np.int32)
    results = {}
    for impl in ("xla", "blockwise"):
        cfg = small_config(f"model.attention={impl}", "model.attention_block=4")
        _, init_fn, loss_fn, _ = small_model(cfg.model)
        results[impl] = jax.value_and_grad(loss_fn)(init_fn(jax.random.key(0)), rows)
    (lx, gx), (lb, gb) = results["xla"], results["blockwise"]
    assert float(lb) == pytest.approx(float(lx), rel=1e-6)
    for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gx), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_unknown_implementation_is_refused():
    q, k, v = _qkv(1, 8, 1, 4)
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        causal_attention(q, k, v, "flash")


def test_pallas_equals_xla_attention_inside_the_steps_shard_map():
    """Pallas's TPU flash attention, run by Pallas's TPU interpreter on this CPU, inside a dp `shard_map` with
    JAX's varying-axes check on, as the step runs it: the same outputs and gradients as XLA's."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v = _qkv(2, 256, 2, 64)
    w = jax.random.normal(jax.random.key(7), q.shape)
    mesh = jax.make_mesh((2,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2])

    def step(impl):
        def body(q, k, v, w):
            def f(q, k, v):
                y = causal_attention(q, k, v, impl, block=128)
                return jnp.sum(y * w), y
            (_, y), g = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            return y, g
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"),) * 4, out_specs=(P("dp"), (P("dp"),) * 3)))
        return fn(*(jax.device_put(x, NamedSharding(mesh, P("dp"))) for x in (q, k, v, w)))

    with pltpu.force_tpu_interpret_mode():
        y_p, g_p = step("pallas")
    y_x, g_x = step("xla")
    np.testing.assert_allclose(y_p, y_x, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_p, g_x, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_pallas_is_asked_for_only_where_it_runs():
    """auto picks Pallas on TPU v4+ (when the sequence cuts into 128-lane blocks), blockwise on v2/v3; asking
    for it with blocks it cannot take, or on a CPU, is a one-line config error."""
    model = small_config("model.seq_len=2048", "model.attention=auto", "model.dtype=auto").model
    tpu = functools.partial(auto.Where, "tpu")
    assert auto.dtype(model.dtype, tpu("TPU v4")) == "bfloat16" and auto.attention(model, tpu("TPU v4")) == "pallas"
    assert auto.attention(model, tpu("TPU v5 lite")) == "pallas"
    assert auto.attention(model, tpu("TPU v3")) == "blockwise"
    assert auto.attention(model.model_copy(update={"seq_len": 200}), tpu("TPU v4")) == "blockwise"
    with pytest.raises(ConfigError, match=r"model.attention: pallas cuts the sequence into blocks of a multiple "
                                          r"of 128 positions; seq_len 16 and attention_block 512 give 16"):
        build_step(small_config("model.attention=pallas"), make_mesh(8, 1))
    cfg = small_config("model.attention=pallas", "model.seq_len=256")
    with pytest.raises(ConfigError, match=r"model.attention: pallas runs on TPU v4 and later, not on cpu"):
        build_step(cfg, make_mesh(8, 1))
    with pytest.raises(ConfigError, match=r"model.attention: cudnn runs on NVIDIA GPUs, not on cpu"):
        build_step(small_config("model.attention=cudnn"), make_mesh(8, 1))
