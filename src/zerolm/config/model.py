"""The `model:` section of the config: the decoder's shape and the settings that change its layout
(zerolm.model.decoder builds it), with the checks between them that fail at load."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from zerolm.config.section import PositiveInt, _KeyError
from zerolm.config.section import Section as _Section


def tp_split_problem(n_head: int, mlp_width: int, tp: int, n_kv_head: int | None = None) -> str | None:
    """Why tensor parallelism over `tp` devices cannot split this model (it splits whole attention heads,
    query and key/value alike, and the MLP's hidden units), or None."""
    if n_head % tp:
        return f"does not divide model.n_head={n_head} (tensor parallelism splits whole attention heads)"
    if n_kv_head is not None and n_kv_head % tp:
        return (f"does not divide model.n_kv_head={n_kv_head} (tensor parallelism splits whole key/value heads, "
                "each with its group of query heads)")
    if mlp_width % tp:
        return f"does not divide the MLP width {mlp_width} (model.mlp_hidden)"
    return None


def mlp_width(mlp: str, d_model: int, mlp_hidden: int | str) -> int:
    """The MLP's hidden units: model.mlp_hidden, or for auto 4·d_model (gelu) or Llama's 8/3·d_model rounded up
    to a multiple of 256 (swiglu)."""
    if mlp_hidden != "auto":
        return int(mlp_hidden)
    return 4 * d_model if mlp == "gelu" else 256 * math.ceil(8 * d_model / 3 / 256)


def resolved_shape(model: dict[str, Any]) -> dict[str, Any]:
    """A model section (a checkpoint's record, or a config's) as its parameter shapes see it: the `auto`s that
    decide them resolved (model.n_kv_head, model.mlp_hidden), so that `auto` and the number it means compare
    equal; and seq_len None where no parameter has its length (ALiBi and rotary positions: only the learned
    position table has seq_len rows)."""
    out = dict(model)
    if out.get("n_kv_head", "auto") == "auto":
        out["n_kv_head"] = out.get("n_head")
    out["mlp_hidden"] = mlp_width(out.get("mlp", "gelu"), out["d_model"], out.get("mlp_hidden", "auto"))
    if out.get("position", "learned") != "learned":
        out["seq_len"] = None
    return out


class ModelConfig(_Section):
    vocab_size: int | Literal["auto"]  # "auto": the tokenizer's vocabulary size
    n_layer: int = PositiveInt
    d_model: int = PositiveInt
    n_head: int = PositiveInt
    seq_len: int = PositiveInt
    dtype: Literal["auto", "float32", "bfloat16", "float16"]  # compute dtype; params: zero.precision
    attention: Literal["auto", "xla", "cudnn", "pallas", "blockwise"]  # see zerolm.model.attention
    attention_block: int = PositiveInt  # positions per query/key block of the blockwise and Pallas attentions
    # What the backward pass recomputes instead of storing (see model.REMAT_POLICIES).
    remat: Literal["none", "full", "dots", "attention", "dots_attention", "auto"]  # auto: zerolm.parallel.auto.REMAT_ORDER
    # The layer loop: a scan over the stacked layers (compile time flat in depth) or unrolled (no stacked
    # activations for the backward pass); auto: the device's choice (zerolm.parallel.auto.scan_layers).
    scan_layers: bool | Literal["auto"]
    loss_chunk: int = Field(ge=0)  # tokens per chunk of the output layer + loss; 0: the whole micro-batch at once
    # Attention stays inside each document of a packed sample (documents end with end-of-text, token eot_id);
    # positions count from each document's start ("restart") or from the sample's ("continue").
    document_mask: bool
    document_positions: Literal["continue", "restart"]
    eot_id: int | Literal["auto"]  # auto: the dataset tokenizer's end-of-text
    # Positions: a learned table added to the embeddings (GPT-2), or ALiBi's per-head linear biases on the
    # attention scores (Press et al. 2022; no table, so a model evaluates past its trained seq_len).
    # Or rotary embeddings of the queries and keys (Su et al. 2021; Llama's, rotate-half), base rope_theta.
    position: Literal["learned", "alibi", "rope"]
    rope_theta: float = Field(gt=0)
    bias: bool  # false: LayerNorms and linear layers without bias (the seed model's layout)
    norm: Literal["layernorm", "rmsnorm"]  # every norm of the model: GPT-2's LayerNorm, or Llama's RMSNorm
    norm_eps: float = Field(gt=0)
    # The MLP: up, GELU, down (GPT-2's; model.activation says which GELU), or Llama's SwiGLU
    # (down(silu(gate x) · up x)); mlp_hidden its hidden units, auto: 4·d_model for gelu, Llama's
    # 8/3·d_model rounded up to a multiple of 256 for swiglu.
    mlp: Literal["gelu", "swiglu"]
    mlp_hidden: int | Literal["auto"]
    activation: Literal["gelu_tanh", "gelu"]  # the MLP's: GPT-2's tanh approximation, or the exact erf GELU (MPT's)
    n_kv_head: int | Literal["auto"]  # key/value heads, each shared by n_head / n_kv_head query heads; auto: n_head
    tie_embeddings: bool  # the output layer is the token embedding (GPT-2), or a matrix of its own (lm_head)
    # The block: attention then MLP, each adding to the residual in turn (GPT-2), or both reading the block's input
    # and adding to the residual together (GPT-J, GPT-NeoX, PaLM: with tensor parallelism, one all-reduce instead
    # of two); shared_norm: both read one LayerNorm's output (GPT-J's ln_1), not one each (GPT-NeoX's).
    parallel_residual: bool
    shared_norm: bool
    # Dropout in training (zerolm.model.dropout: masks from the seed, step, sample and layer): after the embeddings,
    # on each residual branch's output, and on the attention's probabilities.
    embedding_dropout: float = Field(ge=0, lt=1)
    residual_dropout: float = Field(ge=0, lt=1)
    attention_dropout: float = Field(ge=0, lt=1)

    @field_validator("remat", mode="before")
    @classmethod
    def _remat_bool(cls, value: Any) -> Any:
        return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_kv_head != "auto" and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise _KeyError("model.n_kv_head", f"{self.n_kv_head} does not divide model.n_head={self.n_head} "
                            "(each key/value head serves a whole group of query heads)", related=("model.n_head",))
        if self.mlp_hidden != "auto" and self.mlp_hidden < 1:
            raise _KeyError("model.mlp_hidden", f"{self.mlp_hidden}: the MLP needs at least one hidden unit")
        if self.position == "rope" and (self.d_model // self.n_head) % 2:
            raise _KeyError("model.position", f"rope rotates pairs of a head's dimensions, and d_model / n_head = "
                            f"{self.d_model // self.n_head} is odd", related=("model.d_model", "model.n_head"))
        if self.document_positions == "restart" and not self.document_mask:
            raise _KeyError("model.document_positions", "restart counts positions from each document's start, "
                            "which needs model.document_mask: true (without it a sample is one sequence)",
                            related=("model.document_mask",))
        if self.shared_norm and not self.parallel_residual:
            raise _KeyError("model.shared_norm", "true shares one norm between the attention and the MLP, which "
                            "read the same input only with model.parallel_residual: true",
                            related=("model.parallel_residual",))
        if self.attention in ("pallas", "cudnn") and self.attention_dropout:
            raise _KeyError("model.attention", f"{self.attention}'s fused kernel draws no dropout mask zerolm can "
                            "make the same on every device; use xla or blockwise, or auto, which picks one",
                            related=("model.attention_dropout",))
        if self.attention == "pallas" and self.position == "alibi":
            raise _KeyError("model.attention", "pallas's TPU flash attention takes a bias only as a dense "
                            "(batch, heads, T, T) array per example, which ALiBi would have to build; use blockwise "
                            "(ALiBi computed inside its blocks) or auto, which picks it", related=("model.position",))
        return self  # (whether Pallas's blocks fit the sequence: zerolm.parallel.auto.unrunnable_attention)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to a multiple of 128, for aligned matmuls; padded logits are masked (ValueError while
        it is still 'auto')."""
        if self.vocab_size == "auto":
            raise ValueError("model.vocab_size is still 'auto': the data's tokenizer resolves it first")
        return 128 * math.ceil(self.vocab_size / 128)


class ResolvedModelConfig(ModelConfig):
    """A `model:` section with its `auto`s made concrete for where the model runs (zerolm.parallel.auto.model_settings):
    what the model (zerolm.model.decoder.GPT) takes. The end-of-text id may stay auto where nothing reads it (no
    document mask)."""

    vocab_size: int
    n_kv_head: int
    mlp_hidden: int
    dtype: Literal["float32", "bfloat16", "float16"]
    attention: Literal["xla", "cudnn", "pallas", "blockwise"]
    remat: Literal["none", "full", "dots", "attention", "dots_attention"]
    scan_layers: bool
