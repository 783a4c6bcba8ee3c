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

GPT-2 and MPT tie the output layer to `wte`. Every layout drops the vocabulary's padding rows. Which layout
a model takes is `layout_for(cfg)`: by `model.position`; a model the layout cannot hold exactly is refused in
one line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from zerolm.config.tree import ModelConfig
from zerolm.core.errors import ZerolmError
from zerolm.data.tokenizer import Tokenizer
from zerolm.model import decoder as gpt_model


class ExportError(ZerolmError):
    """A model the transformers layout for its settings cannot hold exactly; the message names the setting."""


class Op(NamedTuple):
    """One tensor's change of form: `to_hf(x, cfg)` gives transformers' tensor, `from_hf(y, shape)` zerolm's
    (of that shape) back. `part`: transformers' tensor is part `part` of zerolm's axis 1 (zerolm's tensor is
    its parts stacked there, in order; `shape` is then a part's)."""

    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
    from_hf: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]
    part: int | None = None


AS_IS = Op(lambda x, cfg: x, lambda y, shape: y.reshape(shape))
# The embedding without the vocabulary's padding rows (zeros again on the way back).
VOCAB = Op(lambda x, cfg: x[:cfg.vocab_size], lambda y, shape: np.pad(y, ((0, shape[0] - y.shape[0]), (0, 0))))
# c_attn's (d, 3, d) kernel, or (3, d) bias, with q, k and v side by side: GPT-2's Conv1D (d, 3·d), (3·d,).
QKV = Op(lambda x, cfg: x.reshape(*x.shape[:-2], -1), lambda y, shape: y.reshape(shape))
# A flax kernel (in, out) as a torch Linear's weight (out, in).
LINEAR = Op(lambda x, cfg: x.T, lambda y, shape: y.T.reshape(shape))
# c_attn's kernel as one Linear (3·d, d): q's d outputs, then k's, then v's (what MPT's `chunk(3)` splits).
QKV_LINEAR = Op(lambda x, cfg: x.reshape(x.shape[0], -1).T, lambda y, shape: y.T.reshape(shape))



def _linear_part(i: int) -> Op:
    """Part i of a stacked kernel (d, parts, n) as a torch Linear's weight (n, d): q, k or v of `c_attn`, k or v
    of `c_kv`."""
    return Op(lambda x, cfg: x[:, i].T, lambda y, shape: y.T.reshape(shape), part=i)


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
    config: Callable[[ModelConfig, Tokenizer], dict]  # its config.json
    # The other model settings it holds: model.<key> -> (the value it needs, how transformers' class computes).
    requires: tuple[tuple[str, object, str], ...] = (
        ("norm", "layernorm", "LayerNorms"), ("mlp", "gelu", "a GELU MLP"),
        ("tie_embeddings", True, "its output layer tied to the token embedding"),
        ("n_kv_head", "auto", "as many key/value heads as query heads"))


def _gpt2_config(cfg: ModelConfig, tokenizer: Tokenizer) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": True,
            "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "dtype": "float32"}


def _mpt_config(cfg: ModelConfig, tokenizer: Tokenizer) -> dict:
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



def _llama_config(cfg: ModelConfig, tokenizer: Tokenizer) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_width, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
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
    requires=(("norm", "rmsnorm", "RMSNorms"), ("mlp", "swiglu", "a SwiGLU MLP")))

LAYOUTS = {"learned": GPT2, "alibi": MPT, "rope": LLAMA}  # model.position -> the layout


def layout_for(cfg: ModelConfig) -> Layout:
    """The layout a model exports to; ExportError for a model it cannot hold exactly."""
    layout = LAYOUTS[cfg.position]
    why = f"a model with model.position: {cfg.position} exports to transformers' {layout.architecture}"
    if layout.activation != "any" and cfg.activation != layout.activation:
        raise ExportError(f"model.activation: {cfg.activation}: {why}, whose MLP is {layout.gelu}; "
                          f"train with model.activation: {layout.activation}")
    if cfg.bias and not layout.biases:
        raise ExportError(f"model.bias: true: {why}, which has no biases; train with model.bias: false")
    for key, value, what in layout.requires:
        have = ("auto" if cfg.kv_heads == cfg.n_head else cfg.n_kv_head) if key == "n_kv_head" else getattr(cfg, key)
        if have != value:
            raise ExportError(f"model.{key}: {getattr(cfg, key)}: {why}, which has {what}; train with "
                              f"model.{key}: {value}")
    return layout


def hf_state_dict(params, cfg: ModelConfig, layout: Layout) -> dict[str, np.ndarray]:
    """zerolm's parameter tree as the layout's float32 tensors (numpy, contiguous). `cfg`: the model's,
    resolved for a device (as `GPT` takes it)."""
    p = {k: np.asarray(v) for k, v in flatten(params).items()}
    if layout.biases and not cfg.bias:
        p.update(_zero_biases(cfg, set(p)))
    out = {t.hf: t.op.to_hf(p[t.zerolm], cfg) for t in layout.globals if t.zerolm in p}
    for t in (t for t in layout.layers if t.zerolm in p):
        out.update({t.hf.format(i=i): t.op.to_hf(p[t.zerolm][i], cfg) for i in range(cfg.n_layer)})
    unmapped = set(p) - {t.zerolm for t in layout.globals + layout.layers}
    if unmapped:  # a parameter the table does not know would be silently lost
        raise ValueError(f"{layout.architecture}'s table has no place for {sorted(unmapped)}")
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def zerolm_params(tensors: dict[str, np.ndarray], cfg: ModelConfig, layout: Layout) -> dict:
    """transformers' tensors (by name) as zerolm's parameter tree for `cfg` (hf_state_dict's inverse): each
    parameter read through its table entries' inverses, parts stacked in order, float32; the vocabulary's
    padding rows zeros. ExportError names a tensor that is missing or of another size, or one no parameter
    takes (so that no weight is dropped silently)."""
    model = gpt_model.GPT(cfg.model_copy(update={"dtype": "float32", "attention": "xla", "scan_layers": True}))
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
                out.append(t.op.from_hf(np.asarray(tensors[name], np.float32), shape))
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
    if unused := sorted(set(tensors) - used - set(_buffers(tensors))):
        raise ExportError(f"{layout.architecture}: tensor {unused[0]} has no place in zerolm's model of this config "
                          f"({len(unused)} such)")
    return unflatten(params)


def _buffers(tensors) -> list[str]:
    """Buffers older transformers versions saved beside the weights (GPT-2's causal masks, rotary frequencies)."""
    return [n for n in tensors if n.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))]


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


def _zero_biases(cfg: ModelConfig, present: set[str]) -> dict[str, np.ndarray]:
    """Zeros for each parameter the same model with biases has beyond `present` (what a bias-free layer adds)."""
    biased = gpt_model.GPT(cfg.model_copy(update={"bias": True}))
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
