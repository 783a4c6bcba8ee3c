"""ZeRO stages 1-3: the shard_map gradient step, the reshard and the update (their shardings: zerolm.parallel.sharding).

One optimizer step is three compiled programs, whatever the stage (`zero.stage`):

1. `grad`: one jit of `jax.shard_map`s, manual over `dp` (tensor parallelism over `tp` is left to the
   compiler inside; without tp, manual over the whole mesh), that scan over each device's micro-batches.
   - Stage 1 accumulates float32 gradients locally and ends in the ONE cross-device reduction over dp,
     a second map manual over dp and tp in which each device reduces only its own tp block: a `pmean`
     (all_reduce) or a reduce-scatter straight into the optimizer-state layout (reduce_scatter, half the
     bytes), run as zerolm.parallel.scatter picks for the mesh.
   - Stage 2 reduce-scatters each layer's gradient where the backward pass makes it, every micro-step, into
     a dp-sharded float32 accumulator in the optimizer-state layout: no device holds a whole gradient of
     the layers, for one reduction per micro-step instead of one per step.
   - Stage 3 also stores the parameters in that layout: each layer all-gathers its own parameters where
     the model reads them, inside the layers' loop and its remat (`GPT.layer_params`), so the forward and
     the backward pass each gather them again and nothing holds a whole model; the gather's transpose
     reduce-scatters that layer's gradient as soon as the backward pass makes it.
   At stages 2 and 3 the leaves outside the layers (the embeddings, the last LayerNorm) reduce as at stage
   1, once after the loop (and stage 3 gathers them once per step, before it).
   The tp collectives of the forward and backward passes run inside the loop, over tp only. Stages 2 and
   3's grad program is zerolm.parallel.sharded_grad's.
2. `reshard`: an identity `jax.jit` that moves the parameters into the optimizer-state layout. Each
   device keeps its own slice, so it compiles to no collective (but for a small gather of each
   blockified tp-split leaf; `zerolm comms` shows them).
3. `update`: a jitted optax update on the sharded view; the optimizer state stays sharded (and is
   donated) and the new parameters come back in their own sharding: whole over dp at stages 1 and 2 (the
   step's all-gather), in the layout at stage 3 (no gather: the next forward pass gathers).

With several slices (`mesh.slices`, a (slice, dp, tp) mesh) all of this runs inside each slice, over its dp; the
batch's rows are split over slice and dp, and the one reduction becomes the reduce-scatter inside the slice
followed by an all-reduce of each device's block across the slices, over the data-center network (1/dp of the
gradient, once a step at every stage: zerolm.parallel.sharded_grad.across_slices). The update then runs alike
on every slice, on the same reduced gradient, and gathers the parameters inside each slice.

Each device holds 1/(dp·tp) of the optimizer state, plus padding (zerolm.parallel.sharding.Layout). In mixed
precision (`precision="mixed"`) the parameters are bfloat16, the float32 master weights sit in the
optimizer state (zerolm.parallel.optim.MasterWeights), the reductions and the all-gathers run in bfloat16, and the
update needs no reshard of the parameters: the master weights are its view. docs/design.md tells why.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zerolm.parallel import auto, sharded_grad, sharding
from zerolm.parallel import scatter as scatter_lib
from zerolm.parallel.auto import Scatter
from zerolm.parallel.mesh import DP, SLICE, TP
from zerolm.parallel.optim import MasterWeights, ema_of, with_master_weights
from zerolm.parallel.sharded_grad import Axes, GradSettings, LossFn, across_slices, dropout_keys, sum_over_micro_batches, vary
from zerolm.parallel.sharding import from_views, is_layout, to_views

if TYPE_CHECKING:
    from zerolm.config.tree import ZeroConfig

PyTree = Any
GradReduce = Literal["all_reduce", "reduce_scatter"]
Precision = Literal["fp32", "mixed"]
Stage = Literal[1, 2, 3]


@flax.struct.dataclass
class TrainState:
    step: Any  # int32 scalar: optimizer steps taken (an abstract one, or a sharding, in restore targets)
    params: PyTree  # the working parameters (float32; bfloat16 in mixed precision), split over tp by the
    # rule table, and replicated over dp (stages 1, 2) or split over it in the optimizer-state layout (3)
    opt_state: PyTree  # split over dp and tp, in the Layout views (with the float32 master weights in mixed)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The step's inputs, for a run's shapes: abstract arrays with their shardings."""

    params: PyTree  # the working parameters
    batch: jax.ShapeDtypeStruct  # (accum_steps, dp · micro_batch, seq_len + 1) tokens
    views: PyTree  # the gradient (and, in fp32, the parameters) in the optimizer-state layout
    opt_state: PyTree
    step: jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class Programs:
    """The step's three programs: jitted (`Zero.programs`), or compiled ahead of time for a run's shapes
    (zerolm.parallel.build.compile_step; a program the step does not run, or the compiler refused, is None)."""

    grad: Any  # (params, batch) -> (gradient, in the optimizer-state layout or the params' sharding; metrics)
    reshard: Any  # params or gradient -> their view in the optimizer-state layout
    update: Any  # (gradient view, params view, opt_state, step, old params) -> (params, opt_state, step, metrics)

    NAMES = ("grad", "reshard", "update")

    def items(self) -> list[tuple[str, Any]]:
        """(name, program) of the programs present, in the order a step runs them."""
        return [(name, program) for name in self.NAMES if (program := getattr(self, name)) is not None]


