"""Model-state bytes per device (params, gradients, optimizer state) for each ZeRO stage: a stage shards
over dp what it names (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", section 5): stage 0 nothing, 1 the optimizer state, 2 also the gradients, 3 also the
parameters. Bytes per parameter (zerolm.plan.spec.PRECISIONS):

    mixed   2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master, Adam m and v)   the paper's K = 12
    fp32    4 (fp32 params) + 4 (fp32 gradient accumulator) + 8 (fp32 Adam m, v)   what zerolm trains

From a config the bytes are exact (`ExactStates`): the very layouts the train step uses, asked of
zerolm.parallel.sharding on an abstract mesh (no devices needed), padding and step counters included; stage 1 at
fp32 is the train state. From a parameter count they are the paper's formulas in N (`AnalyticStates`).
"""

from __future__ import annotations

import dataclasses

from zerolm.plan.spec import BytesPerParam, Model


@dataclasses.dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int


class AnalyticStates:
    """Model-state bytes from the parameter count: the ZeRO paper's formulas (tp splits `tp_split`)."""

    def __init__(self, model: Model, dp: int, tp: int):
        self.full = model.params - model.tp_split + -(-model.tp_split // tp)  # per device, whole over dp
        self.sharded = -(-model.params // (dp * tp))

    def __call__(self, stage: int, p: BytesPerParam) -> StateBytes:
        params = self.sharded if stage >= 3 else self.full
        grads = self.sharded if stage >= 2 else self.full
        opt = self.sharded if stage >= 1 else self.full
        return StateBytes(p.param * params, p.grad * grads, (p.master + p.moments) * opt)


class ExactStates:
    """Model-state bytes of zerolm's own layouts (`zerolm.parallel.sharding.Table` on an abstract mesh)."""

    def __init__(self, table):
        import jax
        import numpy as np
        import optax

        from zerolm.parallel.sharding import abstract_views, shard_bytes, with_shardings

        def cast(tree, dtype):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype, sharding=a.sharding), tree)

        params = with_shardings(table.abstract_params, table.param_shardings)
        views = with_shardings(abstract_views(table.layouts, table.abstract_params), table.view_shardings)
        self._full = {np.dtype(d).itemsize: shard_bytes(cast(params, d)) for d in (np.float32, jax.numpy.bfloat16)}
        self._sharded = {np.dtype(d).itemsize: shard_bytes(cast(views, d)) for d in (np.float32, jax.numpy.bfloat16)}
        opt_whole = jax.eval_shape(table.tx.init, table.abstract_params)
        opt_whole = with_shardings(opt_whole, optax.tree_map_params(
            table.tx, lambda _, s: s, opt_whole, table.param_shardings, transform_non_params=lambda _: table.replicated))
        opt_sharded = with_shardings(jax.eval_shape(table.tx.init, abstract_views(table.layouts, table.abstract_params)),
                                     table.opt_shardings)
        self._adam = {False: shard_bytes(opt_whole), True: shard_bytes(opt_sharded)}

    def __call__(self, stage: int, p: BytesPerParam) -> StateBytes:
        def of(sharded: bool, nbytes: int) -> int:
            return (self._sharded if sharded else self._full)[nbytes] if nbytes else 0
        return StateBytes(of(stage >= 3, p.param), of(stage >= 2, p.grad),
                          of(stage >= 1, p.master) + self._adam[stage >= 1])
