"""The collectives of zerolm's step as the planner counts them: what `zerolm comms` and `zerolm compile` put
beside what the compiler really emitted (zerolm.comms)."""

from __future__ import annotations

import dataclasses
import math

from zerolm import hlo
from zerolm.mesh import DP, TP


@dataclasses.dataclass
class Prediction:
    """One predicted row: a kind of collective of one program, its bytes per device (summed over the HLO
    instructions) and per optimizer step; `found_*` are what the compiled step showed (zerolm.comms)."""

    program: str  # grad | update | step (the naive baseline)
    op: str  # all-reduce, reduce-scatter, all-gather, collective-permute
    span: list[str] | None  # what one replica group spans (`dp`, or a share `dp(8/32)`); None: over dp, whatever else
    in_loop: bool
    bytes: int
    bytes_per_step: int
    at_least: bool = False  # a lower bound (the naive step's per-micro-step reduction)
    found_bytes: int | None = None
    found_bytes_per_step: int | None = None

    @property
    def axes(self) -> list[str] | None:
        """The mesh axes of `span` (whole axes, or the axis of a share)."""
        return None if self.span is None else list(hlo.axis_names(self.span))

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "axes": self.axes}


def predicted_collectives(table, grad_reduce: str, accum: int, activation: int = 0, n_layer: int = 0,
                          remat: bool = False, param_bytes: int = 4, scatter: str = "collective",
                          inner: int | None = None) -> list[Prediction]:
    """zerolm's step on `table`'s mesh (a zerolm.sharding.Table) as the planner counts it. `span` None:
    over dp, whichever other axes the partitioner adds (it splits the update's all-gathers between dp and
    dp+tp freely).

    grad: the one reduction after the loop, in the parameters' dtype (`param_bytes`: 4, or 2 in mixed
    precision): a reduce-scatter into the optimizer layout (1/dp of each device's gradient block), or,
    with `scatter` "two_stage", one over dp // inner positions of dp (span `dp(outer/dp)`), giving
    `inner` such blocks, then one over `inner` (`dp(inner/dp)`; one row when the two are of a size);
    with "ring", dp − 1 collective-permutes of such a block; or an all-reduce of the whole block;
    and the loss's 4-byte all-reduce; with tp, Megatron's all-reduces of the `activation` bytes of a
    micro-batch, 2 forward and 2 backward per layer (3 forward with full remat), every micro-step.
    update: the all-gather of the new parameters out of the optimizer layout. On one device, none of these."""
    import jax

    from zerolm.sharding import is_layout

    tp_local, _, _ = table.reduction(grad_reduce)
    dp, tp = table.dp, table.tp
    grads = scattered = gathered = 0
    for lay, local in zip(jax.tree.leaves(table.layouts, is_leaf=is_layout), jax.tree.leaves(tp_local), strict=True):
        split = tp if lay.tp_axis is not None else 1
        grads += lay.size * param_bytes // split
        scattered += math.prod(lay.view_shape) * param_bytes // dp // (tp if local else 1)
        gathered += (math.prod(lay.view_shape) if lay.axis is None else lay.size // split) * param_bytes

    def row(program, op, span, nbytes, in_loop=False, runs=1) -> Prediction:
        return Prediction(program, op, span, in_loop, nbytes, nbytes * runs)

    if dp == 1:  # nothing to reduce over dp, nor to gather
        rows = []
    elif grad_reduce == "all_reduce":
        rows = [row("grad", "all-reduce", [DP], grads + 4)]
    elif scatter == "ring":
        rows = [row("grad", "collective-permute", [DP], scattered * (dp - 1)), row("grad", "all-reduce", [DP], 4)]
    elif scatter == "two_stage":
        assert inner is not None
        stages: dict[str, int] = {}  # by the HLO's label; stages of one size (outer = inner) share a row
        for n, nbytes in ((dp // inner, scattered * inner), (inner, scattered)):
            if n > 1:
                label = hlo.axis_share(DP, n, dp)
                stages[label] = stages.get(label, 0) + nbytes
        rows = [row("grad", "reduce-scatter", [label], nbytes) for label, nbytes in stages.items()]
        rows.append(row("grad", "all-reduce", [DP], 4))
    else:
        rows = [row("grad", "reduce-scatter", [DP], scattered), row("grad", "all-reduce", [DP], 4)]
    if tp > 1 and activation:
        per_layer = 6 if remat else 4
        rows.append(row("grad", "all-reduce", [TP], per_layer * activation, True, accum * n_layer))
    if dp * tp > 1:
        rows.append(row("update", "all-gather", None if tp > 1 else [DP], gathered))
    return rows


def step_predictions(cfg, model, zero) -> list[Prediction]:
    """`predicted_collectives` of the step zerolm.step.build_step made of `cfg` (`model`'s dtype is the one
    resolved for the mesh's devices)."""
    import jax.numpy as jnp

    activation = (cfg.train.micro_batch_size * cfg.model.seq_len * cfg.model.d_model
                  * jnp.dtype(model.cfg.dtype).itemsize)
    return predicted_collectives(zero.table, cfg.zero.grad_reduce, cfg.accum_steps, activation, cfg.model.n_layer,
                                 cfg.model.remat == "full", param_bytes=zero.param_dtype.itemsize,
                                 scatter=zero.scatter, inner=zero.scatter_inner)


def naive_predictions(abstract_params, accum: int) -> list[Prediction]:
    """The naive single jit (zerolm.naive): XLA all-reduces every micro-step's gradient inside the
    accumulation loop: at least the gradient's bytes per micro-step (XLA may reduce a leaf's parts
    separately, e.g. the tied embedding's input and output gradients)."""
    import jax

    grads = sum(a.size * 4 for a in jax.tree.leaves(abstract_params))
    return [Prediction("step", "all-reduce", [DP], True, grads, grads * accum, at_least=True)]
