"""What a plan is about: the model (its size and shape), how it is parallelised, and the bytes per
parameter of each kind of model state."""

from __future__ import annotations

import dataclasses

from zerolm.core.errors import ZerolmError

STAGES = (0, 1, 2, 3)


class PlanError(ZerolmError):
    """A bad plan request; the message is the one line a user sees."""


@dataclasses.dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of each model state (the ZeRO paper's accounting)."""

    param: int  # of the params the step computes with
    grad: int  # of the gradients (zerolm: its accumulator)
    master: int  # of an fp32 master copy kept with the optimizer (mixed precision)
    moments: int  # of Adam's m and v


PRECISIONS = {"mixed": BytesPerParam(2, 2, 4, 8), "fp32": BytesPerParam(4, 4, 0, 8)}


@dataclasses.dataclass(frozen=True)
class Model:
    """What the planner needs of a model: its size and shape."""

    params: int  # N, all parameters
    tp_split: int  # of which tensor parallelism splits (the blocks' matrices and their biases)
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab: int  # padded
    act_bytes: int = 2  # bytes per compute-dtype element
    loss_chunk: int = 2048
    remat: str = "none"
    source: str = ""
    param_bytes: int = 4  # of the working parameters (zero.precision: fp32 4, mixed 2)
    acc_bytes: int = 4  # of the gradient accumulator (zero.accumulate_dtype)
    attention: str = "auto"  # model.attention (auto: the device's choice, zerolm.parallel.auto.attention)
    dtype: str = "auto"  # model.dtype
    position: str = "learned"  # model.position (ALiBi keeps Pallas's attention away)
    attention_dropout: float = 0.0  # model.attention_dropout (keeps the fused attentions away)
    attention_block: int = 512  # model.attention_block
    document_mask: bool = False  # model.document_mask: segment ids beside each layer's attention
    # model.scan_layers (auto: the device's and the stage's choice, zerolm.parallel.auto.scan_layers)
    scan_layers: bool | str = "auto"

    # The layer's layout where it is not GPT-2's (a config's model; zerolm.plan.build.from_config):
    kv_heads: int = 0  # model.n_kv_head; 0: n_head
    mlp_width: int = 0  # the MLP's hidden units; 0: 4·d_model
    gated_mlp: bool = False  # model.mlp: swiglu (a gate beside the up projection)
    # model.parallel_residual, model.shared_norm, and whether model.residual_dropout is on: how many all-reduces
    # tensor parallelism makes per layer (zerolm.plan.traffic.tp_all_reduces)
    parallel_residual: bool = False
    shared_norm: bool = False
    residual_dropout: bool = False
    # zerolm.model.flops's N (zerolm.model.decoder.count_params(matmul_only)); 0: params less a position table
    matmul_params: int = 0

    @property
    def flops_params(self) -> int:
        """N without the position embedding (zerolm.observe.mfu's convention), nor an untied token embedding."""
        return self.matmul_params or self.params - self.seq_len * self.d_model

    @property
    def layer_outputs_ratio(self) -> float:
        """What a layer's matmuls write per token (q, k, v, the attention's output, the MLP's hidden units and
        their activation: 12·d_model in GPT-2's layout, which the activation constants were measured on), over
        GPT-2's: the planner scales what a layer keeps by it."""
        h, head = self.d_model, self.d_model // self.n_head
        kv, f = (self.kv_heads or self.n_head) * head, self.mlp_width or 4 * h
        return (h + 2 * kv + h + (3 if self.gated_mlp else 2) * f) / (12 * h)

    @property
    def layer_weights_ratio(self) -> float:
        """A layer's weight matrices over GPT-2's 12·d_model²."""
        h, head = self.d_model, self.d_model // self.n_head
        kv, f = (self.kv_heads or self.n_head) * head, self.mlp_width or 4 * h
        return (h * (h + 2 * kv) + h * h + (3 if self.gated_mlp else 2) * h * f) / (12 * h * h)


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How a plan spreads the model: slices × dp × tp devices (dp × tp inside each slice, the ZeRO split over dp),
    and the sequences of one optimizer step."""

    dp: int
    tp: int
    global_batch: int  # sequences per optimizer step
    slices: int = 1  # mesh.slices: TPU slices joined by the data-center network, data parallel across them

    @property
    def devices(self) -> int:
        return self.slices * self.dp * self.tp

    @property
    def per_rank(self) -> int:
        return self.global_batch // (self.slices * self.dp)
