"""ZeRO-1: the shard_map gradient step, the reshard and the update (their shardings: zerolm.sharding).

One optimizer step is three compiled programs (seed note 003, on today's JAX):

1. `grad`: one jit of two `jax.shard_map`s. The first, manual over `dp` alone (tensor parallelism
   over `tp` is left to the compiler inside it), scans over each device's micro-batches, accumulating
   float32 gradients locally; the tp collectives of the forward and backward passes run inside this
   loop, over tp only. The second, manual over dp and tp, is the ONE cross-device reduction over dp,
   each device reducing only its own tp block: a `pmean` (all_reduce) or a `psum_scatter` straight
   into the optimizer-state layout (reduce_scatter, half the bytes). Where the TPU compiler makes a
   `psum_scatter` over the whole dp axis an all-reduce of the whole (v2/v3; v4/v5e/v5p slices beyond
   one host), the same sum runs as two `psum_scatter`s over dp sub-groups, which it keeps as
   reduce-scatters (`two_stage_reduce_scatter`; or by choice as dp − 1 `ppermute`s,
   `ring_reduce_scatter`; `resolve_scatter`).
2. `reshard`: an identity `jax.jit` that moves the parameters into the optimizer-state layout. Each
   device keeps its own slice, so it compiles to no collective (but for a small gather of each
   blockified tp-split leaf; `zerolm comms` shows them).
3. `update`: a jitted optax update on the sharded view; the optimizer state stays sharded (and is
   donated) and the new parameters come back in their own (tp) sharding: the step's all-gather.

Each device holds 1/(dp·tp) of the optimizer state, plus padding (zerolm.sharding.Layout). In mixed
precision (`precision="mixed"`) the parameters are bfloat16, the float32 master weights sit in the
optimizer state (`MasterWeights`), the reduction and the all-gather run in bfloat16, and the update
needs no reshard of the parameters: the master weights are its view.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerolm import sharding
from zerolm.hardware import tpu_generation
from zerolm.mesh import DP, TP
from zerolm.sharding import from_views, is_layout, to_views

PyTree = Any
GradReduce = Literal["all_reduce", "reduce_scatter"]
Precision = Literal["fp32", "mixed"]
Scatter = Literal["auto", "collective", "ring", "two_stage"]
LossFn = Callable[[PyTree, jax.Array], jax.Array]  # (params, tokens_BxT1) -> scalar loss


def resolve_scatter(scatter: Scatter, mesh: Mesh) -> Scatter:
    """How `reduce_scatter` runs on `mesh`; auto follows what the TPU compiler makes of a psum_scatter over
    the whole dp axis (docs/performance-notes.md): an all-reduce of the whole on v2/v3, and on v4 and
    later once the slice is beyond one host (more than 4 chips; 8 of the "lite" kinds, v5e/v6e). There it
    takes two stages (`two_stage_reduce_scatter`), which the compiler keeps as reduce-scatters; the ring
    where dp is prime on v2/v3. The collective everywhere else (CPU, GPU, one v4+ host)."""
    if scatter != "auto":
        return scatter
    kind = mesh.devices.flat[0].device_kind
    generation = tpu_generation(kind)
    if generation is None:
        return "collective"
    old = generation in (2, 3)
    if not old and mesh.devices.size <= (8 if "lite" in kind.lower() else 4):
        return "collective"
    if two_stage_inner(mesh) > 1:
        return "two_stage"
    return "ring" if old else "collective"


def _dp_per_host(mesh: Mesh) -> int:
    """The dp positions the first device's host holds."""
    axis, host = mesh.axis_names.index(DP), mesh.devices.flat[0].process_index
    return len({c[axis] for c, d in np.ndenumerate(mesh.devices) if d.process_index == host})


