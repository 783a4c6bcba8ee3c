"""ZeRO-1: every sharding of the training step, the shard_map gradient step, the reshard and the update.

One optimizer step is three compiled programs (seed note 003, on today's JAX):

1. `grad`: `jax.shard_map` over `dp`. Each device scans over its micro-batches, accumulating float32
   gradients locally, then ONE cross-device reduction: a `pmean` (all_reduce) or a `psum_scatter`
   straight into the optimizer-state layout (reduce_scatter, half the bytes).
2. `reshard`: an identity `jax.jit` that moves replicated trees into the optimizer-state layout. Each
   device keeps its own slice, so it compiles to no collective.
3. `update`: a jitted optax update on the `dp`-sharded view; the optimizer state stays sharded (and is
   donated) and the new parameters come back replicated, which is the one all-gather.

The optimizer-state layout of a parameter is derived from its shape alone (`Layout`): split along an
axis divisible by dp, or, when no axis divides, flattened and padded into dp equal blocks (the seeds'
"blockify"). Either way every device holds exactly 1/dp of the optimizer state, plus padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerolm.mesh import DP

PyTree = Any
GradReduce = Literal["all_reduce", "reduce_scatter"]
LossFn = Callable[[PyTree, jax.Array], jax.Array]  # (params, tokens_BxT1) -> scalar loss


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one parameter's optimizer state lives: split along `axis`, or in dp padded blocks (axis None)."""

    shape: tuple[int, ...]
    dp: int
    axis: int | None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def view_shape(self) -> tuple[int, ...]:
        return self.shape if self.axis is not None else (self.dp, -(-self.size // self.dp))

    @property
    def spec(self) -> P:
        if self.axis is None:
            return P(DP, None)
        return P(*(DP if i == self.axis else None for i in range(len(self.shape))))

    @property
    def scatter_dim(self) -> int:
        return 0 if self.axis is None else self.axis

    @property
    def padding(self) -> int:
        return math.prod(self.view_shape) - self.size

    def to_view(self, x: jax.Array) -> jax.Array:
        """Replicated parameter -> optimizer layout. Local reshaping only; no communication."""
        if self.axis is not None:
            return x
        return jnp.pad(x.reshape(-1), (0, self.padding)).reshape(self.view_shape)

    def from_view(self, v: jax.Array) -> jax.Array:
        if self.axis is not None:
            return v
        return v.reshape(-1)[: self.size].reshape(self.shape)


def plan_layout(shape: tuple[int, ...], dp: int) -> Layout:
    """Split the largest axis that dp divides; blockify when none does (odd vocab, biases, scalars)."""
    divisible = [i for i, n in enumerate(shape) if n % dp == 0]
    if not divisible:
        return Layout(tuple(shape), dp, None)
    return Layout(tuple(shape), dp, max(divisible, key=lambda i: shape[i]))


def plan(abstract_params: PyTree, dp: int) -> PyTree:
    return jax.tree.map(lambda a: plan_layout(a.shape, dp), abstract_params)


def is_layout(x) -> bool:
    return isinstance(x, Layout)


def to_views(layouts: PyTree, tree: PyTree) -> PyTree:
    return jax.tree.map(lambda lay, x: lay.to_view(x), layouts, tree, is_leaf=is_layout)


def from_views(layouts: PyTree, tree: PyTree) -> PyTree:
    return jax.tree.map(lambda lay, v: lay.from_view(v), layouts, tree, is_leaf=is_layout)


def with_shardings(abstract: PyTree, shardings: PyTree) -> PyTree:
    """Abstract arrays carrying shardings: the targets for lowering or restoring sharded state."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def abstract_views(layouts: PyTree, abstract_params: PyTree) -> PyTree:
    return jax.tree.map(lambda lay, a: jax.ShapeDtypeStruct(lay.view_shape, a.dtype),
                        layouts, abstract_params, is_leaf=is_layout)


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: PyTree  # float32, replicated on every device
    opt_state: PyTree  # sharded on dp, in the Layout views


class Zero1:
    """The ZeRO-1 training step for one mesh, model loss, optimizer and accumulation count.

    `step(state, batch) -> (state, metrics)` is a pure function of its inputs; `batch` is the global
    array of shape (accum_steps, dp * micro_batch, seq_len + 1) sharded by `batch_sharding`.
    """

    def __init__(self, mesh: Mesh, loss_fn: LossFn, tx: optax.GradientTransformation,
                 abstract_params: PyTree, *, grad_reduce: GradReduce = "reduce_scatter",
                 lr_schedule: optax.Schedule | None = None):
        self.mesh = mesh
        self.dp = mesh.shape[DP]
        self.grad_reduce = grad_reduce
        self.tx = tx
        self.layouts = plan(abstract_params, self.dp)
        self.abstract_params = abstract_params

        # The sharding table: everything the three programs take and give.
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, P(None, DP))  # (accum, rows, tokens): rows over dp
        self.row_sharding = NamedSharding(mesh, P(DP))  # (rows, ...): evaluation batches
        self.param_shardings = jax.tree.map(lambda _: self.replicated, abstract_params)
        self.view_shardings = jax.tree.map(lambda lay: NamedSharding(mesh, lay.spec), self.layouts,
                                           is_leaf=is_layout)
        abstract_opt = jax.eval_shape(tx.init, abstract_views(self.layouts, abstract_params))
        self.opt_shardings = optax.tree_map_params(
            tx, lambda _, sharding: sharding, abstract_opt, self.view_shardings,
            transform_non_params=lambda _: self.replicated)
        self.state_shardings = TrainState(step=self.replicated, params=self.param_shardings,
                                          opt_state=self.opt_shardings)

        grad_specs = (P() if grad_reduce == "all_reduce"
                      else jax.tree.map(lambda lay: lay.spec, self.layouts, is_leaf=is_layout))
        local = functools.partial(_local_grads, loss_fn=loss_fn, layouts=self.layouts,
                                  grad_reduce=grad_reduce, dp=self.dp)
        self.grad = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, DP)),
                                          out_specs=(grad_specs, P())))
        self.reshard = jax.jit(functools.partial(to_views, self.layouts), out_shardings=self.view_shardings)
        self.update = jax.jit(
            functools.partial(_update, tx=tx, layouts=self.layouts, lr_schedule=lr_schedule),
            out_shardings=(self.param_shardings, self.opt_shardings, self.replicated, self.replicated),
            donate_argnums=(2,))  # the optimizer state; grads and the param view change shape

    def init(self, init_fn: Callable[[jax.Array], PyTree], rng: jax.Array) -> TrainState:
        """Create the state already sharded: the optimizer state never exists in one piece."""
        params = jax.jit(init_fn, out_shardings=self.param_shardings)(rng)
        return self.init_from_params(params)

    def init_from_params(self, params: PyTree) -> TrainState:
        params = jax.device_put(params, self.param_shardings)
        opt_state = jax.jit(lambda p: self.tx.init(to_views(self.layouts, p)),
                            out_shardings=self.opt_shardings)(params)
        return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), self.replicated),
                          params=params, opt_state=opt_state)

    def step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        grads, metrics = self.grad(state.params, batch)
        params_view = self.reshard(state.params)
        if self.grad_reduce == "all_reduce":
            grads = self.reshard(grads)
        params, opt_state, step, update_metrics = self.update(grads, params_view, state.opt_state, state.step)
        return TrainState(step=step, params=params, opt_state=opt_state), {**metrics, **update_metrics}

    __call__ = step


def _local_grads(params, batch_AxMxT1, *, loss_fn: LossFn, layouts, grad_reduce: GradReduce, dp: int):
    """Per device: accumulate gradients over the micro-batches, then one cross-device reduction."""
    # Without the cast, the gradient of a replicated (unvarying) input picks up an implicit psum
    # on every micro-step, and the result comes out dp times too large.
    varying = functools.partial(lax.pcast, axis_name=DP, to="varying")
    params = jax.tree.map(varying, params)
    zeros = jax.tree.map(lambda p: varying(jnp.zeros(p.shape, jnp.float32)), params)

    def micro_step(carry, tokens_MxT1):
        grad_acc, loss_acc = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_MxT1)
        grad_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_acc, grads)
        return (grad_acc, loss_acc + loss), None

    accum = batch_AxMxT1.shape[0]
    (grads, loss), _ = lax.scan(micro_step, (zeros, varying(jnp.zeros((), jnp.float32))), batch_AxMxT1)
    grads = jax.tree.map(lambda g: g / accum, grads)
    loss = loss / accum
    if grad_reduce == "all_reduce":
        grads, loss = lax.pmean((grads, loss), DP)
    else:
        grads = jax.tree.map(
            lambda lay, g: lax.psum_scatter(lay.to_view(g), DP, scatter_dimension=lay.scatter_dim, tiled=True) / dp,
            layouts, grads, is_leaf=is_layout)
        loss = lax.pmean(loss, DP)
    return grads, {"loss": loss}


def _update(grads_view, params_view, opt_state, step, *, tx, layouts, lr_schedule):
    metrics = {"grad_norm": optax.tree.norm(grads_view)}  # over the whole, sharded gradient
    if lr_schedule is not None:
        metrics["lr"] = lr_schedule(step)
    updates, opt_state = tx.update(grads_view, opt_state, params_view)
    skipped = optax.tree_utils.tree_get(opt_state, "total_notfinite")  # set under optax.apply_if_finite
    if skipped is not None:
        metrics["skipped_updates"] = skipped
        metrics["skipped_in_a_row"] = optax.tree_utils.tree_get(opt_state, "notfinite_count")
    params = from_views(layouts, optax.apply_updates(params_view, updates))
    return params, opt_state, step + 1, metrics


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


def bytes_per_device(tree: PyTree) -> dict[jax.Device, int]:
    """Bytes of a (sharded) pytree that each local device actually holds."""
    per_device: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return per_device


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

    return jax.jit(step, in_shardings=(replicated, replicated, NamedSharding(mesh, P(None, DP))),
                   out_shardings=replicated, donate_argnums=(0, 1))
