"""Causal self-attention, by implementation: XLA's, cuDNN's flash attention, or a blockwise attention in
plain JAX that never holds the T×T scores (any backend; the TPU's choice).

Pallas's TPU flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`, v4 and later) is not
offered: inside the step's `shard_map` its `pallas_call` fails JAX's varying-axes check (its output
shapes carry no `manual_axis_type`), and v3's Mosaic refuses its bfloat16 matmuls anyway.

`blockwise` (Rabe & Staats 2021, "Self-attention does not need O(n²) memory"; the backward pass of
Dao 2023, FlashAttention-2): queries and keys are cut into blocks of `block` positions. For each query
block, a loop over the key blocks at or before it keeps a running maximum, the softmax denominator and
the weighted sum of values (the online softmax), so a step holds one block of scores. The backward pass
is its own (`jax.custom_vjp`): it keeps only the output and the per-row log-sum-exp from the forward
pass and rebuilds each block's probabilities from them, so neither pass stores anything of size T×T.
Blocks after the query block are skipped (causal), which halves the work of a full square.

All implementations take and give (batch, time, heads, head_dim).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

IMPLEMENTATIONS = ("xla", "cudnn", "blockwise")
BLOCK = 512  # positions per query/key block of the blockwise attention
_MASKED = -1e30  # finite, so that a fully masked block's max minus itself is 0, not nan


def causal_attention(q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array, implementation: str,
                     block: int = BLOCK) -> jax.Array:
    if implementation in ("xla", "cudnn"):
        return jax.nn.dot_product_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, is_causal=True,
                                            implementation=implementation)
    if implementation == "blockwise":
        return blockwise_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, block_size(q_BxTxHxK.shape[1], block))
    raise ValueError(f"unknown attention implementation {implementation!r}; one of {', '.join(IMPLEMENTATIONS)}")


def block_size(seq_len: int, block: int = BLOCK) -> int:
    """The largest block ≤ `block` that divides the sequence."""
    return math.gcd(seq_len, block)


def _blocks(x_BxTxHxK, block):
    """(B, T, H, K) -> (T/block, B, H, block, K)."""
    B, T, H, K = x_BxTxHxK.shape
    return x_BxTxHxK.reshape(B, T // block, block, H, K).transpose(1, 0, 3, 2, 4)


def _unblocks(x_NxBxHxCxK):
    N, B, H, C, K = x_NxBxHxCxK.shape
    return x_NxBxHxCxK.transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, K)


def _scores(q_BxHxCxK, k_BxHxCxK, i, j, block):
    """One block of scaled, causally masked float32 scores: query block i against key block j."""
    s = jnp.einsum("bhqk,bhsk->bhqs", q_BxHxCxK, k_BxHxCxK, preferred_element_type=jnp.float32)
    s = s / math.sqrt(q_BxHxCxK.shape[-1])
    visible_CxC = (i * block + jnp.arange(block))[:, None] >= (j * block + jnp.arange(block))[None, :]
    return jnp.where(visible_CxC, s, _MASKED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def blockwise_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, block: int):
    """Causal softmax(q kᵀ/√K) v, `block` positions at a time (`block` divides T)."""
    return _forward(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, block)[0]


def _forward(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, block):
    qs, ks, vs = (_blocks(x, block) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK))

    def query_block(_, iq):
        i, q_BxHxCxK = iq

        def key_block(j, carry):
            m_BxHxC, l_BxHxC, acc_BxHxCxK = carry
            s = _scores(q_BxHxCxK, ks[j], i, j, block)
            m_new = jnp.maximum(m_BxHxC, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m_BxHxC - m_new)
            l_BxHxC = l_BxHxC * correction + p.sum(-1)
            pv = jnp.einsum("bhqs,bhsk->bhqk", p.astype(vs.dtype), vs[j], preferred_element_type=jnp.float32)
            return m_new, l_BxHxC, acc_BxHxCxK * correction[..., None] + pv

        # *_like: inside shard_map the carries must be as device-varying as the queries.
        row = jnp.zeros_like(q_BxHxCxK[..., 0], jnp.float32)
        init = (row + _MASKED, row, jnp.zeros_like(q_BxHxCxK, jnp.float32))
        m, l, acc = lax.fori_loop(0, i + 1, key_block, init)  # key blocks 0..i: the causal ones
        return None, ((acc / l[..., None]).astype(q_BxHxCxK.dtype), m + jnp.log(l))

    _, (out_NxBxHxCxK, lse_NxBxHxC) = lax.scan(query_block, None, (jnp.arange(qs.shape[0]), qs))
    out = _unblocks(out_NxBxHxCxK)
    return out, (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, out, lse_NxBxHxC)


def _backward(block, residuals, dout_BxTxHxK):
    q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, out, lse_NxBxHxC = residuals
    qs, ks, vs, dos = (_blocks(x, block) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, dout_BxTxHxK))
    # D = rowsum(dO ∘ O): the softmax's backward term, one number per query.
    d_NxBxHxC = _blocks((dout_BxTxHxK.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1, keepdims=True),
                        block)[..., 0]
    scale = 1.0 / math.sqrt(q_BxTxHxK.shape[-1])

    def query_block(carry, inputs):
        dk_acc, dv_acc = carry  # (N, B, H, C, K) float32, over every key block
        i, q_BxHxCxK, do_BxHxCxK, lse_BxHxC, d_BxHxC = inputs

        def key_block(j, inner):
            dq_BxHxCxK, dk_acc, dv_acc = inner
            p = jnp.exp(_scores(q_BxHxCxK, ks[j], i, j, block) - lse_BxHxC[..., None])  # masked: exactly 0
            dv = jnp.einsum("bhqs,bhqk->bhsk", p.astype(do_BxHxCxK.dtype), do_BxHxCxK,
                            preferred_element_type=jnp.float32)
            dp = jnp.einsum("bhqk,bhsk->bhqs", do_BxHxCxK, vs[j], preferred_element_type=jnp.float32)
            ds = (p * (dp - d_BxHxC[..., None]) * scale).astype(q_BxHxCxK.dtype)
            dq_BxHxCxK = dq_BxHxCxK + jnp.einsum("bhqs,bhsk->bhqk", ds, ks[j], preferred_element_type=jnp.float32)
            dk = jnp.einsum("bhqs,bhqk->bhsk", ds, q_BxHxCxK, preferred_element_type=jnp.float32)
            return dq_BxHxCxK, dk_acc.at[j].add(dk), dv_acc.at[j].add(dv)

        dq = jnp.zeros_like(q_BxHxCxK, jnp.float32)
        dq, dk_acc, dv_acc = lax.fori_loop(0, i + 1, key_block, (dq, dk_acc, dv_acc))
        return (dk_acc, dv_acc), dq

    zeros = jnp.zeros_like(ks, jnp.float32)
    (dk, dv), dq = lax.scan(query_block, (zeros, zeros),
                            (jnp.arange(qs.shape[0]), qs, dos, lse_NxBxHxC, d_NxBxHxC))
    return tuple(_unblocks(g).astype(x.dtype) for g, x in ((dq, q_BxTxHxK), (dk, k_BxTxHxK), (dv, v_BxTxHxK)))


blockwise_attention.defvjp(_forward, _backward)