def two_stage_inner(mesh: Mesh) -> int:
    """The second stage's group size for `two_stage_reduce_scatter` on `mesh`'s dp axis: as many dp
    positions as one host holds (the first device's host: 4 on multi-host v4/v5e/v5p slices, 8 on v3-32,
    where it is measured to compile to reduce-scatters, docs/performance-notes.md), where that is a proper divisor of
    dp; else dp's largest proper divisor. 1 when dp is prime (one stage). The positions need not be one
    host's: the mesh orders devices along the torus, not by host."""
    dp, per_host = mesh.shape[DP], _dp_per_host(mesh)
    if 1 < per_host < dp and dp % per_host == 0:
        return per_host
    smallest_factor = next((f for f in range(2, dp) if dp % f == 0), dp)
    return dp // smallest_factor


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: PyTree  # the working parameters (float32; bfloat16 in mixed precision), replicated over dp,
    # split over tp by the rule table
    opt_state: PyTree  # split over dp and tp, in the Layout views (with the float32 master weights in mixed)


class MasterWeights(NamedTuple):
    """The optimizer state of ZeRO's mixed precision: float32 master weights beside the inner optimizer's
    state, both in the optimizer-state layout (so each device holds 1/(dp·tp) of them)."""

    master: PyTree
    inner: optax.OptState


