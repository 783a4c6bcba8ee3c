"""The `model:` section of the config: the decoder's shape and the settings that change its layout
(zerolm.model builds it), with the checks between them that fail at load."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from zerolm.config_section import KeyProblem as _KeyError
from zerolm.config_section import PositiveInt
from zerolm.config_section import Section as _Section


def tp_split_problem(n_head: int, d_model: int, tp: int) -> str | None:
    """Why tensor parallelism over `tp` devices cannot split this model (it splits whole attention heads and
    the MLP's 4·d_model hidden units), or None."""
    if n_head % tp:
        return f"does not divide model.n_head={n_head} (tensor parallelism splits whole attention heads)"
    if (4 * d_model) % tp:
        return f"does not divide the MLP width 4 × model.d_model = {4 * d_model}"
    return None


class ModelConfig(_Section):
    vocab_size: int | Literal["auto"]  # "auto": the tokenizer's vocabulary size
    n_layer: int = PositiveInt
    d_model: int = PositiveInt
    n_head: int = PositiveInt
    seq_len: int = PositiveInt
    dtype: Literal["auto", "float32", "bfloat16", "float16"]  # compute dtype; params: zero.precision
    attention: Literal["auto", "xla", "cudnn", "pallas", "blockwise"]  # see zerolm.attention
    attention_block: int = PositiveInt  # positions per query/key block of the blockwise and Pallas attentions
    # What the backward pass recomputes instead of storing (see model.REMAT_POLICIES).
    remat: Literal["none", "full", "dots", "attention", "dots_attention", "auto"]  # auto: zerolm.step.REMAT_ORDER
    # The layer loop: a scan over the stacked layers (compile time flat in depth) or unrolled (no stacked
    # activations for the backward pass); auto: the device's choice (zerolm.device_policy.resolve_auto).
    scan_layers: bool | Literal["auto"]
    loss_chunk: int = Field(ge=0)  # tokens per chunk of the output layer + loss; 0: the whole micro-batch at once
    # Attention stays inside each document of a packed sample (documents end with end-of-text, token eot_id);
    # positions count from each document's start ("restart") or from the sample's ("continue").
    document_mask: bool
    document_positions: Literal["continue", "restart"]
    eot_id: int | Literal["auto"]  # auto: the dataset tokenizer's end-of-text
    # Positions: a learned table added to the embeddings (GPT-2), or ALiBi's per-head linear biases on the
    # attention scores (Press et al. 2022; no table, so a model evaluates past its trained seq_len).
    position: Literal["learned", "alibi"]
    bias: bool  # false: LayerNorms and linear layers without bias (the seed model's layout)
    activation: Literal["gelu_tanh", "gelu"]  # the MLP's: GPT-2's tanh approximation, or the exact erf GELU (MPT's)
    # Dropout in training (zerolm.dropout: masks from the seed, step, sample and layer): after the embeddings,
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
        if self.document_positions == "restart" and not self.document_mask:
            raise _KeyError("model.document_positions", "restart counts positions from each document's start, "
                            "which needs model.document_mask: true (without it a sample is one sequence)",
                            related=("model.document_mask",))
        if self.attention in ("pallas", "cudnn") and self.attention_dropout:
            raise _KeyError("model.attention", f"{self.attention}'s fused kernel draws no dropout mask zerolm can "
                            "make the same on every device; use xla or blockwise, or auto, which picks one",
                            related=("model.attention_dropout",))
        if self.attention == "pallas" and self.position == "alibi":
            raise _KeyError("model.attention", "pallas's TPU flash attention takes a bias only as a dense "
                            "(batch, heads, T, T) array per example, which ALiBi would have to build; use blockwise "
                            "(ALiBi computed inside its blocks) or auto, which picks it", related=("model.position",))
        if self.attention == "pallas":
            from zerolm.attention import PALLAS_LANES, block_size, pallas_fits

            if not pallas_fits(self.seq_len, self.attention_block):
                raise _KeyError("model.attention", f"pallas cuts the sequence into blocks of a multiple of "
                                f"{PALLAS_LANES} positions; seq_len {self.seq_len} and attention_block "
                                f"{self.attention_block} give {block_size(self.seq_len, self.attention_block)}",
                                related=("model.seq_len", "model.attention_block"))
        return self

    @property
    def eot(self) -> int:
        """model.eot_id, resolved (ValueError while it is still 'auto')."""
        if self.eot_id == "auto":
            raise ValueError("model.eot_id is still 'auto': resolve it with the tokenizer first")
        return self.eot_id

    @property
    def vocab(self) -> int:
        """model.vocab_size, resolved (ValueError while it is still 'auto')."""
        if self.vocab_size == "auto":
            raise ValueError("model.vocab_size is still 'auto': resolve it with the tokenizer first")
        return self.vocab_size

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to a multiple of 128, for aligned matmuls; padded logits are masked."""
        return 128 * math.ceil(self.vocab / 128)
