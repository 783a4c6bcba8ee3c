"""The transformers layouts a zerolm model converts to: per layout, one table from zerolm's parameter paths
to transformers' tensor names, each entry with the change of form between them (and its inverse, so that
an import reads the same table backwards).

- **GPT-2** (`GPT2LMHeadModel`): learned positions (`wpe`), biases, the tanh GELU (`gelu_new`). zerolm's
  names are GPT-2's already; `c_attn`'s (d, 3, d) kernel is GPT-2's Conv1D (d, 3·d). A bias-free model
  goes here too, with zero biases (what a missing bias computes).
- **MPT** (`MptForCausalLM`): ALiBi, no biases at all (transformers' MPT builds every LayerNorm and
  Linear without one, whatever `no_bias` says), the exact GELU. Its Linears store (out, in), so each
  kernel is transposed. Its ALiBi slopes (`build_mpt_alibi_tensor`) are `zerolm.model.attention.alibi_slopes`
  for every head count: for n heads, P = 2^⌈log2 n⌉ and slope_h = 2^(-8(h+1)/P); MPT keeps the odd-indexed
  ones (2^(-8(k+1)/(P/2)): Press's P/2-head sequence) then the even-indexed (every other slope of Press's
  P-head sequence), the first n, which is Press's rule. Its bias slope·(j − (length−1)) differs from
  zerolm's slope·(j − i) by a constant per query, which softmax ignores.

- **Llama** (`LlamaForCausalLM`): rotary positions (the rotate-half form both compute), RMSNorms, SwiGLU
  (`c_gate`, `c_fc`, `c_proj` are gate_proj, up_proj, down_proj), no biases, grouped-query attention
  (`c_q` and `c_kv`'s two parts; a model with as many key/value heads as query heads splits `c_attn` into
  q_proj, k_proj, v_proj), the output layer tied or its own (`lm_head`). Linears store (out, in).

- **GPT-NeoX** (`GPTNeoXForCausalLM`): rotary positions over the whole head (rotary_pct 1; rotate-half, as zerolm's),
  a LayerNorm before each branch, the parallel residual block or the sequential one (`use_parallel_residual`),
  biases everywhere, either GELU, any MLP width, the output layer tied or its own. Its `query_key_value` holds each
  head's q, k and v side by side (`NEOX_QKV`).
- **GPT-J** (`GPTJForCausalLM`): the parallel block with one LayerNorm (`model.shared_norm`), rotary positions of
  base 10000 over the whole head (rotary_dim = head_dim) in the rotate-every-two form, whose pairs are zerolm's
  reordered in each head's q and k rows (`_every_two`), no biases in the attention (`model.bias: false`; the
  norms' and the MLP's written as zeros, and the output layer's bias too), either GELU, tied or not.

GPT-2 and MPT tie the output layer to `wte`. Every layout drops the vocabulary's padding rows. Which layout
a model takes is `layout_for(cfg)`: by `model.position`, and for rotary positions by the norm and MLP (RMSNorm or
SwiGLU: Llama; LayerNorms and a GELU MLP: GPT-NeoX, or GPT-J with a shared norm); a model the layout cannot hold
exactly is refused in one line naming the setting.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from zerolm.config.model import ResolvedModelConfig
from zerolm.core.errors import ZerolmError
from zerolm.data.tokenizer import Tokenizer
from zerolm.model import decoder as gpt_model
from zerolm.parallel import auto


class ExportError(ZerolmError):
    """A model the transformers layout for its settings cannot hold exactly; the message names the setting."""


class Op(NamedTuple):
    """One tensor's change of form: `to_hf(x, cfg)` gives transformers' tensor, `from_hf(y, shape, cfg)` zerolm's
    (of that shape) back. `part`: transformers' tensor is part `part` of zerolm's axis 1 (zerolm's tensor is
    its parts stacked there, in order; `shape` is then a part's)."""

    to_hf: Callable[[np.ndarray, ResolvedModelConfig], np.ndarray]
    from_hf: Callable[[np.ndarray, tuple[int, ...], ResolvedModelConfig], np.ndarray]
    part: int | None = None


AS_IS = Op(lambda x, cfg: x, lambda y, shape, cfg: y.reshape(shape))
# The embedding without the vocabulary's padding rows (zeros again on the way back).
VOCAB = Op(lambda x, cfg: x[:cfg.vocab_size], lambda y, shape, cfg: np.pad(y, ((0, shape[0] - y.shape[0]), (0, 0))))
# c_attn's (d, 3, d) kernel, or (3, d) bias, with q, k and v side by side: GPT-2's Conv1D (d, 3·d), (3·d,).
QKV = Op(lambda x, cfg: x.reshape(*x.shape[:-2], -1), lambda y, shape, cfg: y.reshape(shape))
# A flax kernel (in, out) as a torch Linear's weight (out, in).
LINEAR = Op(lambda x, cfg: x.T, lambda y, shape, cfg: y.T.reshape(shape))
# c_attn's kernel as one Linear (3·d, d): q's d outputs, then k's, then v's (what MPT's `chunk(3)` splits).
QKV_LINEAR = Op(lambda x, cfg: x.reshape(x.shape[0], -1).T, lambda y, shape, cfg: y.T.reshape(shape))


def _by_head(x: np.ndarray, cfg: ResolvedModelConfig) -> np.ndarray:
    """c_attn's (d, 3, H·K) kernel as (H, 3, K, d), or its (3, H·K) bias as (H, 3, K)."""
    H, K = cfg.n_head, cfg.head_dim
    if x.ndim == 2:
        return x.reshape(3, H, K).transpose(1, 0, 2)
    return x.reshape(x.shape[0], 3, H, K).transpose(2, 1, 3, 0)


# c_attn as GPT-NeoX's query_key_value Linear (3·d, d), and its bias: each head's q, k and v side by side
# (transformers' GPT-NeoX views the output as (heads, 3·K) and splits each head's row in three).
NEOX_QKV = Op(lambda x, cfg: _by_head(x, cfg).reshape(3 * cfg.d_model, *x.shape[:-2]),
              lambda y, shape, cfg: (y.reshape(cfg.n_head, 3, cfg.head_dim, *y.shape[1:]).transpose(3, 1, 0, 2)
                                     if y.ndim == 2 else y.reshape(cfg.n_head, 3, cfg.head_dim).transpose(1, 0, 2)
                                     ).reshape(shape))


def _linear_part(i: int) -> Op:
    """Part i of a stacked kernel (d, parts, n) as a torch Linear's weight (n, d): q, k or v of `c_attn`, k or v
    of `c_kv`."""
    return Op(lambda x, cfg: x[:, i].T, lambda y, shape, cfg: y.T.reshape(shape), part=i)


def _every_two(cfg: ResolvedModelConfig, inverse: bool = False) -> np.ndarray:
    """The order of a head's K dimensions that turns zerolm's rotary pairs (i, i + K/2), rotate-half's, into GPT-J's
    (2i, 2i + 1), rotate-every-two's, with the same frequency i (or back, `inverse`): a query and a key permuted
    alike have the same dot product."""
    K = cfg.head_dim
    order = np.arange(K).reshape(2, K // 2).T.reshape(K)  # 0, K/2, 1, K/2 + 1, ...
    return np.argsort(order) if inverse else order


def _rotated_part(i: int) -> Op:
    """q (i = 0) or k (1) of `c_attn` as GPT-J's Linear (d, d), each head's output rows in rotate-every-two's order."""
    def to_hf(x, cfg):
        w = x[:, i].T.reshape(cfg.n_head, cfg.head_dim, -1)
        return w[:, _every_two(cfg)].reshape(cfg.d_model, -1)

    def from_hf(y, shape, cfg):
        w = y.reshape(cfg.n_head, cfg.head_dim, -1)[:, _every_two(cfg, inverse=True)]
        return w.reshape(cfg.d_model, -1).T.reshape(shape)
    return Op(to_hf, from_hf, part=i)


class Tensor(NamedTuple):
    zerolm: str  # the parameter's path, dots between levels ("h.attn.c_attn.kernel")
    hf: str  # transformers' name; a layer's has `{i}` for its index
    op: Op = AS_IS


@dataclass(frozen=True)
class Layout:
    architecture: str  # transformers' class
    biases: bool  # its LayerNorms and linears have biases (a bias-free model's are written as zeros)
    activation: str  # the model.activation its MLP computes
    gelu: str  # that GELU, in words
    # Tensors whose zerolm parameter a model lacks are not written (Llama's lm_head of a tied model, c_attn of a
    # grouped-query one); a parameter no tensor takes is refused (hf_state_dict).
    globals: tuple[Tensor, ...]  # the parameters outside the blocks
    layers: tuple[Tensor, ...]  # each block's, stacked along zerolm's leading layer axis
    config: Callable[[ResolvedModelConfig, Tokenizer], dict]  # its config.json
    # The other model settings it holds: model.<key> -> (the value it needs, how transformers' class computes).
    requires: tuple[tuple[str, object, str], ...] = (
        ("norm", "layernorm", "LayerNorms"), ("mlp", "gelu", "a GELU MLP"),
        ("tie_embeddings", True, "its output layer tied to the token embedding"),
        ("n_kv_head", "auto", "as many key/value heads as query heads"),
        ("parallel_residual", False, "a sequential block (the MLP reads the attention's output)"))
    # Tensors transformers' class has and zerolm's model computes without: written as these values (GPT-J's output
    # layer's bias, zeros), and on import refused unless they are these.
    fixed: Callable[[ResolvedModelConfig], dict[str, np.ndarray]] = lambda cfg: {}


def _gpt2_config(cfg: ResolvedModelConfig, tokenizer: Tokenizer) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": True,
            "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "dtype": "float32"}


def _mpt_config(cfg: ResolvedModelConfig, tokenizer: Tokenizer) -> dict:
    return {"architectures": ["MptForCausalLM"], "model_type": "mpt", "vocab_size": cfg.vocab_size,
            "d_model": cfg.d_model, "n_heads": cfg.n_head, "n_layers": cfg.n_layer, "expansion_ratio": 4,
            "max_seq_len": cfg.seq_len, "no_bias": True, "learned_pos_emb": False, "layer_norm_epsilon": cfg.norm_eps,
            "attn_config": {"alibi": True, "alibi_bias_max": 8, "attn_impl": "torch", "softmax_scale": None},
            "resid_pdrop": 0.0, "emb_pdrop": 0.0, "logit_scale": None, "tie_word_embeddings": True,
            "use_cache": True, "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id,
            "dtype": "float32"}


GPT2 = Layout(
    architecture="GPT2LMHeadModel", biases=True, activation="gelu_tanh", gelu="the tanh GELU (gelu_new)",
    globals=(Tensor("wte", "transformer.wte.weight", VOCAB), Tensor("wpe", "transformer.wpe.weight"),
             Tensor("ln_f.scale", "transformer.ln_f.weight"), Tensor("ln_f.bias", "transformer.ln_f.bias")),
    layers=tuple(Tensor(f"h.{z}", f"transformer.h.{{i}}.{hf}", op) for z, hf, op in (
        ("ln_1.scale", "ln_1.weight", AS_IS), ("ln_1.bias", "ln_1.bias", AS_IS),
        ("attn.c_attn.kernel", "attn.c_attn.weight", QKV), ("attn.c_attn.bias", "attn.c_attn.bias", QKV),
        ("attn.c_proj.kernel", "attn.c_proj.weight", AS_IS), ("attn.c_proj.bias", "attn.c_proj.bias", AS_IS),
        ("ln_2.scale", "ln_2.weight", AS_IS), ("ln_2.bias", "ln_2.bias", AS_IS),
        ("mlp.c_fc.kernel", "mlp.c_fc.weight", AS_IS), ("mlp.c_fc.bias", "mlp.c_fc.bias", AS_IS),
        ("mlp.c_proj.kernel", "mlp.c_proj.weight", AS_IS), ("mlp.c_proj.bias", "mlp.c_proj.bias", AS_IS))),
    config=_gpt2_config)

MPT = Layout(
    architecture="MptForCausalLM", biases=False, activation="gelu", gelu="the exact GELU",
    globals=(Tensor("wte", "transformer.wte.weight", VOCAB), Tensor("ln_f.scale", "transformer.norm_f.weight")),
    layers=tuple(Tensor(f"h.{z}", f"transformer.blocks.{{i}}.{hf}", op) for z, hf, op in (
        ("ln_1.scale", "norm_1.weight", AS_IS), ("attn.c_attn.kernel", "attn.Wqkv.weight", QKV_LINEAR),
        ("attn.c_proj.kernel", "attn.out_proj.weight", LINEAR), ("ln_2.scale", "norm_2.weight", AS_IS),
        ("mlp.c_fc.kernel", "ffn.up_proj.weight", LINEAR), ("mlp.c_proj.kernel", "ffn.down_proj.weight", LINEAR))),
    config=_mpt_config)



def _llama_config(cfg: ResolvedModelConfig, tokenizer: Tokenizer) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "rope_theta": cfg.rope_theta,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": 0.02, "use_cache": True, "bos_token_id": tokenizer.eot_id,
            "eos_token_id": tokenizer.eot_id, "dtype": "float32"}


LLAMA = Layout(
    architecture="LlamaForCausalLM", biases=False, activation="any", gelu="SwiGLU",
    globals=(Tensor("wte", "model.embed_tokens.weight", VOCAB), Tensor("lm_head", "lm_head.weight", VOCAB),
             Tensor("ln_f.scale", "model.norm.weight")),
    layers=tuple(Tensor(f"h.{z}", f"model.layers.{{i}}.{hf}", op) for z, hf, op in (
        ("ln_1.scale", "input_layernorm.weight", AS_IS), ("ln_2.scale", "post_attention_layernorm.weight", AS_IS),
        ("attn.c_attn.kernel", "self_attn.q_proj.weight", _linear_part(0)),
        ("attn.c_attn.kernel", "self_attn.k_proj.weight", _linear_part(1)),
        ("attn.c_attn.kernel", "self_attn.v_proj.weight", _linear_part(2)),
        ("attn.c_q.kernel", "self_attn.q_proj.weight", LINEAR),
        ("attn.c_kv.kernel", "self_attn.k_proj.weight", _linear_part(0)),
        ("attn.c_kv.kernel", "self_attn.v_proj.weight", _linear_part(1)),
        ("attn.c_proj.kernel", "self_attn.o_proj.weight", LINEAR),
        ("mlp.c_gate.kernel", "mlp.gate_proj.weight", LINEAR), ("mlp.c_fc.kernel", "mlp.up_proj.weight", LINEAR),
        ("mlp.c_proj.kernel", "mlp.down_proj.weight", LINEAR))),
    config=_llama_config,
    requires=(("norm", "rmsnorm", "RMSNorms"), ("mlp", "swiglu", "a SwiGLU MLP"),
              ("parallel_residual", False, "a sequential block (the MLP reads the attention's output)")))

HF_GELU = {"gelu_tanh": "gelu_new", "gelu": "gelu"}  # model.activation -> transformers' name of that GELU


def _neox_config(cfg: ResolvedModelConfig, tokenizer: Tokenizer) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0}
    return {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "intermediate_size": cfg.mlp_hidden, "hidden_act": HF_GELU[cfg.activation],
            "max_position_embeddings": cfg.seq_len, "layer_norm_eps": cfg.norm_eps,
            "use_parallel_residual": cfg.parallel_residual, "rope_parameters": rope, "rotary_pct": 1.0,
            "rotary_emb_base": cfg.rope_theta, "attention_bias": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "dtype": "float32"}


