"""The collectives of zerolm's step as the planner counts them: what `zerolm comms` and `zerolm compile` put
beside what the compiler really emitted (zerolm.compile.collectives)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from zerolm.parallel.mesh import DP, SLICE, TP, axis_names, axis_share


class TPReductions(NamedTuple):
    """The activations (B, T, d_model) that tensor parallelism all-reduces per block and micro-step in training."""

    forward: int
    rerun: int  # of the forward pass's, those full remat runs again: the ones whose result the backward pass reads
    backward: int

    def per_layer(self, full_remat: bool) -> int:
        return self.forward + (self.rerun if full_remat else 0) + self.backward


def tp_all_reduces(parallel_residual: bool, shared_norm: bool, residual_dropout: bool) -> TPReductions:
    """The sequential block's: its two row-parallel outputs forward, of which full remat reruns the attention's (the
    MLP reads it; the MLP's output only joins the residual), and its two norms' input gradients backward
    (Megatron's 2 + 2). The parallel residual's: one forward (the branches summed before the reduction; two with
    residual dropout, each branch's output dropped with its own mask after its own reduction), none rerun (its
    output only joins the residual), and backward one with a shared norm (one input projection), two with a norm
    each (each norm's input gradient)."""
    if not parallel_residual:
        return TPReductions(2, 1, 2)
    return TPReductions(2 if residual_dropout else 1, 0, 1 if shared_norm else 2)


@dataclasses.dataclass
class Prediction:
    """One predicted row: a kind of collective of one program, its bytes per device (summed over the HLO
    instructions) and per optimizer step; `found_*` are what the compiled step showed (zerolm.compile.collectives)."""

    program: str  # grad | update | step (the naive baseline)
    op: str  # all-reduce, reduce-scatter, all-gather, collective-permute
    span: list[str] | None  # what one replica group spans (`dp`, or a share `dp(8/32)`); None: over dp, whatever else
    in_loop: bool
    bytes: int
    bytes_per_step: int
    at_least: bool = False  # a lower bound (the naive step's per-micro-step reduction)
    # An upper bound, met to this fraction: ZeRO-3's layer gathers, where the backward pass may not read a
    # leaf again (a block's last bias: XLA drops its second gather).
    within: float = 0.0

    found_bytes: int | None = None
    found_bytes_per_step: int | None = None

    @property
    def axes(self) -> list[str] | None:
        """The mesh axes of `span` (whole axes, or the axis of a share)."""
        return None if self.span is None else list(axis_names(self.span))

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "axes": self.axes}


@dataclasses.dataclass(frozen=True)
class CountedStep:
    """What the planner counts a step's collectives by, beside its sharding table (`predicted_collectives`)."""

    grad_reduce: str  # all_reduce | reduce_scatter
    accum: int  # accumulation steps (micro-batches per device and step)
    activation: int = 0  # bytes of one micro-batch's activations (B × T × d_model): what tp all-reduces
    n_layer: int = 0
    # Activations a layer all-reduces over tp per micro-step (`tp_all_reduces`): the sequential
    # block's 2 forward and 2 backward (Megatron's), 5 with full remat; fewer for the parallel residual's.
    tp_per_layer: int = 4
    param_bytes: int = 4  # the parameters' dtype: 4, or 2 in mixed precision
    scatter: str = "collective"  # how a reduce-scatter runs: collective | two_stage | ring (zerolm.parallel.scatter)
    inner: int | None = None  # two_stage's inner group


def predicted_collectives(table, step: CountedStep) -> list[Prediction]:
    """zerolm's step on `table`'s mesh (a zerolm.parallel.sharding.Table) as the planner counts it. `span` None:
    over dp, whichever other axes the partitioner adds (it splits the update's all-gathers between dp and
    dp+tp freely).

    grad: the one reduction after the loop, in the parameters' dtype (`step.param_bytes`: 4, or 2 in mixed
    precision): a reduce-scatter into the optimizer layout (1/dp of each device's gradient block), or,
    with `step.scatter` "two_stage", one over dp // inner positions of dp (span `dp(outer/dp)`), giving
    `inner` such blocks, then one over `inner` (`dp(inner/dp)`; one row when the two are of a size);
    with "ring", dp − 1 collective-permutes of such a block; or an all-reduce of the whole block;
    and the loss's 4-byte all-reduce; with tp, Megatron's all-reduces of the `activation` bytes of a
    micro-batch, `step.tp_per_layer` per layer (the sequential block's 2 forward and 2 backward, and with full
    remat the attention's forward one again; the parallel residual's 1 + 1 with a shared norm), every micro-step.
    update: the all-gather of the new parameters out of the optimizer layout. On one device, none of these.

    At ZeRO stage 2 (`table.stage`) it reduce-scatters `table.in_loop` (the stacked layers' leaves its layout
    splits, keeping the layers axis whole) inside the loop, a layer at a time (per instruction: one
    layer's; per step: n_layer of them every micro-step), and the other leaves after it, as stage 1. Stage 3
    also all-gathers those layers' leaves inside the loop, twice per micro-step (for the forward pass, and
    again for the backward pass: remat runs each layer again; XLA drops the second gather of a leaf the
    backward pass does not read, hence `within`), the other leaves it stores split once, before the loop;
    and the update gathers only the leaves stored whole over dp.

    With several slices (`table.slices`) all of that stays inside a slice; across the slices, at every stage, one
    all-reduce of each device's gradient block (its share of the optimizer layout; with grad_reduce all_reduce
    the whole gradient) and the loss's 4 bytes, once per step after the loop (over `slice` alone)."""
    dp, tp, accum, activation = table.dp, table.tp, step.accum, step.activation
    t = _tally(table, step.grad_reduce, accum, step.param_bytes)
    # Over one device, nothing to reduce.
    rows = [] if dp * table.slices == 1 else _reductions(t, step.grad_reduce, step.scatter, dp, step.inner)
    if table.slices > 1:  # then across the slices, once: the block (all_reduce: the whole gradient) and the loss
        rows = [p for p in rows if dp > 1]
        across = (t.shard if step.grad_reduce == "reduce_scatter" else t.grads) + 4
        rows.append(Prediction("grad", "all-reduce", [SLICE], False, across, across))
    over = None if tp > 1 else [DP]
    if t.layer_gathers[0]:  # stage 3's layers: a layer's per instruction, twice per micro-step each
        once, per_step = t.layer_gathers
        rows.append(Prediction("grad", "all-gather", over, True, once, per_step, within=0.01))
    if t.top:
        rows.append(Prediction("grad", "all-gather", over, False, t.top, t.top))
    if tp > 1 and activation:
        per_layer = step.tp_per_layer
        rows.append(Prediction("grad", "all-reduce", [TP], True, per_layer * activation,
                               per_layer * activation * accum * step.n_layer))
    if dp * tp > 1 and t.gathered:
        rows.append(Prediction("update", "all-gather", over, False, t.gathered, t.gathered))
    return rows


@dataclasses.dataclass
class _Tally:
    """The step's bytes per device by where they move; pairs are (per HLO instruction, per step)."""

    grads: int = 0  # the whole gradient (all_reduce's)
    after: list[int] = dataclasses.field(default_factory=lambda: [0, 0])  # reduce-scattered after the loop
    in_loop: list[int] = dataclasses.field(default_factory=lambda: [0, 0])  # stages 2, 3: the layers', a layer at a time
    layer_gathers: list[int] = dataclasses.field(default_factory=lambda: [0, 0])  # stage 3: the layers' all-gathers
    top: int = 0  # stage 3: the other leaves stored split, gathered before the loop
    gathered: int = 0  # the update's all-gather: the leaves stored whole over dp
    shard: int = 0  # each device's block of the whole gradient: what slices all-reduce across the data-center network


def _tally(table, grad_reduce: str, accum: int, param_bytes: int) -> _Tally:
    import jax

    from zerolm.parallel.sharding import is_layout

    tp_local, _, _ = table.reduction(grad_reduce)
    dp, tp = table.dp, table.tp
    t = _Tally()
    leaves = zip(jax.tree.leaves(table.layouts, is_leaf=is_layout), jax.tree.leaves(tp_local),
                 jax.tree.leaves(table.dp_split), jax.tree.leaves(table.in_loop), strict=True)
    for lay, local, split_dp, layers in leaves:
        split = tp if lay.tp_axis is not None else 1
        whole = (math.prod(lay.view_shape) if lay.axis is None else lay.size // split) * param_bytes
        block = math.prod(lay.view_shape) * param_bytes // dp // (tp if local else 1)
        t.grads += lay.size * param_bytes // split
        t.shard += block
        if layers:
            t.in_loop[0] += block // lay.shape[0]
            t.in_loop[1] += block * accum
        else:
            t.after[0] += block
            t.after[1] += block
        if split_dp and layers:  # dp_split: stage 3's
            t.layer_gathers[0] += 2 * whole // lay.shape[0]
            t.layer_gathers[1] += 2 * whole * accum
        elif split_dp:
            t.top += whole
        else:
            t.gathered += whole
    return t


def _reductions(t: _Tally, grad_reduce: str, scatter: str, dp: int, inner: int | None) -> list[Prediction]:
    """The gradient's reduction over dp (and the loss's 4 bytes), as `scatter` runs it."""
    def rows(op, span, times=1) -> list[Prediction]:
        return [Prediction("grad", op, span, loop, once * times, step * times)
                for (once, step), loop in ((t.after, False), (t.in_loop, True)) if once]

    loss = Prediction("grad", "all-reduce", [DP], False, 4, 4)
    if grad_reduce == "all_reduce":
        return [Prediction("grad", "all-reduce", [DP], False, t.grads + 4, t.grads + 4)]
    if scatter == "ring":
        return rows("collective-permute", [DP], dp - 1) + [loss]
    if scatter != "two_stage":
        return rows("reduce-scatter", [DP]) + [loss]
    assert inner is not None
    labels: dict[str, int] = {}  # by the HLO's label; stages of one size (outer = inner) share a row
    for n, times in ((dp // inner, inner), (inner, 1)):
        if n > 1:
            label = axis_share(DP, n, dp)
            labels[label] = labels.get(label, 0) + times
    return [p for label, times in labels.items() for p in rows("reduce-scatter", [label], times)] + [loss]


def step_predictions(cfg, model, zero) -> list[Prediction]:
    """`predicted_collectives` of the step zerolm.parallel.build.build_step made of `cfg` (`model`'s dtype is the one
    resolved for the mesh's devices)."""
    import jax.numpy as jnp


    m = cfg.model
    activation = cfg.train.micro_batch_size * m.seq_len * m.d_model * jnp.dtype(model.cfg.dtype).itemsize
    tp_per_layer = tp_all_reduces(m.parallel_residual, m.shared_norm, bool(m.residual_dropout)).per_layer(
        m.remat == "full")
    counted = CountedStep(cfg.zero.grad_reduce, cfg.accum_steps, activation, m.n_layer, tp_per_layer,
                          param_bytes=zero.param_dtype.itemsize, scatter=zero.scatter, inner=zero.scatter_inner)
    return predicted_collectives(zero.table, counted)


def naive_predictions(abstract_params, accum: int) -> list[Prediction]:
    """The naive single jit (zerolm.parallel.naive_step): XLA all-reduces every micro-step's gradient inside the
    accumulation loop: at least the gradient's bytes per micro-step (XLA may reduce a leaf's parts
    separately, e.g. the tied embedding's input and output gradients)."""
    import jax

    grads = sum(a.size * 4 for a in jax.tree.leaves(abstract_params))
    return [Prediction("step", "all-reduce", [DP], True, grads, grads * accum, at_least=True)]
