"""Dropout whose masks are a function of what they randomise, never of the device that holds it.

Each training sample gets a key from (seed, step, its index in the step's global batch) (`row_keys`), and
each mask from that key and where it is used: the layer and the site (`keep`). A sample's masks are therefore
the same whether the run has 1 device or 64, at any ZeRO stage and tp, and after a resume: the sharded step
equals one device, and a kill -9 resume is bit-identical. Evaluation, sampling and export pass no keys: no
dropout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

STREAM = 0x5EED  # folded into the run's seed, so the masks are independent of the initialisation's draws
# Sites: what a mask drops, folded into a layer's key (the embeddings' mask into a layer slot no layer has).
EMBEDDING, ATTENTION_OUT, MLP_OUT, ATTENTION_PROBS = range(4)
EMBEDDING_LAYER = 1 << 30


def row_keys(seed: int, step: jax.Array, first_row: jax.Array, rows: int) -> jax.Array:
    """The keys of `rows` consecutive samples of step `step`'s global batch, from row `first_row` on."""
    base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), STREAM), step)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(first_row + jnp.arange(rows))


def keep(keys_B: jax.Array, rate: float, shape: tuple[int, ...], *where: jax.Array | int) -> jax.Array:
    """(B, *shape) booleans: which entries survive, for each sample's key folded with `where` (layer, site, ...)."""
    def one(key):
        for w in where:
            key = jax.random.fold_in(key, w)
        return jax.random.bernoulli(key, 1.0 - rate, shape)
    return jax.vmap(one)(keys_B)


def drop(x_BxN: jax.Array, keys_B: jax.Array | None, rate: float, *where: jax.Array | int) -> jax.Array:
    """Inverted dropout of x (batch first): each sample's own mask, survivors scaled by 1 / (1 - rate)."""
    if keys_B is None or rate == 0:
        return x_BxN
    mask = keep(keys_B, rate, x_BxN.shape[1:], *where)
    return jnp.where(mask, x_BxN / (1.0 - rate), 0).astype(x_BxN.dtype)


def has_dropout(model_cfg) -> bool:
    """Whether a model config (zerolm.config.model.ModelConfig) drops anything in training."""
    return bool(model_cfg.embedding_dropout or model_cfg.residual_dropout or model_cfg.attention_dropout)
