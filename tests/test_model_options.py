"""The model's settings (`model.position: alibi | rope`, `model.bias: false`, dropout, the Llama layout's
RMSNorm, SwiGLU, grouped-query attention and untied output layer, and the parallel residual block with a norm
each or one shared) through the real sharded step
(zerolm.parallel.build.build_step): on dp 8 at ZeRO stages 1 and 3 and on dp 4 × tp 2, each steps like one device, for
each attention and layer loop that runs on CPU, with and without document masks (dropout too: its masks are
drawn per sample, not per device); and each changes the parameters or the function it should."""

import jax
import numpy as np
import pytest

from conftest import requires_devices, small_config
from test_zero_stages import assert_same, run
from zerolm.model import decoder as gpt_model
from zerolm.parallel.auto import for_device

pytestmark = requires_devices(8)


# The Llama layout: rotary positions, RMSNorm, SwiGLU, two key/value heads for four query heads, untied.
LLAMA = ("model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.mlp_hidden=64", "model.n_kv_head=2",
         "model.tie_embeddings=false", "model.bias=false")
DROPOUT = ("model.residual_dropout=0.2", "model.attention_dropout=0.2", "model.embedding_dropout=0.1")
PARALLEL = ("model.parallel_residual=true",)  # GPT-NeoX's block: a norm each
SHARED = ("model.parallel_residual=true", "model.shared_norm=true")  # GPT-J's: one norm


@pytest.mark.slow  # a sweep of the sharded step (or training runs) over layouts: the whole suite's, not the unit tier's
@pytest.mark.parametrize("sets", [
    # ALiBi composed with the rest of the Llama layout (grouped heads each keep their own slopes), in GPT-J's
    # parallel block: without residual dropout, so that both branches' input projections are one matmul and their
    # output projections another (c_q, c_kv, c_fc and c_gate fused: each splits over tp in whole heads or units)
    ("model.position=alibi", *DROPOUT[1:], "model.attention=xla", "model.scan_layers=true", *SHARED,
     *(s for s in LLAMA if not s.startswith(("model.position", "model.bias")))),
    # GPT-NeoX's parallel block with residual dropout: each branch's output dropped with its own mask
    ("model.position=alibi", "model.bias=false", *DROPOUT, "model.attention=blockwise", "model.attention_block=8",
     "model.scan_layers=false", "model.remat=full", "model.document_mask=true", "model.eot_id=3", *PARALLEL),
    (*LLAMA, "model.attention=blockwise", "model.attention_block=8", "model.scan_layers=false",
     "model.remat=full", "model.document_mask=true", "model.eot_id=3", "model.document_positions=restart",
     *DROPOUT),
], ids=["alibi-gqa-swiglu-rmsnorm-untied-parallel-sharednorm-dropout-xla-scan",
        "alibi-nobias-parallel-dropout-blockwise-unrolled-remat-documents",
        "llama-gqa-blockwise-unrolled-remat-documents-restart-dropout"])
def test_model_options_step_like_one_device_at_every_layout(sets):
    """ZeRO-3 on dp 8 (every reduction and gather of the design) and ZeRO-1 on dp 4 × tp 2 (heads split: each
    device's heads keep their own slopes) against one device. (ZeRO-1 on dp 8 equals stage 3: test_zero_stages.)
    The sequential block is the third case's, and every other test's of the step."""
    one = run(1, *sets, dp=1)
    assert_same(run(3, *sets), one, rtol=2e-5)
    assert_same(run(1, *sets, dp=4, tp=2), one, rtol=2e-5)


def test_alibi_has_no_position_table_and_no_bias_has_no_biases():
    def leaves(*sets):
        model = gpt_model.GPT(for_device(small_config(*sets).model))
        params = jax.eval_shape(lambda: gpt_model.init_params(model, jax.random.key(0)))
        return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}

    learned, alibi, no_bias = leaves(), leaves("model.position=alibi"), leaves("model.bias=false")
    assert "['wpe']" in learned and learned - alibi == {"['wpe']"}
    assert {k for k in learned - no_bias} == {k for k in learned if k.endswith("['bias']")} and len(learned - no_bias) == 7


