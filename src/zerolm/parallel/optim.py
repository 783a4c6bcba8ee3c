"""The optimizer: AdamW after global-norm clipping, with warmup and cosine decay; and ZeRO's mixed-precision
form of any optax optimizer, which steps float32 master weights kept in its own state.

zerolm.parallel.zero runs the optimizer on the dp-sharded optimizer-state layout; nothing here knows of meshes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


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
        return jax.tree_util.keystr(path[-1:], simple=True) in ("kernel", "wte", "wpe", "lm_head")
    return jax.tree_util.tree_map_with_path(decays, params)


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
    `Zero.update`). The `params` argument is not read."""
    def init(params):
        return MasterWeights(params, tx.init(params))

    def update(grads, state, params=None):
        del params
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, inner = tx.update(grads, state.inner, state.master)
        return updates, MasterWeights(optax.apply_updates(state.master, updates), inner)

    return optax.GradientTransformation(init, update)