# GPT-NeoX: rotary positions (rotate-half, as zerolm's; the whole head: rotary_pct 1), a LayerNorm with bias before
# the attention and one before the MLP, the blocks parallel (use_parallel_residual) or sequential, biases in every
# linear (a bias-free model's written as zeros), a GELU MLP of any width, the output layer tied or its own.
NEOX = Layout(
    architecture="GPTNeoXForCausalLM", biases=True, activation="any", gelu="the exact or the tanh GELU",
    globals=(Tensor("wte", "gpt_neox.embed_in.weight", VOCAB), Tensor("lm_head", "lm_head.weight", VOCAB),
             Tensor("ln_f.scale", "gpt_neox.final_layer_norm.weight"),
             Tensor("ln_f.bias", "gpt_neox.final_layer_norm.bias")),
    layers=tuple(Tensor(f"h.{z}", f"gpt_neox.layers.{{i}}.{hf}", op) for z, hf, op in (
        ("ln_1.scale", "input_layernorm.weight", AS_IS), ("ln_1.bias", "input_layernorm.bias", AS_IS),
        ("ln_2.scale", "post_attention_layernorm.weight", AS_IS), ("ln_2.bias", "post_attention_layernorm.bias", AS_IS),
        ("attn.c_attn.kernel", "attention.query_key_value.weight", NEOX_QKV),
        ("attn.c_attn.bias", "attention.query_key_value.bias", NEOX_QKV),
        ("attn.c_proj.kernel", "attention.dense.weight", LINEAR), ("attn.c_proj.bias", "attention.dense.bias", AS_IS),
        ("mlp.c_fc.kernel", "mlp.dense_h_to_4h.weight", LINEAR), ("mlp.c_fc.bias", "mlp.dense_h_to_4h.bias", AS_IS),
        ("mlp.c_proj.kernel", "mlp.dense_4h_to_h.weight", LINEAR), ("mlp.c_proj.bias", "mlp.dense_4h_to_h.bias", AS_IS))),
    config=_neox_config,
    requires=(("norm", "layernorm", "LayerNorms"), ("mlp", "gelu", "a GELU MLP"),
              ("n_kv_head", "auto", "as many key/value heads as query heads"),
              ("shared_norm", False, "a norm before each branch")))


