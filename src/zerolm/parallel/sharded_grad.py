"""ZeRO stages 2 and 3: the grad program that reduce-scatters each layer's gradient inside the layers' loop,
where the backward pass makes it (zerolm.parallel.zero holds the step's three programs; docs/zero-stages.md says why).

Stage 2 stores the layers' parameters whole and attaches to each a zero block (its gradient sink, `_attach`)
into which the backward pass reduce-scatters that layer's gradient; stage 3 stores them as each device's
block and all-gathers a layer's where the model uses it (`_gather`), whose transpose reduce-scatters. The
other leaves reduce once after the loop, as at stage 1. `sum_over_micro_batches` is the micro-batch loop
both this program and stage 1's run.

With several slices (`mesh.slices`) every reduction above stays inside a slice, over dp; each device's block
of the step's gradient, summed over the micro-batches, is then all-reduced across the slices once, after the
loop (`across_slices`): the data-center network carries 1/dp of the gradient a step, whatever the accumulation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from zerolm.model import dropout as dropout_lib
from zerolm.parallel.mesh import DP, SLICE
from zerolm.parallel.sharding import is_layout

# (params, tokens_BxT1, layer_params) -> scalar loss; `layer_params`: what each layer of the model applies
# to its stored parameters before it reads them (ZeRO-3's gather; zerolm.model.decoder.GPT.layer_params), or None.
LossFn = Callable[..., jax.Array]


def grad_program(table, loss_fn: LossFn, how: GradSettings, reduce_scatter, manual: frozenset) -> Callable:
    """(params, batch) -> (gradient in the optimizer-state layout, metrics) at `table.stage` 2 or 3 (a
    zerolm.parallel.sharding.Table): each layer's reduce-scattered (by `reduce_scatter`, zerolm.parallel.scatter's) inside the
    loop where the backward pass makes it, the other leaves' once after it; the gradient in `out_dtype` (the
    parameters' dtype), accumulated in `acc_dtype`; the map manual over the axes `manual`."""
    param_in = jax.tree.map(lambda s, lay, ps: lay.dp_spec if s else P(*[None] * len(ps)), table.dp_split,
                            table.layouts, table.param_specs, is_leaf=is_layout)
    grad_out = jax.tree.map(lambda lay: lay.dp_spec, table.layouts, is_leaf=is_layout)
    across: Callable[[jax.Array], jax.Array] = functools.partial(across_slices, slices=table.slices)
    if table.tp > 1 and jnp.dtype(how.out_dtype) == jnp.bfloat16 and table.mesh.devices.flat[0].platform == "cpu":
        # XLA's CPU compiler aborts on a bfloat16 reduce-scatter or all-reduce in a map manual over dp (and slice)
        # alone ("Invalid binary instruction opcode copy", jax 0.10): there, and only there, they run in float32.
        reduce_scatter, across = _in_float32(reduce_scatter), _in_float32(across)
    each = _Accumulation(table, loss_fn, how, reduce_scatter, across)
    accumulate = jax.shard_map(functools.partial(_accumulate, how=each), mesh=table.mesh,
                               in_specs=(param_in, table.batch_sharding.spec, P()), out_specs=(grad_out, P()),
                               axis_names=manual)

    def grad_step(params, batch, step=None):  # the name its compiled programs (and the compilation cache) carry
        grads, metrics = accumulate(params, batch, jnp.zeros((), jnp.int32) if step is None else step)
        return lax.with_sharding_constraint(grads, table.view_shardings), metrics

    return grad_step


def sum_over_micro_batches(loss_fn: Callable, params, zeros, batch_AxMxT1, keys_of: Callable | None = None,
                           data: Axes = DP):
    """Σ over the micro-batches (a scan) of the loss and of its gradient with respect to `params`, each
    gradient added into `zeros`' accumulator in the accumulator's dtype. `keys_of(a)`: micro-batch a's
    samples' dropout keys (zerolm.model.dropout.row_keys), handed to the loss; None: no dropout. `data`:
    the axes the batch's rows vary over."""
    def micro_step(carry, inputs):
        grad_acc, loss_acc = carry
        a, tokens_MxT1 = inputs
        kw = {} if keys_of is None else {"dropout_keys": keys_of(a)}
        loss, grads = jax.value_and_grad(lambda p, t: loss_fn(p, t, **kw))(params, tokens_MxT1)
        grad_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_acc, grads)
        return (grad_acc, loss_acc + loss), None

    loss_zero = vary(jnp.zeros((), jnp.float32), data)
    (grads, loss), _ = lax.scan(micro_step, (zeros, loss_zero), (jnp.arange(batch_AxMxT1.shape[0]), batch_AxMxT1))
    return grads, loss


