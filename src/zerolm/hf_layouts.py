"""The transformers layouts a zerolm model converts to: per layout, one table from zerolm's parameter paths
to transformers' tensor names, each entry with the change of form between them (and its inverse, so that
an import reads the same table backwards).

- **GPT-2** (`GPT2LMHeadModel`): learned positions (`wpe`), biases, the tanh GELU (`gelu_new`). zerolm's
  names are GPT-2's already; `c_attn`'s (d, 3, d) kernel is GPT-2's Conv1D (d, 3·d). A bias-free model
  goes here too, with zero biases (what a missing bias computes).
- **MPT** (`MptForCausalLM`): ALiBi, no biases at all (transformers' MPT builds every LayerNorm and
  Linear without one, whatever `no_bias` says), the exact GELU. Its Linears store (out, in), so each
  kernel is transposed. Its ALiBi slopes (`build_mpt_alibi_tensor`) are `zerolm.attention.alibi_slopes`
  for every head count: for n heads, P = 2^⌈log2 n⌉ and slope_h = 2^(-8(h+1)/P); MPT keeps the odd-indexed
  ones (2^(-8(k+1)/(P/2)): Press's P/2-head sequence) then the even-indexed (every other slope of Press's
  P-head sequence), the first n, which is Press's rule. Its bias slope·(j − (length−1)) differs from
  zerolm's slope·(j − i) by a constant per query, which softmax ignores.

Both tie the output layer to `wte` and drop the vocabulary's padding rows. Which layout a model takes
is `layout_for(cfg)`: by `model.position`; a model the layout cannot hold exactly is refused in one line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from zerolm import model as gpt_model
from zerolm.config import ModelConfig
from zerolm.data.tokenizer import Tokenizer
from zerolm.errors import ZerolmError
from zerolm.model import LN_EPS


class ExportError(ZerolmError):
    """A model the transformers layout for its settings cannot hold exactly; the message names the setting."""


class Op(NamedTuple):
    """One tensor's change of form: `to_hf(x, cfg)` gives transformers' tensor, `from_hf(y, shape)` zerolm's
    (of that shape) back."""

    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
    from_hf: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]


AS_IS = Op(lambda x, cfg: x, lambda y, shape: y.reshape(shape))
# The embedding without the vocabulary's padding rows (zeros again on the way back).
VOCAB = Op(lambda x, cfg: x[:cfg.vocab_size], lambda y, shape: np.pad(y, ((0, shape[0] - y.shape[0]), (0, 0))))
# c_attn's (d, 3, d) kernel, or (3, d) bias, with q, k and v side by side: GPT-2's Conv1D (d, 3·d), (3·d,).
QKV = Op(lambda x, cfg: x.reshape(*x.shape[:-2], -1), lambda y, shape: y.reshape(shape))
# A flax kernel (in, out) as a torch Linear's weight (out, in).
LINEAR = Op(lambda x, cfg: x.T, lambda y, shape: y.T.reshape(shape))
# c_attn's kernel as one Linear (3·d, d): q's d outputs, then k's, then v's (what MPT's `chunk(3)` splits).
QKV_LINEAR = Op(lambda x, cfg: x.reshape(x.shape[0], -1).T, lambda y, shape: y.T.reshape(shape))


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
    globals: tuple[Tensor, ...]  # the parameters outside the blocks
    layers: tuple[Tensor, ...]  # each block's, stacked along zerolm's leading layer axis
    config: Callable[[ModelConfig, Tokenizer], dict]  # its config.json


def _gpt2_config(cfg: ModelConfig, tokenizer: Tokenizer) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": LN_EPS, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": True,
            "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "dtype": "float32"}


def _mpt_config(cfg: ModelConfig, tokenizer: Tokenizer) -> dict:
    return {"architectures": ["MptForCausalLM"], "model_type": "mpt", "vocab_size": cfg.vocab_size,
            "d_model": cfg.d_model, "n_heads": cfg.n_head, "n_layers": cfg.n_layer, "expansion_ratio": 4,
            "max_seq_len": cfg.seq_len, "no_bias": True, "learned_pos_emb": False, "layer_norm_epsilon": LN_EPS,
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

LAYOUTS = {"learned": GPT2, "alibi": MPT}  # model.position -> the layout


def layout_for(cfg: ModelConfig) -> Layout:
    """The layout a model exports to; ExportError for a model it cannot hold exactly."""
    layout = LAYOUTS[cfg.position]
    why = f"a model with model.position: {cfg.position} exports to transformers' {layout.architecture}"
    if cfg.activation != layout.activation:
        raise ExportError(f"model.activation: {cfg.activation}: {why}, whose MLP is {layout.gelu}; "
                          f"train with model.activation: {layout.activation}")
    if cfg.bias and not layout.biases:
        raise ExportError(f"model.bias: true: {why}, which has no biases; train with model.bias: false")
    return layout


def hf_state_dict(params, cfg: ModelConfig, layout: Layout) -> dict[str, np.ndarray]:
    """zerolm's parameter tree as the layout's float32 tensors (numpy, contiguous). `cfg`: the model's,
    resolved for a device (as `GPT` takes it)."""
    p = {k: np.asarray(v) for k, v in flatten(params).items()}
    if layout.biases and not cfg.bias:
        p.update(_zero_biases(cfg, set(p)))
    out = {t.hf: t.op.to_hf(p[t.zerolm], cfg) for t in layout.globals}
    for t in layout.layers:
        out.update({t.hf.format(i=i): t.op.to_hf(p[t.zerolm][i], cfg) for i in range(cfg.n_layer)})
    unmapped = set(p) - {t.zerolm for t in layout.globals + layout.layers}
    if unmapped:  # a parameter the table does not know would be silently lost
        raise ValueError(f"{layout.architecture}'s table has no place for {sorted(unmapped)}")
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


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