def _gptj_config(cfg: ResolvedModelConfig, tokenizer: Tokenizer) -> dict:
    return {"architectures": ["GPTJForCausalLM"], "model_type": "gptj", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "rotary_dim": cfg.head_dim, "n_inner": cfg.mlp_hidden, "activation_function": HF_GELU[cfg.activation],
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "dtype": "float32"}


# GPT-J: one LayerNorm (ln_1) before both branches of a parallel block, rotary positions of base 10000 over the whole
# head (rotary_dim = the head's width) in the rotate-every-two form (zerolm's rotate-half pairs reordered in q's and
# k's rows: `_every_two`), separate q, k, v and out projections without biases, a GELU MLP with biases (a bias-free
# model's written as zeros), an output layer with a bias (zeros: `fixed`), tied or its own.
GPTJ = Layout(
    architecture="GPTJForCausalLM", biases=True, activation="any", gelu="the exact or the tanh GELU",
    globals=(Tensor("wte", "transformer.wte.weight", VOCAB), Tensor("lm_head", "lm_head.weight", VOCAB),
             Tensor("ln_f.scale", "transformer.ln_f.weight"), Tensor("ln_f.bias", "transformer.ln_f.bias")),
    layers=tuple(Tensor(f"h.{z}", f"transformer.h.{{i}}.{hf}", op) for z, hf, op in (
        ("ln_1.scale", "ln_1.weight", AS_IS), ("ln_1.bias", "ln_1.bias", AS_IS),
        ("attn.c_attn.kernel", "attn.q_proj.weight", _rotated_part(0)),
        ("attn.c_attn.kernel", "attn.k_proj.weight", _rotated_part(1)),
        ("attn.c_attn.kernel", "attn.v_proj.weight", _linear_part(2)),
        ("attn.c_proj.kernel", "attn.out_proj.weight", LINEAR),
        ("mlp.c_fc.kernel", "mlp.fc_in.weight", LINEAR), ("mlp.c_fc.bias", "mlp.fc_in.bias", AS_IS),
        ("mlp.c_proj.kernel", "mlp.fc_out.weight", LINEAR), ("mlp.c_proj.bias", "mlp.fc_out.bias", AS_IS))),
    config=_gptj_config,
    requires=(("norm", "layernorm", "LayerNorms"), ("mlp", "gelu", "a GELU MLP"),
              ("n_kv_head", "auto", "as many key/value heads as query heads"),
              ("bias", False, "no biases in its attention"),
              ("rope_theta", 10000.0, "rotary embeddings of base 10000")),
    fixed=lambda cfg: {"lm_head.bias": np.zeros(cfg.vocab_size, np.float32)})