@dataclasses.dataclass(frozen=True)
class Objective:
    """What the step optimises: the model's loss, its parameters' shapes (float32), their logical axes (for the
    rule table's tensor parallelism; None: every leaf replicated over tp) and the seed of its dropout masks
    (None: no dropout)."""

    loss_fn: LossFn
    abstract_params: PyTree
    logical_axes: PyTree | None = None
    dropout_seed: int | None = None


class Zero:
    """The ZeRO training step (stage 1, 2 or 3) for one mesh, objective, optimizer and accumulation count.

    `step(state, batch) -> (state, metrics)` is a pure function of its inputs; `batch` is the global
    array of shape (accum_steps, dp * micro_batch, seq_len + 1) sharded by `table.batch_sharding`;
    `table` (zerolm.parallel.sharding.Table) holds every sharding the step uses.

    `settings` is the config's `zero:` section (zerolm.config.tree.ZeroConfig):
    `stage`: 1 splits the optimizer state over dp and reduces the gradient once per step; 2 also keeps
    the gradient split (a reduce-scatter per micro-step); 3 also the parameters (each layer gathered where
    it is used). Stages 2 and 3 reduce with reduce-scatters only (`grad_reduce` must be reduce_scatter).
    `precision`: "fp32" keeps float32 parameters and reduces and gathers in float32. "mixed" is the ZeRO
    paper's layout: the working parameters are bfloat16 (2 bytes per parameter), the float32 master weights
    live in the dp-sharded optimizer state (zerolm.parallel.optim.with_master_weights), and the gradient is reduced
    and the parameters all-gathered in bfloat16 (half the bytes of each).
    `accumulate_dtype`: the dtype of each device's gradient accumulator over its micro-batches.
    `scatter` (reduce_scatter): "collective" (`lax.psum_scatter`), "two_stage" or "ring", the ways
    zerolm.parallel.scatter knows; "auto" is zerolm.parallel.auto.scatter's choice for the mesh (`self.scatter`
    holds the choice).
    `lr_schedule`: the optimizer's schedule, whose value each step's metrics report; `rules`: the logical-axis
    rule table (zerolm.parallel.sharding.RULES).
    """

    def __init__(self, mesh: Mesh, objective: Objective, tx: optax.GradientTransformation, settings: ZeroConfig, *,
                 lr_schedule: optax.Schedule | None = None, rules=sharding.RULES):
        stage, grad_reduce, precision = settings.stage, settings.grad_reduce, settings.precision
        if stage > 1 and grad_reduce != "reduce_scatter":
            raise ValueError(f"ZeRO-{stage} reduces with reduce-scatters: grad_reduce must be reduce_scatter")
        self.mesh = mesh
        self.stage: Stage = stage
        self.grad_reduce: GradReduce = grad_reduce
        self.precision: Precision = precision
        self.param_dtype = jnp.dtype(jnp.bfloat16 if precision == "mixed" else jnp.float32)
        self.tx = tx = with_master_weights(tx) if precision == "mixed" else tx
        self.abstract_params = abstract_params = objective.abstract_params  # float32: the model's (and the master weights')
        self.working_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, self.param_dtype), abstract_params)
        self.table = table = sharding.Table(mesh, abstract_params, objective.logical_axes, tx, rules, stage)  # every sharding
        self.state_shardings = TrainState(step=table.replicated, params=table.param_shardings,
                                          opt_state=table.opt_shardings)
        self.scatter = auto.scatter(settings.scatter, mesh)  # "collective", "two_stage" or "ring"
        self.scatter_inner = scatter_lib.two_stage_inner(mesh) if self.scatter == "two_stage" else None
        # Manual over dp; without tensor parallelism over the whole mesh: nothing is left for the partitioner
        # inside, where JAX cannot run a custom partitioner (cuDNN's attention has one) under a partly manual map.
        manual = frozenset(mesh.axis_names) if table.tp == 1 else frozenset({DP}) | ({SLICE} & set(mesh.axis_names))
        self.dropout = objective.dropout_seed is not None
        how = GradSettings(jnp.dtype(settings.accumulate_dtype), self.param_dtype, objective.dropout_seed, table.data)
        if stage == 1:
            grad_step = self._stage1(objective.loss_fn, how, manual)
        else:  # zerolm.parallel.sharded_grad: each layer's gradient reduce-scattered inside the layers' loop
            reduce_scatter = scatter_lib.reduce_scatter(self.scatter, table.dp, self.scatter_inner)
            grad_step = sharded_grad.grad_program(table, objective.loss_fn, how, reduce_scatter, manual)

        # What a step runs; zerolm.parallel.build.compile_step gives them compiled for a run's shapes (`using`).
        self.programs = Programs(
            grad=jax.jit(grad_step),
            reshard=jax.jit(functools.partial(to_views, table.layouts), out_shardings=table.view_shardings),
            update=jax.jit(functools.partial(_update, how=_UpdateSettings(tx, table.layouts, lr_schedule)),
                           out_shardings=(table.param_shardings, table.opt_shardings, table.replicated,
                                          table.replicated),
                           # The optimizer state, and the old parameters: the new ones take their buffers (kept,
                           # though unread, so that the compiled program aliases them).
                           donate_argnums=(2, 4), keep_unused=True))

    def _stage1(self, loss_fn: LossFn, how: GradSettings, manual: frozenset) -> Callable:
        """(params, batch[, step]) -> (gradient, metrics): accumulate locally, then the one reduction over dp
        (`step`: the state's, which dropout's keys are drawn with)."""
        table, mesh = self.table, self.mesh
        # (1) accumulate: per-device gradients come out stacked on a leading axis over the data ranks.
        stacked = jax.tree.map(lambda _: P(table.data), table.param_specs, is_leaf=lambda x: isinstance(x, P))
        accumulate = jax.shard_map(functools.partial(_accumulate, loss_fn=loss_fn, how=how), mesh=mesh,
                                   in_specs=(P(), table.batch_sharding.spec, P()), out_specs=(stacked, P(table.data)),
                                   axis_names=manual)
        # (2) reduce: manual over the whole mesh, each device reducing its own tp block (sharding.Table.reduction).
        tp_local, in_specs, out_specs = table.reduction(self.grad_reduce)
        reduction = _Reduction(table.layouts, tp_local, self.grad_reduce, table.dp, table.tp, self.scatter,
                               self.scatter_inner, table.slices, table.data)
        reduce = jax.shard_map(functools.partial(_reduce, how=reduction), mesh=mesh,
                               in_specs=(in_specs, P(table.data)), out_specs=(out_specs, P()))

        def grad_step(params, batch, step=None):  # the name its compiled programs (and the compilation cache) carry
            return reduce(*accumulate(params, batch, jnp.zeros((), jnp.int32) if step is None else step))

        return grad_step

    @property
    def mixed(self) -> bool:
        return self.precision == "mixed"

    def inputs(self, micro_batch: int, seq_len: int, accum_steps: int) -> StepInputs:
        """The step's inputs for a run's shapes, as abstract arrays with their shardings."""
        table = self.table
        return StepInputs(
            params=sharding.with_shardings(self.working_params, table.param_shardings),
            batch=jax.ShapeDtypeStruct((accum_steps, table.slices * table.dp * micro_batch, seq_len + 1), jnp.int32,
                                       sharding=table.batch_sharding),
            views=sharding.with_shardings(sharding.abstract_views(table.layouts, self.working_params),
                                          table.view_shardings),
            opt_state=sharding.with_shardings(jax.eval_shape(self.tx.init, sharding.abstract_views(
                table.layouts, self.abstract_params)), table.opt_shardings),
            step=jax.ShapeDtypeStruct((), jnp.int32, sharding=table.replicated))

    def program_inputs(self, micro_batch: int, seq_len: int, accum_steps: int) -> dict[str, tuple]:
        """Each program a step runs, by name, with its abstract inputs for a run's shapes (to compile ahead
        of time: zerolm.parallel.build.compile_step). `reshard` is there when the step runs it: on the parameters (fp32:
        the update reads their view) and on an all-reduced gradient; mixed precision with reduce_scatter needs
        neither."""
        x = self.inputs(micro_batch, seq_len, accum_steps)
        inputs: dict[str, tuple] = {"grad": (x.params, x.batch, *((x.step,) if self.dropout else ()))}
        if not self.mixed or self.grad_reduce == "all_reduce":
            inputs["reshard"] = (x.params,)
        inputs["update"] = (x.views, None if self.mixed else x.views, x.opt_state, x.step, x.params)
        return inputs

    def using(self, programs: Programs) -> Zero:
        """This step running `programs` (compiled ahead of time for the run's shapes) instead of the jitted
        ones: each program is compiled once, not once ahead of time and again at its first call."""
        twin = copy.copy(self)
        twin.programs = programs
        return twin

    def init(self, init_fn: Callable[[jax.Array], PyTree], rng: jax.Array) -> TrainState:
        """Create the state already sharded: the optimizer state never exists in one piece."""
        return self._state_of(jax.jit(init_fn, out_shardings=self.table.param_shardings)(rng))

    def init_from_params(self, params: PyTree) -> TrainState:
        """The state of float32 `params` (in mixed precision they become the master weights). The state holds
        its own copy: the step donates the state's parameters, and the caller's stay readable."""
        # (jax.device_put with may_alias=False still shares a buffer already on its device: jax 0.10.2.)
        return self._state_of(jax.jit(lambda p: jax.tree.map(jnp.copy, p),
                                      out_shardings=self.table.param_shardings)(params))

    def _state_of(self, params: PyTree) -> TrainState:
        """The state whose parameters are `params` (float32, in the parameters' shardings; the state owns them)."""
        table = self.table
        opt_state = jax.jit(lambda p: self.tx.init(to_views(table.layouts, p)),
                            out_shardings=table.opt_shardings)(params)
        if self.mixed:
            params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(self.param_dtype), p),
                             out_shardings=table.param_shardings)(params)
        return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), table.replicated),
                          params=params, opt_state=opt_state)

    def ema_params(self, state: TrainState) -> PyTree | None:
        """The moving average of the parameters that the optimizer keeps (train.ema; None without one) as working
        parameters: in their dtype and shardings, gathered out of the optimizer-state layout (a copy, as large as
        `state.params`, for as long as the caller holds it)."""
        ema = ema_of(state.opt_state)
        return None if ema is None else self._as_params(ema)

    @functools.cached_property
    def _as_params(self) -> Callable[[PyTree], PyTree]:
        """Float32 views in the optimizer-state layout -> working parameters in their shardings."""
        layouts, dtype = self.table.layouts, self.param_dtype
        return jax.jit(lambda views: jax.tree.map(lambda x: x.astype(dtype), from_views(layouts, views)),
                       out_shardings=self.table.param_shardings)

    def step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        run = self.programs
        grads, metrics = run.grad(state.params, batch, *((state.step,) if self.dropout else ()))
        params_view = None if self.mixed else run.reshard(state.params)
        if self.grad_reduce == "all_reduce":
            grads = run.reshard(grads)
        params, opt_state, step, update_metrics = run.update(grads, params_view, state.opt_state, state.step,
                                                             state.params)
        return TrainState(step=step, params=params, opt_state=opt_state), {**metrics, **update_metrics}

    __call__ = step


