"""The GPT model: causal, tied, padded vocabulary unused, remat changes nothing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config, small_model
from zerolm.model import decoder as gpt_model
from zerolm.model import losses


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


def _loss_and_grads(*overrides):
    tokens = np.random.default_rng(0).integers(0, 100, (2, 17))
    _, init_fn, loss_fn, _ = small_model(small_config(*overrides).model)
    return jax.jit(jax.value_and_grad(loss_fn))(init_fn(jax.random.key(0)), tokens)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_every_remat_policy_and_layer_loop_gives_the_same_loss_and_gradients(attention):
    """Each remat policy, with the layers in a scan and unrolled: the loss and gradients of no remat in a scan."""
    l0, g0 = _loss_and_grads("model.remat=none", "model.scan_layers=true", f"model.attention={attention}",
                             "model.attention_block=8")
    for policy in ("none", "full", "dots", "attention", "dots_attention"):
        for scan in ("true", "false"):
            l1, g1 = _loss_and_grads(f"model.remat={policy}", f"model.scan_layers={scan}", f"model.attention={attention}",
                                     "model.attention_block=8")
            what = f"{policy}, scan_layers={scan}"
            np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6, err_msg=what)
            jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7, err_msg=what), g0, g1)
    assert small_config("model.remat=true").model.remat == "full"  # the old boolean still reads


def test_the_layer_loop_keeps_the_parameter_layout():
    """Unrolled or scanned, the layers' parameters are the same tree, stacked along `layers`: checkpoints,
    sharding rules and the export are the same for both."""
    trees = [jax.tree.map(lambda a: (a.shape, a.dtype), small_model(small_config(f"model.scan_layers={s}").model)[3])
             for s in ("true", "false")]
    assert trees[0] == trees[1] and trees[0]["h"]["mlp"]["c_fc"]["kernel"][0][0] == 2  # n_layer 2, stacked


def test_chunked_loss_equals_the_plain_loss_and_its_gradient():
    l0, g0 = _loss_and_grads("model.loss_chunk=0")
    for chunk in (5, 8, 31):  # 2 × 16 targets: with padding (5, 31) and without (8)
        l1, g1 = _loss_and_grads(f"model.loss_chunk={chunk}")
        np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6, err_msg=str(chunk))
        jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7, err_msg=str(chunk)), g0, g1)


@pytest.mark.slow
def test_chunked_per_token_losses_and_bfloat16_match_the_plain_ones():
    tokens = np.random.default_rng(1).integers(0, 100, (2, 17))
    weights = np.random.default_rng(2).random((2, 16)).astype(np.float32)  # as evaluation's padding mask does

    def weighted(chunk, dtype="float32"):
        model, init_fn, _, _ = small_model(small_config(f"model.loss_chunk={chunk}", f"model.dtype={dtype}").model)
        fn = lambda p: jnp.sum(losses.token_losses(model, p, tokens) * weights)  # noqa: E731
        return jax.value_and_grad(fn)(init_fn(jax.random.key(0)))

    (l0, g0), (l1, g1) = weighted(0), weighted(5)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6), g0, g1)
    # bfloat16 compute: the fused training loss against the plain one, to bfloat16's precision.
    (b0, h0), (b1, h1) = (_loss_and_grads("model.dtype=bfloat16", f"model.loss_chunk={c}") for c in (0, 5))
    np.testing.assert_allclose(float(b1), float(b0), rtol=1e-2)
    assert _rel_norm(h1, h0) < 2e-2


def _rel_norm(a, b):
    a, b = (np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(t)]) for t in (a, b))
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.slow
def test_chunked_loss_never_builds_the_whole_logits():
    """What the output layer and loss add to the compiled gradient's temporary memory: more than the
    micro-batch's float32 logits unchunked, a small fraction of them chunked."""
    tokens = jnp.zeros((8, 257), jnp.int32)

    def temp_bytes(vocab, chunk):
        cfg = small_config("model.seq_len=256", f"model.vocab_size={vocab}", f"model.loss_chunk={chunk}")
        _, _, loss_fn, abstract = small_model(cfg.model)
        return jax.jit(jax.grad(loss_fn)).lower(abstract, tokens).compile().memory_analysis().temp_size_in_bytes

    rest = temp_bytes(100, 0)  # the model without a real output layer: vocabulary 128
    logits_bytes = 8 * 256 * 16000 * 4  # tokens × vocabulary × float32
    plain, chunked = temp_bytes(16000, 0) - rest, temp_bytes(16000, 256) - rest
    assert plain > logits_bytes > 10 * chunked, (plain, chunked)


def test_param_names_follow_hugging_face_gpt2():
    cfg = small_config()
    _, _, _, abstract = small_model(cfg.model)
    names = {jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in jax.tree_util.tree_leaves_with_path(abstract)}
    assert {"wte", "wpe", "ln_f.scale", "h.attn.c_attn.kernel", "h.attn.c_proj.bias", "h.mlp.c_fc.kernel",
            "h.ln_1.scale", "h.ln_2.bias"} <= names
    # Stacked over the 2 layers; (d, 3, d) = (embed, qkv, heads), which reshapes to GPT-2's (d, 3·d).
    assert abstract["h"]["attn"]["c_attn"]["kernel"].shape == (2, 32, 3, 32)
    assert gpt_model.count_params(abstract) == sum(x.size for x in jax.tree.leaves(abstract))


def test_the_one_pass_log_sum_exp_and_target_are_the_plain_ones():
    """losses.lse_and_target, the fused loss's one read of each chunk's logits: jax.nn.logsumexp and the target's
    logit as a gather give the same numbers, with the vocabulary's padding at output_logits' -1e30 and logits far
    apart (the online combination rescales the running sum as its maximum grows)."""
    from zerolm.model.losses import lse_and_target

    logits = jax.random.normal(jax.random.key(0), (64, 1000)) * jnp.linspace(0.1, 40.0, 64)[:, None]
    logits = logits.at[:, 900:].set(-1e30)
    targets = jax.random.randint(jax.random.key(1), (64,), 0, 900)
    lse, target = jax.jit(lse_and_target)(logits, targets)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, axis=-1), rtol=1e-6)
    np.testing.assert_array_equal(target, jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0])
