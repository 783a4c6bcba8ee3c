"""The GPT model: causal, tied, padded vocabulary unused, remat changes nothing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import small_config, small_model

from zerolm import model as gpt_model


def test_causal():
    cfg = small_config()
    model, init_fn, _, _ = small_model(cfg.model)
    params = init_fn(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 100, (2, 16))
    changed = tokens.copy()
    changed[:, 10:] = (changed[:, 10:] + 1) % 100
    a, b = model.apply({"params": params}, tokens), model.apply({"params": params}, changed)
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_padded_vocabulary_gets_no_probability_and_embeddings_are_tied():
    cfg = small_config()
    model, init_fn, _, _ = small_model(cfg.model)
    params = init_fn(jax.random.key(0))
    assert params["wte"].shape == (128, 32)  # vocab 100 padded to 128
    assert "lm_head" not in params
    probs = jax.nn.softmax(model.apply({"params": params}, jnp.zeros((1, 16), jnp.int32)))
    assert float(probs[..., 100:].max()) == 0.0


def test_loss_of_untrained_model_is_near_uniform():
    cfg = small_config()
    _, init_fn, loss_fn, _ = small_model(cfg.model)
    tokens = np.random.default_rng(0).integers(0, 100, (4, 17))
    assert abs(float(loss_fn(init_fn(jax.random.key(0)), tokens)) - np.log(100)) < 0.1


def test_remat_gives_the_same_loss_and_gradients():
    tokens = np.random.default_rng(0).integers(0, 100, (2, 17))
    results = []
    for remat in (False, True):
        cfg = small_config(f"model.remat={str(remat).lower()}")
        _, init_fn, loss_fn, _ = small_model(cfg.model)
        results.append(jax.value_and_grad(loss_fn)(init_fn(jax.random.key(0)), tokens))
    (l0, g0), (l1, g1) = results
    assert float(l0) == float(l1)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), g0, g1)


def test_param_names_follow_hugging_face_gpt2():
    cfg = small_config()
    _, _, _, abstract = small_model(cfg.model)
    names = {jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in jax.tree_util.tree_leaves_with_path(abstract)}
    assert {"wte", "wpe", "ln_f.scale", "h.attn.c_attn.kernel", "h.attn.c_proj.bias", "h.mlp.c_fc.kernel",
            "h.ln_1.scale", "h.ln_2.bias"} <= names
    assert abstract["h"]["attn"]["c_attn"]["kernel"].shape == (2, 32, 96)  # stacked over the 2 layers
    assert gpt_model.count_params(abstract) == sum(x.size for x in jax.tree.leaves(abstract))