def _layout(cfg: ResolvedModelConfig) -> tuple[Layout, str]:
    """The layout a model's settings pick, and those settings in words."""
    if cfg.position == "learned":
        return GPT2, "model.position: learned"
    if cfg.position == "alibi":
        return MPT, "model.position: alibi"
    if cfg.norm == "rmsnorm" or cfg.mlp == "swiglu":
        return LLAMA, f"model.position: rope and {'model.norm: rmsnorm' if cfg.norm == 'rmsnorm' else 'model.mlp: swiglu'}"
    if cfg.shared_norm:
        return GPTJ, "model.position: rope and model.shared_norm: true"
    return NEOX, "model.position: rope, LayerNorms and a GELU MLP"


def layout_for(cfg: ResolvedModelConfig) -> Layout:
    """The layout a model exports to; ExportError for a model it cannot hold exactly."""
    layout, picked = _layout(cfg)
    why = f"a model with {picked} exports to transformers' {layout.architecture}"
    if layout.activation != "any" and cfg.activation != layout.activation:
        raise ExportError(f"model.activation: {cfg.activation}: {why}, whose MLP is {layout.gelu}; "
                          f"train with model.activation: {layout.activation}")
    if cfg.bias and not layout.biases:
        raise ExportError(f"model.bias: true: {why}, which has no biases; train with model.bias: false")
    for key, value, what in layout.requires:
        have = ("auto" if cfg.n_kv_head == cfg.n_head else cfg.n_kv_head) if key == "n_kv_head" else getattr(cfg, key)
        if have != value:
            raise ExportError(f"model.{key}: {_yaml(getattr(cfg, key))}: {why}, which has {what}; train with "
                              f"model.{key}: {_yaml(value)}")
    return layout


