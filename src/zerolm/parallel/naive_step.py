"""The baseline the design avoids: data parallelism as one plain `jax.jit`, the accumulation scan inside.

XLA's partitioner reduces the gradients on every micro-step and keeps a replicated optimizer state.
Kept for the benchmarks' comparison (benchmarks/measure/zero_step.py) and as the negative control of the
collective checks (`zerolm comms --step naive`, the tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerolm.parallel import sharding
from zerolm.parallel.zero import LossFn, Zero


def naive_data_parallel_step(mesh: Mesh, loss_fn: LossFn, tx: optax.GradientTransformation):
    """The naive step (the module docstring): (params, opt_state, batch) -> (params, opt_state, metrics),
    params and optimizer state replicated, the batch split over dp."""
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


def naive_text(zero: Zero, loss_fn, micro_batch: int, seq_len: int, accum_steps: int) -> str:
    """The optimized HLO of the naive step on zero's mesh, for a run's shapes: params and optimizer state
    replicated, the batch split over dp."""
    def replicated(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=zero.table.replicated), tree)

    batch = jax.ShapeDtypeStruct((accum_steps, zero.table.dp * micro_batch, seq_len + 1), np.int32,
                                 sharding=zero.table.batch_sharding)
    step = naive_data_parallel_step(zero.mesh, loss_fn, zero.tx)
    return step.lower(replicated(zero.abstract_params), replicated(jax.eval_shape(zero.tx.init, zero.abstract_params)),
                      batch).compile().as_text()