def with_master_weights(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` stepping float32 master weights kept in its state (ZeRO's stage-1 mixed-precision layout).

    `init` takes the float32 parameters (they become the master weights). `update` casts the gradient to
    float32, runs `tx` against the master weights (weight decay reads them, not the bfloat16 copy) and
    applies the updates to them; the working parameters are the new master weights cast down (by
    `Zero1.update`). The `params` argument is not read."""
    def init(params):
        return MasterWeights(params, tx.init(params))

    def update(grads, state, params=None):
        del params
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, inner = tx.update(grads, state.inner, state.master)
        return updates, MasterWeights(optax.apply_updates(state.master, updates), inner)

    return optax.GradientTransformation(init, update)


class Zero1:
    """The ZeRO-1 training step for one mesh, model loss, optimizer and accumulation count.

    `step(state, batch) -> (state, metrics)` is a pure function of its inputs; `batch` is the global
    array of shape (accum_steps, dp * micro_batch, seq_len + 1) sharded by `batch_sharding`.

    `precision`: "fp32" keeps float32 parameters and reduces and gathers in float32. "mixed" is the ZeRO
    paper's stage-1 layout: the working parameters are bfloat16 (replicated, 2 bytes per parameter), the
    float32 master weights live in the dp-sharded optimizer state (`with_master_weights`), and the
    gradient is reduced and the new parameters all-gathered in bfloat16 (half the bytes of each).
    `accumulate_dtype`: the dtype of each device's gradient accumulator over its micro-batches.
    `scatter` (reduce_scatter): "collective" is `lax.psum_scatter`; "two_stage" the same sum as two, over
    dp sub-groups (`two_stage_reduce_scatter`, second-stage groups of `two_stage_inner(mesh)`); "ring"
    as dp − 1 neighbour exchanges (`ring_reduce_scatter`); "auto" is `resolve_scatter`'s choice.
    """

    def __init__(self, mesh: Mesh, loss_fn: LossFn, tx: optax.GradientTransformation,
                 abstract_params: PyTree, *, logical_axes: PyTree | None = None,
                 grad_reduce: GradReduce = "reduce_scatter", lr_schedule: optax.Schedule | None = None,
                 precision: Precision = "fp32", accumulate_dtype=jnp.float32, scatter: Scatter = "auto",
                 rules=sharding.RULES):
        self.mesh = mesh
        self.grad_reduce = grad_reduce
        self.precision = precision
        self.param_dtype = jnp.dtype(jnp.bfloat16 if precision == "mixed" else jnp.float32)
        self.tx = tx = with_master_weights(tx) if precision == "mixed" else tx
        self.abstract_params = abstract_params  # float32: the model's (and the master weights')
        self.working_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, self.param_dtype), abstract_params)
        self.table = table = sharding.Table(mesh, abstract_params, logical_axes, tx, rules)
        self.dp, self.tp, self.layouts = table.dp, table.tp, table.layouts
        # What the three programs take and give (read these; zerolm.sharding derives them).
        self.replicated, self.batch_sharding, self.row_sharding = table.replicated, table.batch, table.rows
        self.param_shardings, self.view_shardings, self.opt_shardings = table.params, table.views, table.opt
        self.state_shardings = TrainState(step=self.replicated, params=self.param_shardings,
                                          opt_state=self.opt_shardings)

        # (1) accumulate: manual over dp; per-device gradients come out stacked on a leading dp axis.
        stacked = jax.tree.map(lambda _: P(DP), table.param_specs, is_leaf=lambda x: isinstance(x, P))
        accumulate = jax.shard_map(functools.partial(_accumulate, loss_fn=loss_fn, acc_dtype=jnp.dtype(accumulate_dtype),
                                                     out_dtype=self.param_dtype), mesh=mesh,
                                   in_specs=(P(), self.batch_sharding.spec), out_specs=(stacked, P(DP)),
                                   axis_names=frozenset({DP}))
        # (2) reduce: manual over dp and tp, each device reducing its own tp block (sharding.Table.reduction).
        tp_local, in_specs, out_specs = table.reduction(grad_reduce)
        self.scatter = resolve_scatter(scatter, mesh)  # "collective", "two_stage" or "ring"
        self.scatter_inner = two_stage_inner(mesh) if self.scatter == "two_stage" else None
        reduce = jax.shard_map(functools.partial(_reduce, layouts=self.layouts, tp_local=tp_local,
                                                 grad_reduce=grad_reduce, dp=self.dp, tp=self.tp,
                                                 scatter=self.scatter, inner=self.scatter_inner),
                               mesh=mesh, in_specs=(in_specs, P(DP)), out_specs=(out_specs, P()))

        def grad_step(params, batch):
            return reduce(*accumulate(params, batch))

        self.grad = jax.jit(grad_step)
        self.reshard = jax.jit(functools.partial(to_views, self.layouts), out_shardings=self.view_shardings)
        self.update = jax.jit(
            functools.partial(_update, tx=tx, layouts=self.layouts, lr_schedule=lr_schedule),
            out_shardings=(self.param_shardings, self.opt_shardings, self.replicated, self.replicated),
            donate_argnums=(2,))  # the optimizer state; grads and the param view change shape

    @property
    def mixed(self) -> bool:
        return self.precision == "mixed"

    def programs(self, micro_batch: int, seq_len: int, accum_steps: int) -> dict[str, tuple[Callable, tuple]]:
        """The jitted programs a step runs, each with abstract inputs of a run's shapes and shardings
        (to lower and compile ahead of time: `zerolm comms`, `zerolm compile`). `reshard` is there when
        the step runs it: on the parameters (fp32: the update reads their view) and on an all-reduced
        gradient; mixed precision with reduce_scatter needs neither."""
        params = sharding.with_shardings(self.working_params, self.param_shardings)
        batch = jax.ShapeDtypeStruct((accum_steps, self.dp * micro_batch, seq_len + 1), jnp.int32,
                                     sharding=self.batch_sharding)
        views = sharding.with_shardings(sharding.abstract_views(self.layouts, self.working_params),
                                        self.view_shardings)
        opt_state = sharding.with_shardings(
            jax.eval_shape(self.tx.init, sharding.abstract_views(self.layouts, self.abstract_params)), self.opt_shardings)
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)
        programs = {"grad": (self.grad, (params, batch))}
        if not self.mixed or self.grad_reduce == "all_reduce":
            programs["reshard"] = (self.reshard, (params,))
        programs["update"] = (self.update, (views, None if self.mixed else views, opt_state, step))
        return programs

    def compiled(self, micro_batch: int, seq_len: int, accum_steps: int) -> dict[str, jax.stages.Compiled]:
        """The step's programs compiled ahead of time for a run's shapes (`programs`)."""
        return {name: fn.lower(*args).compile()
                for name, (fn, args) in self.programs(micro_batch, seq_len, accum_steps).items()}

    def compile(self, micro_batch: int, seq_len: int, accum_steps: int) -> dict[str, str]:
        """`compiled`, and the step runs those executables from now on: each program is compiled once,
        not once ahead of time and again at its first call. Returns their optimized HLO."""
        programs = self.compiled(micro_batch, seq_len, accum_steps)
        for name, executable in programs.items():
            setattr(self, name, executable)
        return {name: executable.as_text() for name, executable in programs.items()}

    def init(self, init_fn: Callable[[jax.Array], PyTree], rng: jax.Array) -> TrainState:
        """Create the state already sharded: the optimizer state never exists in one piece."""
        params = jax.jit(init_fn, out_shardings=self.param_shardings)(rng)
        return self.init_from_params(params)

    def init_from_params(self, params: PyTree) -> TrainState:
        """The state of float32 `params` (in mixed precision they become the master weights)."""
        params = jax.device_put(params, self.param_shardings)
        opt_state = jax.jit(lambda p: self.tx.init(to_views(self.layouts, p)),
                            out_shardings=self.opt_shardings)(params)
        if self.mixed:
            params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(self.param_dtype), p),
                             out_shardings=self.param_shardings)(params)
        return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), self.replicated),
                          params=params, opt_state=opt_state)

    def step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        grads, metrics = self.grad(state.params, batch)
        params_view = None if self.mixed else self.reshard(state.params)
        if self.grad_reduce == "all_reduce":
            grads = self.reshard(grads)
        params, opt_state, step, update_metrics = self.update(grads, params_view, state.opt_state, state.step)
        return TrainState(step=step, params=params, opt_state=opt_state), {**metrics, **update_metrics}

    __call__ = step


def _accumulate(params, batch_AxMxT1, *, loss_fn: LossFn, acc_dtype, out_dtype):
    """Per device: the mean gradient over its micro-batches, summed in `acc_dtype` and handed to the
    reduction in `out_dtype` (the parameters' dtype), with no cross-device reduction."""
    # Without the cast, the gradient of a replicated (unvarying) input picks up an implicit psum
    # on every micro-step, and the result comes out dp times too large.
    varying = functools.partial(lax.pcast, axis_name=DP, to="varying")
    params = jax.tree.map(varying, params)
    zeros = jax.tree.map(lambda p: varying(jnp.zeros(p.shape, acc_dtype)), params)

    def micro_step(carry, tokens_MxT1):
        grad_acc, loss_acc = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_MxT1)
        grad_acc = jax.tree.map(lambda a, g: a + g.astype(acc_dtype), grad_acc, grads)
        return (grad_acc, loss_acc + loss), None

    accum = batch_AxMxT1.shape[0]
    (grads, loss), _ = lax.scan(micro_step, (zeros, varying(jnp.zeros((), jnp.float32))), batch_AxMxT1)
    return jax.tree.map(lambda g: (g / accum).astype(out_dtype)[None], grads), (loss / accum)[None]


def _reduce(grads, loss, *, layouts, tp_local, grad_reduce: GradReduce, dp: int, tp: int, scatter: Scatter,
            inner: int | None):
    """The one reduction over dp, on each device's own tp block: pmean, or a reduce-scatter into the layout
    (`scatter`: one `psum_scatter`, two over dp sub-groups, or dp − 1 neighbour exchanges)."""
    grads = jax.tree.map(lambda g: g[0], grads)
    loss = lax.pmean(loss[0], DP)
    if grad_reduce == "all_reduce":
        return lax.pmean(grads, DP), {"loss": loss}
    reduce_scatter = {
        "collective": lambda x, axis: lax.psum_scatter(x, DP, scatter_dimension=axis, tiled=True),
        "two_stage": functools.partial(two_stage_reduce_scatter, dp=dp, inner=inner),
        "ring": functools.partial(ring_reduce_scatter, dp=dp)}[scatter]

    def scatter_leaf(lay, local, g):
        view = reduce_scatter(lay.to_view(g), lay.scatter_dim) / dp
        if local or tp == 1:
            return view
        # Whole over tp here (tp-replicated or blockified): keep this tp device's share of the dp block.
        n = view.shape[lay.scatter_dim] // tp
        return lax.dynamic_slice_in_dim(view, lax.axis_index(TP) * n, n, axis=lay.scatter_dim)

    return jax.tree.map(scatter_leaf, layouts, tp_local, grads, is_leaf=is_layout), {"loss": loss}


def two_stage_groups(dp: int, inner: int) -> tuple[list[list[int]], list[list[int]]]:
    """The dp positions of `two_stage_reduce_scatter`'s two stages: first the dp // inner positions `inner`
    apart, then the `inner` consecutive ones."""
    outer = dp // inner
    return ([[i + k * inner for k in range(outer)] for i in range(inner)],
            [[o * inner + i for i in range(inner)] for o in range(outer)])


def two_stage_reduce_scatter(x: jax.Array, axis: int, dp: int, inner: int) -> jax.Array:
    """`psum_scatter(x, 'dp', scatter_dimension=axis, tiled=True)` as two psum_scatters over dp sub-groups.

    dp = outer × inner. Device o·inner + i first sums, with the `outer` devices i, i + inner, ... (a
    stride of inner), the o-th of x's `outer` chunks (its own block and the inner − 1 blocks after it),
    then, with the `inner` devices o·inner, ..., o·inner + inner − 1, the i-th block of that chunk: block
    o·inner + i of the whole sum, its own, in dp order. Each device sends x·(outer − 1)/outer then
    x/outer·(inner − 1)/inner: (dp − 1)/dp of x, a reduce-scatter's bytes. The TPU compiler keeps both
    as reduce-scatters where it makes the one-stage form an all-reduce of the whole (the measurements:
    docs/performance-notes.md). A stage over groups of one is skipped (inner 1 or dp: one stage). An
    array of 3 or more axes whose blocks are not whole TPU tiles of rows runs in a 2-D form that makes
    them so (`_tile_rows_reduce_scatter`)."""
    block = x.shape[axis] // dp
    tile = 32 // x.dtype.itemsize  # rows of a TPU tile: 8 of float32, 16 of bfloat16
    if x.ndim >= 3 and block % tile:
        return _tile_rows_reduce_scatter(x, axis, dp, inner, tile)
    for groups in two_stage_groups(dp, inner):
        if len(groups[0]) > 1:
            x = lax.psum_scatter(x, DP, scatter_dimension=axis, axis_index_groups=groups, tiled=True)
    return x


def _tile_rows_reduce_scatter(x: jax.Array, axis: int, dp: int, inner: int, tile: int) -> jax.Array:
    """`two_stage_reduce_scatter` of x on `axis`, run on a 2-D form whose blocks are whole TPU tiles of rows.

    The TPU compiler (beyond one host) makes the second stage an all-reduce of its whole input when a
    block of an array of 3 or more axes is not a whole number of tiles along the scatter axis (125m's
    d_model 768 over dp 32: 24 bfloat16 rows; docs/performance-notes.md). Here the scatter axis goes
    first and each of its rows is cut in s, so that a device's block is block·s rows, a multiple of
    the tile, and still its own rows in order; the result is put back in x's layout. It costs a
    transposed copy of x (temporary); the layout of the optimizer state is unchanged."""
    block = x.shape[axis] // dp
    s = tile // math.gcd(block, tile)
    moved = jnp.moveaxis(x, axis, 0)
    rest = math.prod(moved.shape[1:])
    if rest % s:
        s = 1  # rows that do not cut evenly: the 2-D form alone
    out = two_stage_reduce_scatter(moved.reshape(moved.shape[0] * s, rest // s), 0, dp, inner)
    return jnp.moveaxis(out.reshape((block,) + moved.shape[1:]), 0, axis)


def ring_reduce_scatter(x: jax.Array, axis: int, dp: int) -> jax.Array:
    """`psum_scatter(x, 'dp', scatter_dimension=axis, tiled=True)` as a ring of dp − 1 `ppermute`s.

    Device i ends with block i of the sum: a partial sum of block b starts on device b + 1, travels
    right, and each device it reaches adds its own block b. Every device sends (dp − 1)/dp of x, a
    reduce-scatter's bytes, in dp − 1 hops (`two_stage_reduce_scatter` takes 2 collectives). The TPU
    compiler keeps collective-permutes where it makes a one-stage reduce-scatter an all-reduce.
    Unrolled, so that no collective sits in a loop (and the compiler may overlap them)."""
    if dp == 1:
        return x
    n = x.shape[axis] // dp
    me = lax.axis_index(DP)
    right = [(j, (j + 1) % dp) for j in range(dp)]

    def block(b):
        return lax.dynamic_slice_in_dim(x, (b % dp) * n, n, axis=axis)

    partial = block(me + dp - 1)
    for s in range(1, dp):
        partial = lax.ppermute(partial, DP, right) + block(me + 2 * dp - s - 1)
    return partial


def _update(grads_view, params_view, opt_state, step, *, tx, layouts, lr_schedule):
    """The optax update on the optimizer-state layout. `params_view` is None in mixed precision: the
    master weights in `opt_state` are what is updated, and the new working parameters are them cast down."""
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


def make_optimizer(train_cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then cosine decay, after global-norm clipping; with
    train.skip_nonfinite, wrapped so that an update with a non-finite gradient is skipped and counted."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train_cfg.lr, warmup_steps=train_cfg.warmup_steps,
        decay_steps=train_cfg.schedule_length, end_value=train_cfg.lr * train_cfg.min_lr_ratio)
    tx = optax.chain(
        optax.clip_by_global_norm(train_cfg.grad_clip),
        optax.adamw(schedule, b1=train_cfg.beta1, b2=train_cfg.beta2, eps=train_cfg.eps,
                    weight_decay=train_cfg.weight_decay, mask=decay_mask))
    if train_cfg.skip_nonfinite:
        tx = optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
    return tx, schedule


def decay_mask(params: PyTree) -> PyTree:
    """Weight decay on matrices and embeddings; none on biases or LayerNorm scales."""
    def decays(path, _):
        return jax.tree_util.keystr(path[-1:], simple=True) in ("kernel", "wte", "wpe")
    return jax.tree_util.tree_map_with_path(decays, params)


def naive_data_parallel_step(mesh: Mesh, loss_fn: LossFn, tx: optax.GradientTransformation):
    """The baseline the design avoids: one plain `jax.jit`, batch sharded, accumulation scan inside.

    XLA's partitioner reduces the gradients on every micro-step and keeps a replicated optimizer
    state. Kept for the benchmark's comparison and as the negative control of the collective checks.
    """
    replicated = NamedSharding(mesh, P())

    def step(params, opt_state, batch_AxBxT1):
        def micro_step(grad_acc, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            return jax.tree.map(jnp.add, grad_acc, grads), loss

        grads, losses = lax.scan(micro_step, jax.tree.map(jnp.zeros_like, params), batch_AxBxT1)
        grads = jax.tree.map(lambda g: g / batch_AxBxT1.shape[0], grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": jnp.mean(losses)}

    return jax.jit(step, in_shardings=(replicated, replicated, sharding.batch(mesh)),
                   out_shardings=replicated, donate_argnums=(0, 1))