def test_the_parallel_residual_changes_the_function_and_a_shared_norm_has_no_ln_2():
    """The same weights: the parallel block's logits differ from the sequential block's; GPT-NeoX's (a norm each)
    reads ln_2, GPT-J's (one norm) has none, and computes NeoX's with ln_2 set to ln_1, gradients too (GPT-J's
    input projections make their input's gradient in one matmul of their own: projections.projections)."""
    tokens = np.random.default_rng(0).integers(0, 100, (2, 16))

    def logits(params, *sets, grad=False):
        model = gpt_model.GPT(for_device(small_config(*sets).model))
        if grad:
            return jax.jit(jax.grad(lambda p: (model.apply({"params": p}, tokens) ** 2).mean()))(params)
        return np.asarray(jax.jit(model.apply)({"params": params}, tokens))

    sequential = gpt_model.GPT(for_device(small_config().model))
    init = gpt_model.init_params(sequential, jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), len(jax.tree.leaves(init)))  # each norm its own scale and bias
    params = jax.tree.unflatten(jax.tree.structure(init), [p + 0.1 * jax.random.normal(k, p.shape) for p, k in
                                                           zip(jax.tree.leaves(init), keys, strict=True)])
    neox = logits(params, *PARALLEL)
    assert not np.allclose(neox, logits(params), atol=1e-3)
    one_norm = {**params, "h": {k: v for k, v in params["h"].items() if k != "ln_2"}}
    gptj = logits(one_norm, *SHARED)
    assert not np.allclose(neox, gptj, atol=1e-3)
    tied = {**params, "h": {**params["h"], "ln_2": params["h"]["ln_1"]}}
    np.testing.assert_allclose(logits(tied, *PARALLEL), gptj, rtol=1e-5, atol=1e-5)
    neox_grads, gptj_grads = logits(tied, *PARALLEL, grad=True), logits(one_norm, *SHARED, grad=True)
    ln_1 = jax.tree.map(lambda a, b: a + b, neox_grads["h"]["ln_1"], neox_grads["h"]["ln_2"])  # the one norm's
    want = {**neox_grads, "h": {**{k: v for k, v in neox_grads["h"].items() if k != "ln_2"}, "ln_1": ln_1}}
    for (path, got), expected in zip(jax.tree_util.tree_leaves_with_path(gptj_grads), jax.tree.leaves(want),
                                     strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    model = gpt_model.GPT(for_device(small_config(*SHARED).model))
    shapes = jax.eval_shape(lambda: gpt_model.init_params(model, jax.random.key(0)))
    assert jax.tree.structure(shapes) == jax.tree.structure(one_norm)


def test_alibi_changes_the_function_and_learned_positions_do_not_matter_to_it():
    """The same weights: ALiBi's logits differ from learned positions', and do not read `wpe`."""
    cfg = small_config("model.position=alibi").model
    alibi = gpt_model.GPT(for_device(cfg))
    learned = gpt_model.GPT(for_device(small_config().model))
    params = gpt_model.init_params(learned, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 100, (2, 16))
    no_table = {k: v for k, v in params.items() if k != "wpe"}
    a = jax.jit(alibi.apply)({"params": no_table}, tokens)
    assert not np.allclose(a, jax.jit(learned.apply)({"params": params}, tokens), atol=1e-3)
    # causal: a prefix's logits do not depend on what follows it
    np.testing.assert_allclose(jax.jit(alibi.apply)({"params": no_table}, tokens[:, :8]), a[:, :8], rtol=1e-5,
                               atol=1e-5)


def test_dropout_drops():
    """Each rate changes the model's output when keys are given, and only then (the layouts' equality above would
    hold for a dropout that did nothing); another sample's key, another mask."""
    from zerolm.model.dropout import row_keys

    tokens = np.random.default_rng(0).integers(0, 100, (2, 16))
    plain = gpt_model.GPT(for_device(small_config().model))
    params = gpt_model.init_params(plain, jax.random.key(0))
    want = jax.jit(plain.apply)({"params": params}, tokens)
    keys = row_keys(0, jax.numpy.int32(3), jax.numpy.int32(0), 2)
    for rate, *layout in (("embedding_dropout",), ("residual_dropout",), ("attention_dropout",),
                          ("residual_dropout", *PARALLEL)):
        model = gpt_model.GPT(for_device(small_config(f"model.{rate}=0.3", *layout).model))
        if layout:  # the parallel block: the same parameters, its own function
            want = jax.jit(model.apply)({"params": params}, tokens)
        apply = jax.jit(lambda p, t, k, model=model: model.apply({"params": p}, t, dropout_keys=k))
        np.testing.assert_array_equal(jax.jit(model.apply)({"params": params}, tokens), want)  # no keys: none
        dropped = apply(params, tokens, keys)
        assert not np.allclose(dropped, want, atol=1e-3), rate
        swapped = apply(params, tokens[::-1], keys[::-1])  # each sample keeps its own key: its own mask
        np.testing.assert_allclose(swapped[::-1], dropped, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sets, message", [
    (["model.attention=pallas", "model.attention_dropout=0.1", "model.seq_len=128"], "model.attention: pallas's fused"),
    (["model.attention=cudnn", "model.attention_dropout=0.1"], "model.attention: cudnn's fused kernel draws no"),
    (["model.attention=pallas", "model.position=alibi", "model.seq_len=128"], "model.attention: pallas's TPU flash"),
])
def test_an_attention_that_cannot_do_an_option_is_one_line(sets, message):
    import re

    from zerolm.config.section import ConfigError

    with pytest.raises(ConfigError, match=re.escape(f"(--set model.attention): {message}")):
        small_config(*sets)


def test_a_shared_norm_without_the_parallel_residual_is_one_line():
    from zerolm.config.section import ConfigError

    with pytest.raises(ConfigError) as refused:
        small_config("model.shared_norm=true")
    assert str(refused.value).endswith(
        "(--set model.shared_norm): model.shared_norm: true shares one norm between the attention and the MLP, which "
        "read the same input only with model.parallel_residual: true") and "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_run_with_dropout_resumes_exactly(tmp_path):
    """Dropout's masks come from (seed, step, sample, layer): 4 steps straight equal 2, a restart, and 2 more."""
    import io
    import json

    from zerolm.train.trainer import train

    def losses(name, steps):
        train(small_config("model.residual_dropout=0.2", "model.attention_dropout=0.2", "model.embedding_dropout=0.1",
                           "model.vocab_size=auto", f"train.steps={steps}", "train.schedule_steps=4",
                           "train.warmup_steps=1", "train.global_batch_size=16", "train.micro_batch_size=1",
                           "train.eval_every=1000", "train.eval_sequences=0", "checkpoint.every=2", "sample.tokens=0",
                           f"logging.dir={tmp_path / name}", f"checkpoint.dir={tmp_path / name / 'ckpt'}"),
              out=io.StringIO())
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}

    straight = losses("straight", 4)
    losses("resumed", 2)
    assert losses("resumed", 4) == straight