def _accumulate(params, batch_AxMxT1, step, *, loss_fn: LossFn, how: GradSettings):
    """Per device: the mean gradient over its micro-batches, summed in `how.acc_dtype` and handed to the
    reduction in `how.out_dtype` (the parameters' dtype), with no cross-device reduction."""
    acc_dtype, out_dtype = how.acc_dtype, how.out_dtype
    # Without the cast, the gradient of a replicated (unvarying) input picks up an implicit psum
    # on every micro-step, and the result comes out dp times too large.
    varying = functools.partial(vary, axes=how.data)
    params = jax.tree.map(varying, params)
    zeros = jax.tree.map(lambda p: varying(jnp.zeros(p.shape, acc_dtype)), params)
    grads, loss = sum_over_micro_batches(loss_fn, params, zeros, batch_AxMxT1,
                                         dropout_keys(how.dropout_seed, step, batch_AxMxT1, how.data), how.data)
    accum = batch_AxMxT1.shape[0]
    return jax.tree.map(lambda g: (g / accum).astype(out_dtype)[None], grads), (loss / accum)[None]


@dataclasses.dataclass(frozen=True)
class _Reduction:
    """How stage 1's one reduction over dp runs (`_reduce`)."""

    layouts: PyTree  # each leaf's optimizer-state layout (zerolm.parallel.sharding.Layout)
    tp_local: PyTree  # each leaf: whether a device reduces only its own tp block of it (sharding.Table.reduction)
    grad_reduce: GradReduce
    dp: int
    tp: int
    scatter: Scatter  # how a reduce-scatter runs: one `psum_scatter`, two over dp sub-groups, or a ring
    inner: int | None  # two_stage's inner group (zerolm.parallel.scatter.two_stage_inner), else None
    slices: int = 1
    data: Axes = DP  # the batch rows' axes: dp, or (slice, dp)


