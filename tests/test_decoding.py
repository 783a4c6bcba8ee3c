"""One attention for training and decoding: what decoding computes over its KV cache (a prompt prefilled, then one
position at a time) equals the training forward over the same tokens, for learned, ALiBi and rotary positions,
grouped key/value heads, with the forward's parameters laid out for tensor parallelism 1 and 2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import requires_devices, small_config
from zerolm.model import decoder as gpt_model
from zerolm.model.block import Decoding
from zerolm.parallel.auto import for_device
from zerolm.parallel.build import build_step
from zerolm.parallel.mesh import make_mesh


@pytest.mark.slow  # a layout sweep of the model
@requires_devices(8)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("position", ["learned", "alibi", "rope"])
def test_decoding_over_the_cache_is_the_training_forward(position, tp):
    cfg = small_config(f"model.position={position}", "model.seq_len=32", "model.n_kv_head=2", f"mesh.dp={8 // tp}",
                       f"mesh.tp={tp}", "model.attention=xla")
    model, zero, init_fn = build_step(cfg, make_mesh(8 // tp, tp))
    params = jax.tree.map(lambda p: p * 8 if p.ndim >= 2 else p, zero.init(init_fn, jax.random.key(1)).params)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 32)).astype(np.int32)
    want = np.asarray(jax.jit(lambda p, t: model.apply({"params": p}, t))(params, tokens))

    decoder = gpt_model.GPT(for_device(cfg.model))
    host = jax.device_get(params)
    step = jax.jit(lambda p, cache, t, start: decoder.apply({"params": p, "cache": cache}, t,
                                                             decoding=Decoding(start), mutable=["cache"]))
    cache = gpt_model.init_cache(decoder, 2)
    logits, updated = step(host, cache, tokens[:, :7], jnp.zeros(2, jnp.int32))  # the prompt, prefilled at once
    got = [np.asarray(logits)]
    for p in range(7, 32):
        logits, updated = step(host, updated["cache"], tokens[:, p:p + 1], jnp.full(2, p, jnp.int32))
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=2e-4, atol=2e-4)
    assert np.abs(want[:, 1:] - want[:, :-1]).max() > 1  # the positions' logits differ: a real comparison
