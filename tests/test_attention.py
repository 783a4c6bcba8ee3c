"""The blockwise attention against XLA's: the same outputs and gradients, and no T×T buffer on a TPU v3."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config, small_model

from zerolm.attention import block_size, blockwise_attention, causal_attention


def _qkv(B, T, H, K, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (B, T, H, K), dtype) for k in keys]


@pytest.mark.parametrize("T, block", [(64, 16), (64, 64), (48, 16), (32, 8)])
def test_blockwise_equals_xla_attention_and_its_gradients(T, block):
    q, k, v = _qkv(2, T, 3, 8)
    w = jax.random.normal(jax.random.key(7), q.shape)  # a loss that weighs every output differently

    def loss(impl):
        def f(q, k, v):
            y = (blockwise_attention(q, k, v, block) if impl == "blockwise"
                 else jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
            return jnp.sum(y * w), y
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (l_b, y_b), g_b = loss("blockwise")
    (l_x, y_x), g_x = loss("xla")
    np.testing.assert_allclose(y_b, y_x, rtol=1e-5, atol=1e-5)
    assert float(l_b) == pytest.approx(float(l_x), rel=1e-5)
    for a, b in zip(g_b, g_x):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_block_divides_the_sequence():
    assert block_size(2048) == 512 and block_size(16) == 16 and block_size(96) == 32


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
    for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gx)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_unknown_implementation_is_refused():
    q, k, v = _qkv(1, 8, 1, 4)
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        causal_attention(q, k, v, "flash")