def _reduce(grads, loss, *, how: _Reduction):
    """The one reduction over dp, on each device's own tp block: pmean, or a reduce-scatter into the layout
    (`how.scatter`: one `psum_scatter`, two over dp sub-groups, or dp − 1 neighbour exchanges). With several
    slices, inside each: the reduce-scatter's block (all_reduce: the whole gradient) is then averaged across the
    slices (`across_slices`), and the loss with it."""
    dp, tp = how.dp, how.tp
    grads = jax.tree.map(lambda g: g[0], grads)
    loss = across_slices(lax.pmean(loss[0], DP), how.slices)  # as the gradient goes: inside a slice, then across
    if how.grad_reduce == "all_reduce":
        return across_slices(lax.pmean(grads, DP), how.slices), {"loss": loss}
    reduce_scatter = scatter_lib.reduce_scatter(how.scatter, dp, how.inner)

    def scatter_leaf(lay, local, g):
        view = across_slices(reduce_scatter(lay.to_view(g), lay.scatter_dim) / dp, how.slices)
        if local or tp == 1:
            return view
        # Whole over tp here (tp-replicated or blockified): keep this tp device's share of the dp block.
        n = view.shape[lay.scatter_dim] // tp
        return lax.dynamic_slice_in_dim(view, lax.axis_index(TP) * n, n, axis=lay.scatter_dim)

    return jax.tree.map(scatter_leaf, how.layouts, how.tp_local, grads, is_leaf=is_layout), {"loss": loss}


