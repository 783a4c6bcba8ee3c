"""The Llama layout's settings (`model.position: rope`, `model.norm: rmsnorm`, `model.mlp: swiglu`,
`model.n_kv_head`, `model.tie_embeddings: false`) against direct formulas, grouped-query attention against the
same attention with each key/value head repeated for its group, the KV cache against recomputing, and the config's
checks. Through the real sharded step: tests/test_model_options.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config
from test_model_options import LLAMA
from zerolm.config.sampling import Sampling
from zerolm.config.section import ConfigError
from zerolm.model import block, rotary
from zerolm.model import decoder as gpt_model
from zerolm.model.attention import Bias, alibi_slopes, causal_attention
from zerolm.model.generate import generate
from zerolm.parallel.auto import for_device


def test_rotary_turns_each_pair_by_its_position_times_its_frequency():
    """Pair (i, i + K/2) of a head is the complex number x_i + i·x_{i+K/2}, multiplied by e^(i·p·θ^(-2i/K))."""
    B, T, H, K, theta = 2, 5, 3, 8, 500.0
    x = np.random.default_rng(0).normal(size=(B, T, H, K)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3, 4], [7, 0, 1, 9, 2]])
    z = x[..., :K // 2] + 1j * x[..., K // 2:]
    angle = positions[:, :, None, None] * theta ** (-2 * np.arange(K // 2) / K)
    turned = z * np.exp(1j * angle)
    want = np.concatenate([turned.real, turned.imag], axis=-1)
    np.testing.assert_allclose(rotary.rotary(jnp.asarray(x), jnp.asarray(positions), theta), want, atol=1e-5)


def test_rmsnorm_divides_by_the_root_mean_square_and_scales():
    cfg = small_config("model.norm=rmsnorm", "model.norm_eps=1e-3").model
    x = np.random.default_rng(0).normal(size=(2, 3, 32)).astype(np.float32)
    scale = np.random.default_rng(1).normal(size=32).astype(np.float32)
    got = block.norm(cfg, jnp.float32, "n").apply({"params": {"scale": scale}}, x)
    np.testing.assert_allclose(got, x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-3) * scale, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
@pytest.mark.parametrize("extra", ["plain", "documents-alibi"])
def test_grouped_query_attention_is_attention_over_repeated_key_value_heads(implementation, extra):
    """Four query heads over two key/value heads (head h reads key/value head h // 2, Hugging Face's repeat_kv),
    its output and its gradients, with no repeated heads built (the blockwise attention packs a group per block)."""
    B, T, H, G, K = 2, 16, 4, 2, 8
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, H, K))
    k, v = (jax.random.normal(key, (B, T, G, K)) for key in keys[1:])
    bias = Bias()
    if extra == "documents-alibi":
        bias = Bias(jnp.array([[0] * 5 + [1] * 11, [0] * 16]), jnp.asarray(alibi_slopes(H)))

    def loss(q, k, v, repeat):
        if repeat:
            k, v = jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2)
        return (causal_attention(q, k, v, implementation, 4, bias) ** 2).sum()

    for got, want in zip(jax.value_and_grad(loss, (0, 1, 2))(q, k, v, False),
                         jax.value_and_grad(loss, (0, 1, 2))(q, k, v, True), strict=True):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)


def test_the_kv_cache_holds_the_key_value_heads_and_decodes_as_the_full_forward_pass():
    cfg = small_config("model.seq_len=32", *LLAMA).model
    model = gpt_model.GPT(for_device(cfg))
    params = jax.tree.map(lambda p: p * 30 if p.ndim >= 2 else p, gpt_model.init_params(model, jax.random.key(3)))
    assert gpt_model.init_cache(model, 1)["h"]["attn"]["k"].shape == (2, 1, 2, 32, 8)  # (layers, B, G, T, K)
    prompt = np.random.default_rng(0).integers(0, 100, 5)
    got = generate(model, params, prompt, 20, Sampling(temperature=0))
    forward = jax.jit(lambda buf: model.apply({"params": params}, buf[None])[0])
    ids = list(prompt)
    for _ in range(20):
        buf = np.zeros(32, np.int32)
        buf[:len(ids)] = ids
        ids.append(int(jnp.argmax(forward(buf)[len(ids) - 1])))
    assert got.tolist() == ids and len(set(ids[5:])) > 3


def test_the_layout_has_the_parameters_it_says_and_mfu_counts_the_matmuls():
    def shapes(*sets):
        model = gpt_model.GPT(for_device(small_config(*sets).model))
        params = jax.eval_shape(lambda: gpt_model.init_params(model, jax.random.key(0)))
        return params, {jax.tree_util.keystr(p, simple=True, separator="."): x.shape
                        for p, x in jax.tree_util.tree_leaves_with_path(params)}

    params, llama = shapes(*LLAMA)
    assert llama == {"wte": (128, 32), "lm_head": (128, 32), "ln_f.scale": (32,),
                     "h.ln_1.scale": (2, 32), "h.ln_2.scale": (2, 32),
                     "h.attn.c_q.kernel": (2, 32, 32), "h.attn.c_kv.kernel": (2, 32, 2, 16),
                     "h.attn.c_proj.kernel": (2, 32, 32), "h.mlp.c_fc.kernel": (2, 32, 64),
                     "h.mlp.c_gate.kernel": (2, 32, 64), "h.mlp.c_proj.kernel": (2, 64, 32)}
    # MFU's N: what a matmul reads, so not the untied token embedding (a lookup) nor a position table.
    assert gpt_model.count_params(params, matmul_only=True) == gpt_model.count_params(params) - 128 * 32
    gpt2, plain = shapes()
    assert gpt_model.count_params(gpt2, matmul_only=True) == gpt_model.count_params(gpt2) - 16 * 32
    assert plain["h.attn.c_attn.kernel"] == (2, 32, 3, 32) and "lm_head" not in plain
    assert shapes("model.mlp=swiglu")[1]["h.mlp.c_gate.kernel"] == (2, 32, 256)  # auto: 8/3·d up to 256's


@pytest.mark.parametrize("sets, message", [
    (["model.n_kv_head=3"], "model.n_kv_head: 3 does not divide model.n_head=4"),
    (["model.n_kv_head=2", "mesh.tp=4"], "(--set mesh.tp): mesh.tp: tp=4 does not divide model.n_kv_head=2"),
    (["model.mlp_hidden=66", "mesh.tp=4"], "(--set mesh.tp): mesh.tp: tp=4 does not divide the MLP width 66"),
    (["model.position=rope", "model.d_model=36", "model.n_head=12"], "model.position: rope rotates pairs"),
])
def test_a_layout_tensor_parallelism_cannot_split_is_one_line(sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        small_config(*sets, device_count=8)


def test_auto_and_the_number_it_means_are_the_same_parameters():
    """A checkpoint recorded with n_kv_head/mlp_hidden auto starts or resumes a run that spells them out
    (zerolm import-hf writes numbers), and the other way round; another number is another model."""
    from zerolm.checkpoint.compatible import parameter_differences

    auto = small_config("model.mlp=swiglu").model.model_dump()
    spelled = small_config("model.mlp=swiglu", "model.n_kv_head=4", "model.mlp_hidden=256").model.model_dump()
    assert parameter_differences(auto, spelled) == [] and parameter_differences(spelled, auto) == []
    other = small_config("model.mlp=swiglu", "model.mlp_hidden=64", "model.n_kv_head=2").model.model_dump()
    assert [k for k, _, _ in parameter_differences(auto, other)] == ["mlp_hidden", "n_kv_head"]


@pytest.mark.parametrize("eot", ["<|end_of_text|>", "</s>"])
def test_an_imported_tokenizers_end_of_text_is_its_own(eot):
    """Llama 3's and the sentencepiece-era Llama's end-of-text tokens are found (zerolm.hf.importer copies such a
    tokenizer.json beside the checkpoint; documents are packed and masked at that id)."""
    import tokenizers

    from zerolm.data.tokenizer import from_bytes

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    tok.add_special_tokens(["<s>", eot])
    loaded = from_bytes("tokenizer.json", tok.to_str().encode())
    assert (loaded.eot_id, loaded.eot_text) == (3, eot)
