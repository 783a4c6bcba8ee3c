"""Rotary position embeddings (Su et al. 2021, `model.position: rope`), Llama's rotate-half form: the angles of every
position computed once per forward pass (`rope_angles`), each layer's queries and keys turned by them (`rotate`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Rope(NamedTuple):
    """The rotary embedding's angles, cos and sin (B, T, 1, K/2), of every position of a forward pass."""

    cos: jax.Array
    sin: jax.Array


def rope_angles(positions_BxT: jax.Array, head_dim: int, theta: float) -> Rope:
    """Rotary position embedding (Su et al. 2021)'s angles: dimension pair i of a head turns by position ·
    theta^(-2i/K), in float32. Computed once per forward pass; every layer rotates with them (`rotate`)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_BxTx1xK2 = (positions_BxT.astype(jnp.float32)[:, :, None] * inv_freq)[:, :, None, :]
    return Rope(jnp.cos(angles_BxTx1xK2), jnp.sin(angles_BxTx1xK2))


def rotate(x_BxTxHxK: jax.Array, rope: Rope) -> jax.Array:
    """Llama's rotate-half form (Hugging Face's): dimension i of a head's first half and i of its second are the
    pair `rope`'s angle turns, in float32."""
    x1, x2 = jnp.split(x_BxTxHxK.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin],
                           axis=-1).astype(x_BxTxHxK.dtype)


def rotary(x_BxTxHxK: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
    """`x` rotated by the rotary embedding of `positions` (`rope_angles` then `rotate`)."""
    return rotate(x_BxTxHxK, rope_angles(positions_BxT, x_BxTxHxK.shape[-1], theta))
