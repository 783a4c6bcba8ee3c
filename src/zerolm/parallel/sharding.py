"""Every sharding of the training step, derived in one place: the table the other modules ask.

- **Parameters** (tensor parallelism): each parameter's logical axis names (from the model) go through
  `RULES`, Megatron-style: attention heads (query and key/value alike) and the MLP hidden dimension are
  split over `tp` (column-parallel `c_attn`/`c_q`/`c_kv`/`c_fc`/`c_gate`, row-parallel `c_proj`s); everything else, the embedding
  included, is replicated over `tp`. Replicating the embedding keeps the embedding lookup, the tied
  output layer and the chunked loss free of vocabulary collectives; its cost is the output layer's
  FLOPs repeated on each tp device and its parameters held whole (the optimizer state is still
  split, below). Every parameter is replicated over `dp`.
- **Optimizer state** (ZeRO-1, `Layout`): on top of a parameter's tp split, one more axis is split
  over `dp`, so that each device holds 1/(dp·tp) of the state. A tp-split parameter gets dp on
  another axis that dp divides; a tp-replicated one is split over dp and tp together. When no axis
  divides, the leaf is flattened and padded into dp·tp equal blocks ("blockify", docs/design.md).
  ZeRO-2 keeps the gradient in the same layout; ZeRO-3 the parameters too, where the layout keeps the
  parameter's shape (the other leaves, a few biases and LayerNorm scales, stay whole over dp). Both never
  split the stacked layers' `layers` axis, so that each layer reduces (and gathers) its own slice.
- **Batches**: rows over `dp` (over `slice` and `dp` with several slices), replicated over `tp`; the loader's
  staging array adds a leading `tp` axis (only tp = 0 devices read: docs/design.md, "Data on a (dp, tp) mesh").
- **Slices** (`mesh.slices`): every sharding above names `dp` and `tp` alone, so parameters, gradients and the
  optimizer state are replicated across slices, each slice holding the whole ZeRO state split over its own dp.
- **Checkpoints**: the restore target of a state saved on another (dp, tp), and the repacking of the
  leaves whose layout shape depends on dp·tp.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerolm.parallel.mesh import DP, SLICE, TP, data_axes

PyTree = Any

# logical axis -> mesh axis (None: replicated).
RULES = (("layers", None), ("vocab", None), ("position", None), ("embed", None), ("qkv", None),
         ("heads", TP), ("kv_heads", TP), ("mlp", TP))
# The alternative, measured in BENCHMARKS.md: the token embedding (and so the output layer) split over tp.
VOCAB_PARALLEL_RULES = tuple((name, TP if name == "vocab" else axis) for name, axis in RULES)


def param_spec(logical: P, rules=RULES) -> P:
    mesh_axes = nn.logical_to_mesh_axes(tuple(logical), rules)
    assert mesh_axes is not None  # None only for logical None
    return P(*mesh_axes)


def _tp_axis(spec: P) -> int | None:
    return next((i for i, a in enumerate(spec) if a == TP), None)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one parameter's optimizer state lives, as a `view` of the parameter.

    `tp_axis`: the axis tensor parallelism splits (None: replicated over tp). `axis`: the axis the
    ZeRO split goes on, over dp alone when tp already splits another axis, else over dp and tp
    together; None: flattened and padded into dp·tp blocks."""

    shape: tuple[int, ...]
    dp: int
    tp: int
    tp_axis: int | None
    axis: int | None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def blocks(self) -> int:
        return self.dp * self.tp

    @property
    def view_shape(self) -> tuple[int, ...]:
        return self.shape if self.axis is not None else (self.blocks, -(-self.size // self.blocks))

    @property
    def spec(self) -> P:
        """The view's sharding over the whole mesh."""
        joint = (DP, TP) if self.tp > 1 else DP
        if self.axis is None:
            return P(joint, None)
        if self.tp_axis is not None:
            return P(*(DP if i == self.axis else TP if i == self.tp_axis else None for i in range(len(self.shape))))
        return P(*(joint if i == self.axis else None for i in range(len(self.shape))))

    @property
    def dp_spec(self) -> P:
        """`spec` as a map manual over dp alone sees it (tp is left to the compiler there)."""
        return P(*(DP if a == DP or (isinstance(a, tuple) and DP in a) else None for a in self.spec))

    @property
    def scatter_dim(self) -> int:
        return 0 if self.axis is None else self.axis

    @property
    def padding(self) -> int:
        return math.prod(self.view_shape) - self.size

    def to_view(self, x: jax.Array) -> jax.Array:
        """Parameter -> optimizer layout. A reshape at most (and padding, for blockified leaves)."""
        if self.axis is not None:
            return x
        return jnp.pad(x.reshape(-1), (0, self.padding)).reshape(self.view_shape)

    def from_view(self, v: jax.Array) -> jax.Array:
        if self.axis is not None:
            return v
        return v.reshape(-1)[: self.size].reshape(self.shape)


def plan_layout(shape: tuple[int, ...], dp: int, tp: int = 1, tp_axis: int | None = None,
                keep: int | None = None) -> Layout:
    """The largest axis the split divides (dp alone beside a tp axis; dp·tp otherwise), not the last one
    if another divides, never `keep` (ZeRO-2/3's layers axis); else blockify.

    Not the last: the TPU compiler turns a reduce-scatter that splits an array's minor axis into an
    all-reduce of the whole (a 2-layer 125m on v5e: the MLP's (layers, d, 4d) kernel). The view keeps
    the parameter's shape whichever axis is split, so checkpoints restore across this choice."""
    shape = tuple(shape)
    if tp_axis is not None and tp > 1:
        candidates = [i for i, n in enumerate(shape) if i not in (tp_axis, keep) and n % dp == 0]
    else:
        tp_axis = None
        candidates = [i for i, n in enumerate(shape) if i != keep and n % (dp * tp) == 0]
    major = [i for i in candidates if i < len(shape) - 1]
    axis = max(major or candidates, key=lambda i: shape[i]) if candidates else None
    return Layout(shape, dp, tp, tp_axis, axis)


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


def batch(mesh: Mesh | AbstractMesh) -> NamedSharding:
    """(accum, rows, tokens): rows split over dp (slices × dp), replicated over tp."""
    return NamedSharding(mesh, P(None, data_axes(mesh)))


def batch_staging(mesh: Mesh | AbstractMesh) -> NamedSharding:
    """(tp, accum, rows, tokens): the loader's staging array, where tp = 0 devices hold the read rows."""
    return NamedSharding(mesh, P(TP, None, data_axes(mesh)))


def rows(mesh: Mesh | AbstractMesh) -> NamedSharding:
    """(rows, ...): evaluation batches."""
    return NamedSharding(mesh, P(data_axes(mesh)))


class Table:
    """The shardings of one mesh, parameter tree, optimizer and ZeRO stage: every name ending in `_shardings`
    (or `_sharding`) holds `NamedSharding`s; `layouts` the optimizer state's `Layout`s; `param_specs` the
    parameters' tp `PartitionSpec`s (whole over dp: how they are used); `param_shardings` how they are
    stored: as `param_specs` at stages 1 and 2, in their layout at stage 3 (`dp_split`); `in_loop` the leaves
    stages 2 and 3 reduce inside the layers' loop."""

    def __init__(self, mesh: Mesh | AbstractMesh, abstract_params: PyTree, logical_axes: PyTree | None,
                 tx: optax.GradientTransformation, rules=RULES, stage: int = 1):
        self.mesh, self.tx, self.abstract_params, self.stage = mesh, tx, abstract_params, stage
        self.dp, self.tp = mesh.shape[DP], mesh.shape[TP]  # dp: inside a slice, the ZeRO split
        self.slices = mesh.shape.get(SLICE, 1)
        self.data = data_axes(mesh)  # the batch rows' axes: dp, or (slice, dp)
        if logical_axes is None:
            if self.tp > 1:
                raise ValueError("tensor parallelism needs the parameters' logical axes")
            logical_axes = jax.tree.map(lambda a: P(*[None] * a.ndim), abstract_params)
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        self.param_specs = jax.tree.map(lambda logical: param_spec(logical, rules), logical_axes, is_leaf=is_spec)
        # The model's stacked layers (a leading `layers` axis): what ZeRO-3 gathers layer by layer.
        self.stacked = jax.tree.map(lambda logical: len(logical) > 0 and logical[0] == "layers", logical_axes,
                                    is_leaf=is_spec)
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding, self.row_sharding = batch(mesh), rows(mesh)
        self.layouts = self.plan(self.dp, self.tp)
        self.view_shardings = jax.tree.map(lambda lay: NamedSharding(mesh, lay.spec), self.layouts, is_leaf=is_layout)
        self.opt_shardings = self._opt_shardings(self.layouts, self.view_shardings)
        # ZeRO-3 stores a parameter split over dp where its layout keeps its shape.
        self.dp_split = jax.tree.map(lambda lay: stage == 3 and lay.axis is not None and self.dp > 1, self.layouts,
                                     is_leaf=is_layout)
        # ZeRO-2 and -3 reduce (and -3 gathers) these inside the layers' loop, a layer at a time: the stacked
        # layers' leaves that the layout splits over dp. The others reduce after the loop, as at stage 1.
        self.in_loop = jax.tree.map(lambda lay, st: stage > 1 and st and lay.axis is not None and self.dp > 1,
                                    self.layouts, self.stacked, is_leaf=is_layout)
        self.param_shardings = jax.tree.map(lambda split, lay, s: NamedSharding(mesh, lay.spec if split else s),
                                            self.dp_split, self.layouts, self.param_specs, is_leaf=is_layout)

    def plan(self, dp: int, tp: int, stage: int | None = None) -> PyTree:
        """The layouts on a (dp, tp) mesh at a ZeRO stage: this one's, or the one a checkpoint was saved on."""
        keep = (stage or self.stage) >= 2
        return jax.tree.map(lambda a, s, stacked: plan_layout(a.shape, dp, tp, _tp_axis(s) if tp > 1 else None,
                                                              0 if keep and stacked else None),
                            self.abstract_params, self.param_specs, self.stacked, is_leaf=lambda x: isinstance(x, P))

    def _opt_shardings(self, layouts: PyTree, view_shardings: PyTree) -> PyTree:
        abstract_opt = jax.eval_shape(self.tx.init, abstract_views(layouts, self.abstract_params))
        return optax.tree_map_params(self.tx, lambda _, sharding: sharding, abstract_opt, view_shardings,
                                     transform_non_params=lambda _: self.replicated)

    def reduction(self, grad_reduce: str) -> tuple[PyTree, PyTree, PyTree]:
        """The gradient step's reduction, manual over dp and tp: (tp_local, in_specs, out_specs).

        Per-device gradients arrive stacked on a leading axis over the data ranks (slices × dp). A leaf is
        `tp_local` when its gradient is reduced as this device's tp block (a tp-split leaf, unless
        reduce_scatter blockifies it); the others arrive whole over tp. They leave in the optimizer-state
        layout (reduce_scatter) or in the parameters' own sharding (all_reduce)."""
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        tp_local = jax.tree.map(lambda lay: lay.tp_axis is not None and (lay.axis is not None or grad_reduce == "all_reduce"),
                                self.layouts, is_leaf=is_layout)
        in_specs = jax.tree.map(lambda local, s: P(self.data, *(s if local else [None] * len(s))), tp_local,
                                self.param_specs, is_leaf=is_spec)
        out_specs = (self.param_specs if grad_reduce == "all_reduce"
                     else jax.tree.map(lambda lay: lay.spec, self.layouts, is_leaf=is_layout))
        return tp_local, in_specs, out_specs

    def restore_target(self, saved_dp: int, saved_tp: int, saved_stage: int = 1) -> tuple[PyTree, Any]:
        """What to restore a state saved on (saved_dp, saved_tp) at `saved_stage` into, and how to finish it.

        Returns (abstract optimizer state with shardings, repack). Leaves whose view has
        the same shape now restore straight into this mesh's sharding; the others (blockified into a
        different number of blocks) restore whole and `repack(opt_state)` rebuilds them here."""
        saved = self.plan(saved_dp, saved_tp, saved_stage)
        saved_opt = jax.eval_shape(self.tx.init, abstract_views(saved, self.abstract_params))
        same = jax.tree.map(lambda old, new: old.view_shape == new.view_shape, saved, self.layouts, is_leaf=is_layout)
        target_views = jax.tree.map(lambda s, sh: sh if s else self.replicated, same, self.view_shardings)
        target = optax.tree_map_params(self.tx, lambda _, sh: sh, saved_opt, target_views,
                                       transform_non_params=lambda _: self.replicated)

        def repack(opt_state):
            if all(jax.tree.leaves(same)):
                return opt_state
            return jax.jit(lambda opt: optax.tree_map_params(
                self.tx, lambda v, old, new: new.to_view(old.from_view(v)), opt, saved, self.layouts,
                transform_non_params=lambda x: x, is_leaf=is_layout), out_shardings=self.opt_shardings)(opt_state)

        return with_shardings(saved_opt, target), repack


def shard_bytes(abstract: PyTree) -> int:
    """Bytes one device holds of a tree of abstract arrays with shardings (the largest shard per leaf)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract))