@dataclasses.dataclass(frozen=True)
class _UpdateSettings:
    """What the update program is built with: the optimizer, each leaf's layout, the schedule it reports."""

    tx: optax.GradientTransformation
    layouts: PyTree  # each leaf's optimizer-state layout (zerolm.parallel.sharding.Layout)
    lr_schedule: optax.Schedule | None


def _update(grads_view, params_view, opt_state, step, old_params, *, how: _UpdateSettings):
    """The optax update on the optimizer-state layout. `params_view` is None in mixed precision: the
    master weights in `opt_state` are what is updated, and the new working parameters are them cast down.
    `old_params` are only donated: the new parameters are written into their buffers, so the step never
    holds two copies of the parameters (in mixed precision, nothing else reads them)."""
    del old_params
    tx, layouts, lr_schedule = how.tx, how.layouts, how.lr_schedule
    # Over the whole, sharded gradient, in float32 whatever it was reduced in.
    metrics = {"grad_norm": optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads_view))}
    if lr_schedule is not None:
        metrics["lr"] = lr_schedule(step)
    updates, opt_state = tx.update(grads_view, opt_state, params_view)
    skipped = optax.tree_utils.tree_get(opt_state, "total_notfinite")  # set under optax.apply_if_finite
    if skipped is not None:
        metrics["skipped_updates"] = skipped
        metrics["skipped_in_a_row"] = optax.tree_utils.tree_get(opt_state, "notfinite_count")
    if isinstance(opt_state, MasterWeights):
        new_view = jax.tree.map(lambda m, g: m.astype(g.dtype), opt_state.master, grads_view)
    else:
        new_view = optax.apply_updates(params_view, updates)
    return from_views(layouts, new_view), opt_state, step + 1, metrics
