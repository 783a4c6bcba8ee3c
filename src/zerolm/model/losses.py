"""The language-model losses: per-token cross-entropy (plain, or chunked over the vocabulary's logits) for
evaluation, and the training loss, fused with its gradient chunk by chunk so that no float32
tokens × vocabulary logits outlive their chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zerolm.model.decoder import GPT, output_embedding, output_logits


def token_cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Per-token next-token loss, gathering the target logit instead of building a one-hot over the vocabulary."""
    lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    target_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return lse_BxT - target_BxT


def _chunks(x_BxTxD: jax.Array, targets_BxT: jax.Array, chunk: int):
    """Flatten tokens and split them into chunks (the last padded), with a mask of the real ones."""
    B, T, D = x_BxTxD.shape
    n = B * T
    pad = -n % chunk
    x_CxKxD = jnp.pad(x_BxTxD.reshape(n, D), ((0, pad), (0, 0))).reshape(-1, chunk, D)
    t_CxK = jnp.pad(targets_BxT.reshape(n), (0, pad)).reshape(-1, chunk)
    real_CxK = (jnp.arange(n + pad) < n).reshape(-1, chunk)
    return x_CxKxD, t_CxK, real_CxK


def chunked_token_cross_entropy(x_BxTxD: jax.Array, wte_VxD: jax.Array, targets_BxT: jax.Array, vocab_size: int,
                                chunk: int) -> jax.Array:
    """`token_cross_entropy(output_logits(x))`, `chunk` tokens at a time.

    Each chunk's logits are made, reduced to a loss and dropped; the backward pass makes them again
    (`jax.checkpoint`), so at most one chunk of float32 logits exists, never the micro-batch's
    tokens × vocabulary."""
    B, T, _ = x_BxTxD.shape
    x_CxKxD, t_CxK, _ = _chunks(x_BxTxD, targets_BxT, chunk)

    @jax.checkpoint
    def chunk_losses(x_KxD, t_K):
        return token_cross_entropy(output_logits(x_KxD, wte_VxD, vocab_size), t_K)

    losses_CxK = lax.map(lambda xt: chunk_losses(*xt), (x_CxKxD, t_CxK))
    return losses_CxK.reshape(-1)[:B * T].reshape(B, T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fused_mean_cross_entropy(x_BxTxD: jax.Array, wte_VxD: jax.Array, targets_BxT: jax.Array, vocab_size: int,
                             chunk: int) -> jax.Array:
    """`mean(token_cross_entropy(output_logits(x)))` with its gradient made in the same pass.

    Chunk by chunk, the float32 logits give the loss and, while they exist, the gradient of the mean
    with respect to x and the output layer (softmax − one-hot, times the other operand). Nothing of
    the size tokens × vocabulary outlives its chunk, and the backward pass only scales the saved
    gradients by the incoming cotangent: no logits are recomputed (as they would be under
    `jax.checkpoint`, at 2·V·d more FLOPs per token)."""
    return _fused_forward(x_BxTxD, wte_VxD, targets_BxT, vocab_size, chunk)[0]


def lse_and_target(logits_KxV: jax.Array, t_K: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's log-sum-exp and its target's logit, in one pass over the logits: a reduction of (running max,
    sum of exponentials below it, the target's logit) pairs, as online softmax combines them, where
    `jax.nn.logsumexp` and a gather read the float32 logits three times (its max, its sum, the target's one-hot
    select), which on a GPU is a quarter of a small model's non-matmul bytes."""
    def combine(a, b):
        (m_a, s_a, t_a), (m_b, s_b, t_b) = a, b
        m = jnp.maximum(m_a, m_b)
        return m, s_a * jnp.exp(m_a - m) + s_b * jnp.exp(m_b - m), t_a + t_b

    target_KxV = jnp.where(jnp.arange(logits_KxV.shape[1])[None, :] == t_K[:, None], logits_KxV, 0.0)
    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0))
    m_K, s_K, target_K = lax.reduce((logits_KxV, jnp.ones_like(logits_KxV), target_KxV), init, combine, (1,))
    return m_K + jnp.log(s_K), target_K


def _fused_forward(x_BxTxD, wte_VxD, targets_BxT, vocab_size, chunk):
    x_CxKxD, t_CxK, real_CxK = _chunks(x_BxTxD, targets_BxT, chunk)
    n = targets_BxT.size
    wte_c = wte_VxD.astype(x_BxTxD.dtype)

    def one(dwte_VxD, xtm):
        x_KxD, t_K, real_K = xtm
        logits_KxV = output_logits(x_KxD, wte_VxD, vocab_size)
        lse_K, target_K = lse_and_target(logits_KxV, t_K)
        loss = jnp.sum(jnp.where(real_K, lse_K - target_K, 0.0))
        # d(mean loss)/d logits = (softmax - one_hot(target)) / n, zero on padding rows: one elementwise pass
        # over the logits (the one-hot as a comparison, not a scatter), written in the compute dtype.
        p_KxV = jnp.exp(logits_KxV - lse_K[:, None])
        one_hot_KxV = jnp.arange(logits_KxV.shape[1])[None, :] == t_K[:, None]
        d_KxV = (jnp.where(one_hot_KxV, p_KxV - 1.0, p_KxV) * (real_K[:, None] / n)).astype(x_KxD.dtype)
        dx_KxD = jnp.einsum("kv,vd->kd", d_KxV, wte_c, preferred_element_type=jnp.float32)
        dwte_VxD = dwte_VxD + jnp.einsum("kv,kd->vd", d_KxV, x_KxD, preferred_element_type=jnp.float32)
        return dwte_VxD, (loss, dx_KxD)

    # zeros_like, not zeros: inside shard_map the carry must be as device-varying as wte's gradient.
    dwte, (losses_C, dx_CxKxD) = lax.scan(one, jnp.zeros_like(wte_VxD, jnp.float32), (x_CxKxD, t_CxK, real_CxK))
    dx_BxTxD = dx_CxKxD.reshape(-1, x_BxTxD.shape[-1])[:n].reshape(x_BxTxD.shape).astype(x_BxTxD.dtype)
    return jnp.sum(losses_C) / n, (dx_BxTxD, dwte.astype(wte_VxD.dtype), targets_BxT)


def _fused_backward(vocab_size, chunk, residuals, g):
    dx_BxTxD, dwte_VxD, targets_BxT = residuals
    zero_targets = np.zeros(targets_BxT.shape, jax.dtypes.float0)  # integer input: no gradient
    return (dx_BxTxD * g.astype(dx_BxTxD.dtype), dwte_VxD * g.astype(dwte_VxD.dtype), zero_targets)


fused_mean_cross_entropy.defvjp(_fused_forward, _fused_backward)


def token_losses(model: GPT, params, tokens_BxT1: jax.Array) -> jax.Array:
    """(B, seq_len) losses of a packed batch of seq_len + 1 tokens: inputs are [:-1], targets [1:]."""
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    chunk = model.cfg.loss_chunk
    if not chunk or chunk >= targets_BxT.size:
        return token_cross_entropy(_apply(model, params, inputs_BxT), targets_BxT)
    x_BxTxD = _apply(model, params, inputs_BxT, hidden_only=True)
    return chunked_token_cross_entropy(x_BxTxD, output_embedding(params), targets_BxT, model.cfg.vocab_size, chunk)


def _apply(model: GPT, params, inputs_BxT: jax.Array, **kw) -> jax.Array:
    """The model's output (logits, or hidden states with hidden_only), no state mutated."""
    out = model.apply({"params": params}, inputs_BxT, **kw)
    assert isinstance(out, jax.Array)
    return out


def lm_loss(model: GPT, params, tokens_BxT1: jax.Array, layer_params=None, dropout_keys=None) -> jax.Array:
    """Mean loss of a packed batch of seq_len + 1 tokens: the training loss (fused, and chunked when the
    micro-batch has more tokens than model.loss_chunk; plain autodiff when it is 0). `layer_params`: what
    each layer applies to its stored parameters (ZeRO-3's gather: zerolm.model.decoder.GPT.layer_params).
    `dropout_keys`: each sample's key, for the model's dropout (zerolm.model.dropout); None: none."""
    if layer_params is not None:
        model = model.clone(layer_params=layer_params)
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    chunk = model.cfg.loss_chunk
    if not chunk:
        return jnp.mean(token_cross_entropy(_apply(model, params, inputs_BxT, dropout_keys=dropout_keys),
                                            targets_BxT))
    # A micro-batch of at most one chunk is one chunk: still fused, so autodiff keeps no extra copy of
    # the float32 logits (the TPU compiler's buffer assignment showed three).
    x_BxTxD = model.apply({"params": params}, inputs_BxT, hidden_only=True, dropout_keys=dropout_keys)
    return fused_mean_cross_entropy(x_BxTxD, output_embedding(params), targets_BxT, model.cfg.vocab_size,
                                    min(chunk, targets_BxT.size))
