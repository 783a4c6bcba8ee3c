"""Text generation with a KV cache: a prompt's positions run once (prefill), then each new token costs
one position's compute. Jitted and compiled once per prompt-length bucket (powers of two), whatever
the number of new tokens or the sampling settings, which are traced values.

Sampling: temperature 0 is greedy (argmax); otherwise the logits are divided by the temperature,
cut to the `top_k` most likely tokens (0: no cut) and to the smallest set whose probability reaches
`top_p` (1: no cut), and a token is drawn. Generation stops after `max_new_tokens`, at the end of
the context, or after an end-of-text token (which is kept).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zerolm.core.errors import UsageError
from zerolm.model.decoder import GPT, init_cache, output_embedding, output_logits

MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise UsageError(f"--temperature: {self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise UsageError(f"--top-k: {self.top_k} must be >= 0 (0: no cut)")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p: {self.top_p} must be in (0, 1] (1: no cut)")


def pick(logits_V: jax.Array, key: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """One token from float32 logits: greedy at temperature 0, else top-k / top-p sampling."""
    V = logits_V.shape[-1]
    scaled_V = logits_V / jnp.maximum(temperature, 1e-6)
    sorted_V = jnp.sort(scaled_V)[::-1]
    kth = sorted_V[jnp.clip(top_k - 1, 0, V - 1)]
    scaled_V = jnp.where((top_k > 0) & (scaled_V < kth), -jnp.inf, scaled_V)
    # top-p: keep the most likely tokens until their probability reaches top_p (the one that crosses it too).
    probs_V = jax.nn.softmax(jnp.where((top_k > 0) & (sorted_V < kth), -jnp.inf, sorted_V))
    before_V = jnp.cumsum(probs_V) - probs_V
    threshold = jnp.min(jnp.where(before_V < top_p, sorted_V, jnp.inf))
    scaled_V = jnp.where(scaled_V < threshold, -jnp.inf, scaled_V)
    sampled = jax.random.categorical(key, scaled_V)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits_V)).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Decode:
    """One generation's settings, as traced values (int32 scalars, float32 for the sampling's floats): a new
    value compiles nothing."""

    prompt_len: jax.Array  # the prompt's tokens, before its padding to the bucket
    n_new: jax.Array  # at most this many new tokens
    eot_id: jax.Array  # stop after this token (-1: none)
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    rng: jax.Array  # a typed key


@functools.partial(jax.jit, static_argnames=("model",))
def _generate(model: GPT, params, prompt_P: jax.Array, decode: _Decode):
    """The prompt (padded to a bucket of P) then up to `decode.n_new` tokens, in a seq_len buffer; and how
    many tokens the buffer holds."""
    prompt_len, n_new, eot_id = decode.prompt_len, decode.n_new, decode.eot_id
    T = model.cfg.seq_len
    vocab = model.cfg.vocab

    def logits_at(cache, tokens_1xS, start, last):
        x_1xSxD, variables = model.apply({"params": params, "cache": cache}, tokens_1xS, start=start,
                                         hidden_only=True, mutable=["cache"])
        return output_logits(x_1xSxD[0, last], output_embedding(params), vocab), variables["cache"]

    # Prefill: the padding after the prompt is written into the cache too, but no query sees it before
    # a generated token overwrites it (each query sees only positions up to its own).
    logits_V, cache = logits_at(init_cache(model, 1), prompt_P[None], jnp.int32(0), prompt_len - 1)
    buf_T = jnp.zeros(T, jnp.int32).at[:prompt_P.shape[0]].set(prompt_P)

    def not_done(carry):
        i, _, _, _, done, _ = carry
        return (i < n_new) & ~done

    def step(carry):
        i, cache, buf_T, logits_V, _, rng = carry
        rng, key = jax.random.split(rng)
        token = pick(logits_V, key, decode.temperature, decode.top_k, decode.top_p)
        pos = prompt_len + i
        buf_T = buf_T.at[pos].set(token)
        logits_V, cache = logits_at(cache, token.reshape(1, 1), pos, 0)
        return i + 1, cache, buf_T, logits_V, token == eot_id, rng

    n, _, buf_T, _, _, _ = lax.while_loop(not_done, step, (jnp.int32(0), cache, buf_T, logits_V, False, decode.rng))
    return buf_T, prompt_len + n


def bucket(n: int, seq_len: int) -> int:
    """The padded prompt length: the next power of two (at least MIN_BUCKET), at most seq_len."""
    return min(seq_len, max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()))


def generate(model: GPT, params, prompt_ids, max_new_tokens: int, sampling: Sampling = Sampling(),
             eot_id: int = -1) -> np.ndarray:
    """The prompt followed by up to `max_new_tokens` new tokens (fewer at the end of the context or
    after `eot_id`). The prompt must leave room for one token; an empty prompt starts at `eot_id`."""
    T = model.cfg.seq_len
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    if prompt.size == 0:
        prompt = np.asarray([max(eot_id, 0)], np.int32)
    if prompt.size >= T:
        raise UsageError(f"the prompt has {prompt.size} tokens; the model's context is {T} (model.seq_len), "
                         f"so at most {T - 1} leave room to generate")
    n_new = max(0, min(max_new_tokens, T - prompt.size))
    padded = np.zeros(bucket(prompt.size, T), np.int32)
    padded[:prompt.size] = prompt
    decode = _Decode(jnp.int32(prompt.size), jnp.int32(n_new), jnp.int32(eot_id), jnp.float32(sampling.temperature),
                     jnp.int32(sampling.top_k), jnp.float32(sampling.top_p), jax.random.key(sampling.seed))
    buf, length = _generate(model, params, jnp.asarray(padded), decode)
    return np.asarray(buf)[: int(length)]