def _yaml(value: object) -> str:
    """A setting's value as the config writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def hf_state_dict(params, cfg: ResolvedModelConfig, layout: Layout) -> dict[str, np.ndarray]:
    """zerolm's parameter tree as the layout's float32 tensors (numpy, contiguous). `cfg`: the model's,
    resolved for a device (as `GPT` takes it)."""
    p = {k: np.asarray(v) for k, v in flatten(params).items()}
    taken = {t.zerolm for t in layout.globals + layout.layers}
    if layout.biases and not cfg.bias:
        p.update({k: v for k, v in _zero_biases(cfg, set(p)).items() if k in taken})
    out = {t.hf: t.op.to_hf(p[t.zerolm], cfg) for t in layout.globals if t.zerolm in p}
    out.update(layout.fixed(cfg))
    for t in (t for t in layout.layers if t.zerolm in p):
        out.update({t.hf.format(i=i): t.op.to_hf(p[t.zerolm][i], cfg) for i in range(cfg.n_layer)})
    unmapped = set(p) - taken
    if unmapped:  # a parameter the table does not know would be silently lost
        raise ValueError(f"{layout.architecture}'s table has no place for {sorted(unmapped)}")
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def zerolm_params(tensors: dict[str, np.ndarray], cfg: ResolvedModelConfig, layout: Layout) -> dict:
    """transformers' tensors (by name) as zerolm's parameter tree for `cfg` (hf_state_dict's inverse): each
    parameter read through its table entries' inverses, parts stacked in order, float32; the vocabulary's
    padding rows zeros. ExportError names a tensor that is missing or of another size, or one no parameter
    takes (so that no weight is dropped silently)."""
    model = gpt_model.GPT(auto.for_shapes(cfg))
    shapes = {k: s.shape for k, s in flatten(jax.eval_shape(functools.partial(gpt_model.init_params, model),
                                                              jax.random.key(0))).items()}
    entries = [(t, False) for t in layout.globals] + [(t, True) for t in layout.layers]
    used: set[str] = set()

    def read(t: Tensor, layered: bool, shape: tuple[int, ...]) -> np.ndarray:
        names = [t.hf.format(i=i) for i in range(cfg.n_layer)] if layered else [t.hf]
        out = []
        for name in names:
            if name not in tensors:
                raise ExportError(f"{layout.architecture}: no tensor {name} (zerolm's {t.zerolm})")
            try:
                out.append(t.op.from_hf(np.asarray(tensors[name], np.float32), shape, cfg))
            except ValueError:
                raise ExportError(f"{layout.architecture}: {name} is {tuple(tensors[name].shape)}, which does not "
                                  f"give zerolm's {t.zerolm} of {shape} for this config") from None
            used.add(name)
        return np.stack(out) if layered else out[0]

    params = {}
    for name, shape in shapes.items():
        mine = sorted([(t, layered) for t, layered in entries if t.zerolm == name], key=lambda e: e[0].op.part or 0)
        if not mine:
            raise ExportError(f"{layout.architecture}'s table has no tensor for zerolm's {name}")
        inner = shape[1:] if mine[0][1] else shape
        if mine[0][0].op.part is None:
            params[name] = read(*mine[0], inner)
        else:  # parts stacked along axis 1 of the (unstacked) parameter
            parts = [read(t, layered, inner[:1] + inner[2:]) for t, layered in mine]
            params[name] = np.stack(parts, axis=2 if mine[0][1] else 1)
    used |= _fixed_read(tensors, cfg, layout)
    if unused := sorted(set(tensors) - used - set(_buffers(tensors))):
        raise ExportError(f"{layout.architecture}: tensor {unused[0]} has no place in zerolm's model of this config "
                          f"({len(unused)} such)")
    return unflatten(params)


def _fixed_read(tensors: dict[str, np.ndarray], cfg: ResolvedModelConfig, layout: Layout) -> set[str]:
    """The layout's `fixed` tensors among `tensors`, each the value zerolm's model computes with (ExportError
    naming one that is not: GPT-J's output layer with a bias zerolm's does not have)."""
    found = set()
    for name, value in layout.fixed(cfg).items():
        if name in tensors:
            if not np.array_equal(np.asarray(tensors[name], np.float32), value):
                raise ExportError(f"{layout.architecture}: {name} is not all {value.flat[0]:g}, and zerolm's model has no "
                                  "such parameter")
            found.add(name)
    return found


def _buffers(tensors) -> list[str]:
    """Buffers older transformers versions saved beside the weights (GPT-2's causal masks, rotary frequencies)."""
    return [n for n in tensors if n.endswith((".attn.bias", ".attn.masked_bias", ".attention.bias",
                                              ".attention.masked_bias", "rotary_emb.inv_freq"))]


def unflatten(flat: dict) -> dict:
    """`flatten`'s inverse."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _zero_biases(cfg: ResolvedModelConfig, present: set[str]) -> dict[str, np.ndarray]:
    """Zeros for each parameter the same model with biases has beyond `present` (what a bias-free layer adds)."""
    biased = gpt_model.GPT(auto.for_shapes(cfg.model_copy(update={"bias": True})))
    shapes = jax.eval_shape(functools.partial(gpt_model.init_params, biased), jax.random.key(0))
    return {k: np.zeros(s.shape, np.float32) for k, s in flatten(shapes).items() if k not in present}


def flatten(tree, prefix: str = "") -> dict:
    """A nested dict's leaves by path, dots between levels."""
    flat = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            flat.update(flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat
