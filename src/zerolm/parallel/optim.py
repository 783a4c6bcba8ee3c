"""The optimizer: AdamW after global-norm clipping, with its lr schedule (a linear warmup, then a cosine
decay, warmup-stable-decay or a constant), and (train.ema) an exponential moving average of the parameters
kept in its state; and ZeRO's mixed-precision form of any optax optimizer, which steps float32 master weights
kept in its own state.

zerolm.parallel.zero runs the optimizer on the dp-sharded optimizer-state layout; nothing here knows of meshes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


def make_optimizer(train_cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with train.schedule's lr (lr_schedule), after global-norm clipping; with
    train.skip_nonfinite, wrapped so that an update with a non-finite gradient is skipped and counted."""
    schedule = lr_schedule(train_cfg)
    tx = optax.chain(
        optax.clip_by_global_norm(train_cfg.grad_clip),
        optax.adamw(schedule, b1=train_cfg.beta1, b2=train_cfg.beta2, eps=train_cfg.eps,
                    weight_decay=train_cfg.weight_decay, mask=decay_mask))
    if train_cfg.ema is not None:
        tx = with_ema(tx, train_cfg.ema)
    if train_cfg.skip_nonfinite:  # outside the EMA: a skipped update leaves it as it was
        tx = optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
    return tx, schedule


def lr_schedule(train_cfg) -> optax.Schedule:
    """The lr of the update after `count` updates (optax's count: step s of metrics.jsonl is count s - 1).

    Every schedule warms up linearly from 0 to train.lr over train.warmup_steps. Then, with L the schedule's
    length (train.schedule_steps, else train.steps) and m = lr * min_lr_ratio: cosine decays to m at count L
    (optax's warmup_cosine_decay_schedule); wsd stays at lr until count L - decay_steps, then decays to m at
    count L, linearly or as 1 - sqrt of the decay's fraction done (Hägele et al. 2024, "Scaling Laws and
    Compute-Optimal Training beyond Fixed Training Durations"; MiniCPM 2024); constant stays at lr. Past L,
    cosine and wsd stay at m."""
    lr, warmup = train_cfg.lr, train_cfg.warmup_steps
    end = lr * train_cfg.min_lr_ratio
    if train_cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=lr, warmup_steps=warmup,
                                                  decay_steps=train_cfg.schedule_length, end_value=end)
    decay, sqrt = train_cfg.decay_steps, train_cfg.decay_shape == "sqrt"
    start = train_cfg.schedule_length - (decay or 0)

    def schedule(count):
        t = jnp.asarray(count, jnp.float32)
        value = jnp.where(t < warmup, lr * t / max(warmup, 1), lr)  # lr itself once warm: constant and wsd agree
        if decay is not None:  # wsd (its decay starts after the warmup: zerolm.config.tree.TrainConfig)
            done = jnp.clip((t - start) / decay, 0.0, 1.0)
            value = jnp.where(t > start, end + (lr - end) * (1.0 - (jnp.sqrt(done) if sqrt else done)), value)
        return value

    return schedule


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


class EmaState(NamedTuple):
    """An exponential moving average of the parameters beside the inner optimizer's state, in the optimizer-state
    layout like Adam's moments (so each device holds 1/(dp·tp) of it), always float32."""

    ema_count: jax.Array  # int32: the updates averaged so far
    ema: PyTree  # the average: after the first update, that update's parameters
    inner: optax.OptState


def with_ema(tx: optax.GradientTransformation, decay: float) -> optax.GradientTransformation:
    """`tx`, keeping in its state the exponential moving average (`decay` per update) of the parameters it steps.

    The average is debiased as Adam's moments are: after t updates it is the mean of the t parameters
    θ_1..θ_t weighted by decay^(t-i), the weights summing to 1 (the running update
    ema += (1 - decay) / (1 - decay^t) · (θ_t - ema)), so a run shorter than 1 / (1 - decay) updates
    averages what it visited, not its initialisation. `update` needs the parameters: the float32 ones
    `tx` steps (in mixed precision, with_master_weights hands it the master weights)."""
    decay32 = jnp.float32(decay)

    def init(params):
        return EmaState(jnp.zeros((), jnp.int32), jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params),
                        tx.init(params))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("with_ema needs the parameters its update steps")
        updates, inner = tx.update(grads, state.inner, params)
        count = state.ema_count + 1
        weight = (1 - decay32) / (1 - decay32 ** count.astype(jnp.float32))  # 1 at the first update
        new = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: e + weight * (p.astype(jnp.float32) - e), state.ema, new)
        return updates, EmaState(count, ema, inner)

    return optax.GradientTransformation(init, update)


def _is_state(x) -> bool:
    return isinstance(x, (EmaState, MasterWeights))


def ema_of(opt_state: PyTree) -> PyTree | None:
    """The moving average an optimizer state keeps (with_ema; in the optimizer-state layout), or None."""
    is_ema = lambda x: isinstance(x, EmaState)  # noqa: E731
    found = [s.ema for s in jax.tree.leaves(opt_state, is_leaf=is_ema) if is_ema(s)]
    return found[0] if found else None


def only(opt_state: PyTree, part: Literal["master", "ema"], filler: Any) -> PyTree:
    """`opt_state` (or a tree of its shape: abstract arrays, shardings) with every leaf but those of `part` (the
    master weights of with_master_weights, the moving average of with_ema) replaced by `filler`: a restore target
    that reads that part alone."""
    fill: Callable[[Any], Any] = lambda tree: jax.tree.map(lambda _: filler, tree)  # noqa: E731

    def keep(x):
        if isinstance(x, MasterWeights):
            return MasterWeights(x.master if part == "master" else fill(x.master), only(x.inner, part, filler))
        if isinstance(x, EmaState) and part == "ema":
            return EmaState(filler, x.ema, fill(x.inner))
        return fill(x)

    return jax.tree.map(keep, opt_state, is_leaf=_is_state)