def dropout_keys(seed: int | None, step: jax.Array, batch_AxMxT1: jax.Array, data: Axes = DP) -> Callable | None:
    """Inside the grad program's map over the data axes `data`: micro-batch a -> its samples' dropout keys, each
    from the sample's row in the step's global batch (this device's block of rows: zerolm.data.loader's layout),
    so the same on any number of devices and slices. None without dropout (`seed` None)."""
    if seed is None:
        return None
    A, M = batch_AxMxT1.shape[:2]
    first = lax.axis_index(data) * A * M
    return lambda a: dropout_lib.row_keys(seed, step, first + a * M, M)


Axes = str | tuple[str, ...]  # one mesh axis, or several (the batch's: dp, or (slice, dp))


def vary(x: jax.Array, axes: Axes) -> jax.Array:
    """`x` typed as varying over `axes` (those it is not already varying over), inside a map manual over them:
    what the gradient of a value used with the batch's rows must be, else its transpose sums it over them on
    every micro-step."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # (jax 0.10; `vma` before it)
    already = manual.varying if manual is not None else aval.vma
    missing = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in already)
    return lax.pcast(x, missing, to="varying") if missing else x


def across_slices(x: jax.Array, slices: int) -> jax.Array:
    """Inside a map manual over the slice axis: the mean of `x` over the slices, one all-reduce over the
    data-center network (nothing with one slice)."""
    return x if slices == 1 else lax.psum(x, SLICE) / slices


def _in_float32(reduction: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """`reduction` (x, ...) run in float32, its result cast back (`grad_program` says where)."""
    return lambda x, *args: reduction(x.astype(jnp.float32), *args).astype(x.dtype)


def _gather(axis: int, reduce_scatter: Callable[[jax.Array, int], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """ZeRO-3: x's dp blocks along `axis`, all-gathered; the transpose is `reduce_scatter` (zerolm.parallel.scatter's,
    as the step's scatter says), so the backward pass reduce-scatters the gradient of what was gathered."""
    @jax.custom_vjp
    def gather(x):
        return lax.all_gather(x, DP, axis=axis, tiled=True)

    gather.defvjp(lambda x: (gather(x), None), lambda _, g: (reduce_scatter(g, axis),))
    return gather


def _attach(axis: int, reduce_scatter: Callable[[jax.Array, int], jax.Array]) -> Callable[..., jax.Array]:
    """ZeRO-2: `whole` as it is, its gradient reduce-scattered along `axis` into `sink`'s (this device's dp
    block, zeros): the backward pass reduce-scatters each layer's gradient where it is made, so no whole
    gradient outlives its layer."""
    @jax.custom_vjp
    def attach(whole, sink):
        del sink
        return whole

    attach.defvjp(lambda whole, sink: (whole, None), lambda _, g: (None, reduce_scatter(g, axis)))
    return attach


def _at_use(stage: int, axis: int, reduce_scatter) -> Callable[[Any], jax.Array]:
    """What a parameter stored as `x` is where it is used, at `stage`: its dp block gathered (3), or the
    pair (whole, gradient sink) attached (2)."""
    if stage == 3:
        return _gather(axis, reduce_scatter)
    return lambda pair: _attach(axis, reduce_scatter)(*pair)


def _layer_params(stage: int, layouts, in_layers, stacked, reduce_scatter) -> Callable | None:
    """Each layer's `_at_use`, for the model's `layer_params`: the `in_layers` leaves of the stacked layers
    (one subtree of the parameters, a leading `layers` axis), on their layout's axis less the layers axis.
    None when there are none."""
    keys = {path[0].key for path, s in jax.tree_util.tree_leaves_with_path(stacked) if s}
    if not any(jax.tree.leaves(in_layers)):
        return None
    if len(keys) != 1 or not all(jax.tree.leaves(stacked[next(iter(keys))])):
        raise ValueError(f"ZeRO-{stage} reduces in one subtree of stacked layers; these parameters have {sorted(keys)}")
    key = next(iter(keys))
    axes = jax.tree.map(lambda u, lay: lay.axis - 1 if u else -1, in_layers[key], layouts[key], is_leaf=is_layout)

    def layer_params(tree):
        return jax.tree.map(lambda axis, x: x if axis < 0 else _at_use(stage, axis, reduce_scatter)(x), axes, dict(tree))

    return layer_params


