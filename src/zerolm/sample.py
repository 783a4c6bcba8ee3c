"""Text generation from a trained model: a fixed-size, fully jitted sampling loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zerolm.model import GPT


@functools.partial(jax.jit, static_argnames=("model", "n_new"))
def _generate(model: GPT, params, buffer_T: jax.Array, start: jax.Array, n_new: int, temperature, rng):
    """Fill positions start .. start+n_new-1 of a seq_len buffer, one token per full forward pass.

    No KV cache: this is for the short samples printed after training, not for serving.
    """
    def body(i, carry):
        buf, rng = carry
        pos = start + i
        logits_V = model.apply({"params": params}, buf[None])[0, pos - 1]
        rng, key = jax.random.split(rng)
        greedy = jnp.argmax(logits_V)
        sampled = jax.random.categorical(key, logits_V / jnp.maximum(temperature, 1e-6))
        token = jnp.where(temperature > 0, sampled, greedy)
        return buf.at[pos].set(token.astype(buf.dtype)), rng

    buf, _ = jax.lax.fori_loop(0, n_new, body, (buffer_T, rng))
    return buf


def generate(model: GPT, params, prompt_ids: np.ndarray, n_new: int, temperature: float, seed: int = 0) -> np.ndarray:
    """Prompt followed by up to `n_new` sampled tokens (fewer if the context would overflow)."""
    T = model.cfg.seq_len
    prompt_ids = np.asarray(prompt_ids, np.int32)[-(T - 1):]
    n_new = min(n_new, T - len(prompt_ids))
    buf = np.zeros(T, np.int32)
    buf[: len(prompt_ids)] = prompt_ids
    out = _generate(model, params, jnp.asarray(buf), jnp.int32(len(prompt_ids)), n_new,
                    jnp.float32(temperature), jax.random.key(seed))
    return np.asarray(out[: len(prompt_ids) + n_new])