@dataclasses.dataclass(frozen=True)
class GradSettings:
    """How a grad program accumulates: in `acc_dtype`, handing the gradient on in `out_dtype` (the parameters'),
    with dropout keys from `dropout_seed` (None: the model has no dropout), over the batch's axes `data`."""

    acc_dtype: Any
    out_dtype: Any
    dropout_seed: int | None = None
    data: Axes = DP


@dataclasses.dataclass(frozen=True)
class _Accumulation:
    """What each device's side of the grad program (`_accumulate`) runs with."""

    table: Any  # the step's zerolm.parallel.sharding.Table: its stage, layouts, and which leaves reduce in the loop
    loss_fn: LossFn
    grad: GradSettings  # the accumulator's dtype, the gradient's (the parameters'), dropout's seed, the batch's axes
    reduce_scatter: Callable[[jax.Array, int], jax.Array]  # zerolm.parallel.scatter's, over dp
    across: Callable[[jax.Array], jax.Array]  # the mean over the slices (`across_slices`)


def _accumulate(params, batch_AxMxT1, step, *, how: _Accumulation):
    """Per device: its dp block of the mean gradient over every device's micro-batches, in the optimizer-state
    layout.

    The `in_layers` leaves (`Table.in_loop`: the stacked layers' leaves that the layout splits over dp) reduce
    a layer at a time, inside the layers' loop, where the model uses them (`_layer_params`): ZeRO-3 stores them as this
    device's block and gathers it there; ZeRO-2 stores them whole and reduce-scatters each layer's gradient
    into a zero block (its sink) as the backward pass makes it. The other leaves (the embeddings, the last
    LayerNorm; a layer's few leaves that no dp-splittable axis has) reduce as in ZeRO-1: each device sums its
    own gradient of them over the micro-batches, then one reduce-scatter after the loop; ZeRO-3 gathers those
    it stores split once (`Table.dp_split`), before the loop."""
    table, reduce_scatter, out_dtype, data = how.table, how.reduce_scatter, how.grad.out_dtype, how.grad.data
    stage, layouts, in_layers, dp = table.stage, table.layouts, table.in_loop, table.dp
    varying = functools.partial(vary, axes=data)
    hook = _layer_params(stage, layouts, in_layers, table.stacked, reduce_scatter)

    def before_loop(u, split, lay, p):
        if u:  # a layer's block (ZeRO-3: gathered in the loop) or whole (ZeRO-2)
            return varying(p)
        return varying(lax.all_gather(p, DP, axis=lay.scatter_dim, tiled=True) if split else p)

    params = jax.tree.map(before_loop, in_layers, table.dp_split, layouts, params, is_leaf=is_layout)

    def block_zeros(lay, dtype):
        shape = list(lay.view_shape)
        shape[lay.scatter_dim] //= dp
        return varying(jnp.zeros(shape, dtype))

    # What is differentiated: ZeRO-3's stored blocks and ZeRO-2's sinks in the layers, the other leaves themselves.
    diff = jax.tree.map(lambda u, lay, p: block_zeros(lay, p.dtype) if u and stage == 2 else p, in_layers, layouts,
                        params, is_leaf=is_layout)

    def loss_of(diff, tokens_MxT1, **kw):
        model_params = jax.tree.map(lambda u, d, p: (lax.stop_gradient(p), d) if u and stage == 2 else d,
                                    in_layers, diff, params)
        if hook is None:
            return how.loss_fn(model_params, tokens_MxT1, **kw)
        return how.loss_fn(model_params, tokens_MxT1, layer_params=hook, **kw)

    accum = batch_AxMxT1.shape[0]
    acc_dtype = how.grad.acc_dtype
    zeros = jax.tree.map(lambda u, lay: block_zeros(lay, acc_dtype) if u else varying(jnp.zeros(lay.shape, acc_dtype)),
                         in_layers, layouts, is_leaf=is_layout)
    grads, loss = sum_over_micro_batches(loss_of, diff, zeros, batch_AxMxT1,
                                         dropout_keys(how.grad.dropout_seed, step, batch_AxMxT1, data), data)

    def after_loop(u, lay, g):
        if u:  # this slice's sum, reduce-scattered in the loop; the slices' mean of it
            return how.across((g / (dp * accum)).astype(out_dtype))
        # In the parameters' dtype, as ZeRO-1 reduces (bfloat16 in mixed precision).
        block = reduce_scatter(lay.to_view((g / accum).astype(out_dtype)), lay.scatter_dim) / dp
        return how.across(block)

    grads = jax.tree.map(after_loop, in_layers, layouts, grads, is_leaf=is_layout)
    return grads, {"loss": across_slices(lax.pmean(loss / accum, DP), table.slices)}
