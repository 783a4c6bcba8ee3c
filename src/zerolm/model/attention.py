"""Causal self-attention, by implementation: XLA's, cuDNN's flash attention (GPU), Pallas's flash attention
(TPU v4 and later), or a blockwise attention in plain JAX that never holds the T×T scores (any backend;
TPU v2/v3's choice, whose Mosaic compiler refuses Pallas's bfloat16 kernels).

`pallas`: `jax.experimental.pallas.ops.tpu.flash_attention`, wrapped for zerolm's step. Inside the step's
`shard_map` JAX checks how every value varies over the mesh axes, and the kernel's output shapes do not
say (no `manual_axis_type`), so the kernel runs in a nested `shard_map` over no axes with that check off,
and its outputs are declared as varying as its inputs (`_unchecked`). JAX's own backward of the kernel
would be traced outside that region, so the forward and backward are wired here (`jax.custom_vjp`) to
the module's forward-with-residuals and backward functions (`_flash_attention`,
`_flash_attention_bwd`: private names of an example module; `pallas_available` says whether this JAX
still has them, and `auto` falls back to `blockwise` when it does not).

`blockwise` (Rabe & Staats 2021, "Self-attention does not need O(n²) memory"; the backward pass of
Dao 2023, FlashAttention-2): queries and keys are cut into blocks of `block` positions. For each query
block, a loop over the key blocks at or before it keeps a running maximum, the softmax denominator and
the weighted sum of values (the online softmax), so a step holds one block of scores. The backward pass
is its own (`jax.custom_vjp`): it keeps only the output and the per-row log-sum-exp from the forward
pass and rebuilds each block's probabilities from them, so neither pass stores anything of size T×T.
Blocks after the query block are skipped (causal), which halves the work of a full square.

All implementations take and give (batch, time, heads, head_dim), and take optional segment ids,
(batch, time) integers: a query then attends only to keys of its own segment (a document of a packed
sample: `model.document_mask`). XLA's attention takes them as a mask, the blockwise attention masks
each block's scores with them, Pallas's kernel takes them as its `SegmentIds`, cuDNN's flash attention
as an additive bias of the compute dtype (`jax.nn.dot_product_attention` turns the boolean mask into
one; still the fused kernel: on an H100, 1.5 ms against XLA's masked 6.4 ms for a forward and backward
pass at 125m's shapes, `benchmarks/experiments/attention_mask.py`). The blockwise and Pallas attentions still
compute every causal block (none is skipped for lying wholly in earlier documents), so masking costs
no memory beyond the ids and about no time.

ALiBi (Press et al. 2022, `model.position: alibi`): each head h adds slope_h · (j − i) to the score of
query i on key j (j ≤ i), its slopes the paper's (`alibi_slopes`). The blockwise attention computes it
inside each block from the positions (nothing T×T is stored); XLA's and cuDNN's take it as one
(1, heads, T, T) bias for the whole batch, built once per call and broadcast over it (XLA fuses it into
the scores; cuDNN reads it). Pallas's kernel would need it as a dense (batch, heads, T, T) array per
example, so ALiBi does not run there (zerolm.config.model refuses the pair; auto picks blockwise).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

IMPLEMENTATIONS = ("xla", "cudnn", "pallas", "blockwise")
BLOCK = 512  # positions per query/key block of the blockwise and Pallas attentions
PALLAS_LANES = 128  # the Pallas kernel's blocks are multiples of the TPU's 128 lanes
_MASKED = -1e30  # finite, so that a fully masked block's max minus itself is 0, not nan
# The names of what an attention's backward pass starts from (its output, and its softmax statistics), so
# that a remat policy can keep them (zerolm.model.decoder.REMAT_POLICIES) rather than run the attention again.
SAVED = ("attention_out", "attention_stats")


def alibi_slopes(n_head: int) -> np.ndarray:
    """ALiBi's per-head slopes (Press et al. 2022): for 2^k heads the geometric sequence starting at
    2^(-8/n) with that ratio; otherwise those of the nearest smaller power of two, then every other slope
    of the next power of two's sequence for the remaining heads (the paper's code)."""
    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    below = 2 ** int(math.floor(math.log2(n_head)))
    slopes = geometric(below) + geometric(2 * below)[0::2][: n_head - below]
    return np.asarray(slopes, np.float32)


def alibi_bias(slopes_H: jax.Array, query_positions_S: jax.Array, key_positions_T: jax.Array) -> jax.Array:
    """(1, H, S, T) float32: slope_h · (key position − query position). Every attention takes ALiBi's bias from
    here: XLA's and cuDNN's over the whole sequence, the blockwise attention block by block, decoding over the
    cache."""
    distance_SxT = (key_positions_T[None, :] - query_positions_S[:, None]).astype(jnp.float32)
    return slopes_H[None, :, None, None] * distance_SxT[None, None]


def same_segment(query_ids_BxS: jax.Array, key_ids_BxT: jax.Array) -> jax.Array:
    """(B, 1, S, T): whether each query and key are of one document (the document mask's segment ids)."""
    return query_ids_BxS[:, None, :, None] == key_ids_BxT[:, None, None, :]


class Dropout(NamedTuple):
    """Attention dropout in training: each sample's key (B,), the layer, the rate (zerolm.model.dropout)."""

    keys_B: jax.Array
    layer: jax.Array
    rate: float


class Bias(NamedTuple):
    """What an attention adds to causality: the document mask's segment ids (B, T), ALiBi's slopes (H,), and
    the dropout of its probabilities."""

    segment_ids_BxT: jax.Array | None = None
    slopes_H: jax.Array | None = None
    dropout: Dropout | None = None


NO_BIAS = Bias()


class Positions(NamedTuple):
    """Where queries and keys sit: in training one sequence, both (T,) from 0; decoding each row's queries at its own
    positions (B, S) and the keys of a KV cache at theirs (T,), a query seeing the keys at or before it (what a row
    left past its query is never read)."""

    queries: jax.Array  # (S,) or (B, S)
    keys_T: jax.Array


def causal_attention(q_BxTxHxK: jax.Array, k_BxTxGxK: jax.Array, v_BxTxGxK: jax.Array, implementation: str,
                     block: int = BLOCK, bias: Bias = NO_BIAS) -> jax.Array:
    """softmax(q kᵀ/√K [+ ALiBi's bias]) v over the keys at or before each query [of its own segment], by
    `implementation`; G = key/value heads, each read by H / G query heads."""
    segment_ids_BxT, slopes_H, dropout = bias
    T = q_BxTxHxK.shape[1]
    if implementation == "xla":
        positions_T = jnp.arange(T)
        visible = positions_T[None, :] <= positions_T[:, None]
        if segment_ids_BxT is not None:
            visible = visible & same_segment(segment_ids_BxT, segment_ids_BxT)[:, :, None]
        k_BxGxTxK, v_BxGxTxK = (x.transpose(0, 2, 1, 3) for x in (k_BxTxGxK, v_BxTxGxK))
        return checkpoint_name(attend(q_BxTxHxK, k_BxGxTxK, v_BxGxTxK, visible, bias,
                                      Positions(positions_T, positions_T)), SAVED[0])
    if implementation == "cudnn":
        same_Bx1xTxT = None
        if segment_ids_BxT is not None:  # cuDNN's takes it as an additive bias
            same_Bx1xTxT = same_segment(segment_ids_BxT, segment_ids_BxT)
        alibi_1xHxTxT = None
        if slopes_H is not None:  # one (1, H, T, T) bias for the whole batch
            alibi_1xHxTxT = alibi_bias(slopes_H, jnp.arange(T), jnp.arange(T)).astype(q_BxTxHxK.dtype)
        return checkpoint_name(jax.nn.dot_product_attention(
            q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, bias=alibi_1xHxTxT, mask=same_Bx1xTxT, is_causal=True,
            implementation="cudnn"), SAVED[0])
    if implementation == "blockwise":
        return blockwise_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, bias, block_size(T, block))
    if slopes_H is not None or dropout is not None:
        raise ValueError("ALiBi and attention dropout run in the xla and blockwise attentions (ALiBi also in cudnn), "
                         "not in pallas's kernel")
    if implementation == "pallas":
        # The kernel takes as many key/value heads as query heads: grouped ones are repeated for it.
        groups = q_BxTxHxK.shape[2] // k_BxTxGxK.shape[2]
        k_BxTxHxK, v_BxTxHxK = (jnp.repeat(x, groups, axis=2) if groups > 1 else x for x in (k_BxTxGxK, v_BxTxGxK))
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK))  # the kernel's (B, H, T, K)
        return pallas_attention(q, k, v, segment_ids_BxT, block_size(q_BxTxHxK.shape[1], block)).transpose(0, 2, 1, 3)
    raise ValueError(f"unknown attention implementation {implementation!r}; one of {', '.join(IMPLEMENTATIONS)}")


def cached_attention(q_BxSxHxK: jax.Array, k_BxGxTxK: jax.Array, v_BxGxTxK: jax.Array, positions: Positions,
                     slopes_H: jax.Array | None = None) -> jax.Array:
    """Decoding: the queries of each row's new positions over the row's KV cache (laid out (B, G, T, K), as the
    products read it: no copy transposed); XLA's attention, `attend`, with the keys each query sees by position."""
    visible_BxSxT = positions.keys_T[None, None, :] <= positions.queries[:, :, None]
    return attend(q_BxSxHxK, k_BxGxTxK, v_BxGxTxK, visible_BxSxT[:, None, None], Bias(None, slopes_H), positions)


def attend(q_BxSxHxK: jax.Array, k_BxGxTxK: jax.Array, v_BxGxTxK: jax.Array, visible: jax.Array, bias: Bias,
           positions: Positions) -> jax.Array:
    """XLA's attention written out, the one that training's `xla`, its evaluation and decoding all run: float32
    scores scaled by 1/√K, ALiBi's bias (`with_alibi`), the keys a query may not see at _MASKED, the softmax, and
    in training the probabilities' dropout (each sample's (H, S, T) mask from its key, the layer and the site:
    zerolm.model.dropout.keep). `visible` broadcasts to (B, G, H/G, S, T)."""
    B, S, H, K = q_BxSxHxK.shape
    G = k_BxGxTxK.shape[1]  # query head h reads key/value head h // (H / G)
    q_BxGxRxSxK = q_BxSxHxK.reshape(B, S, G, H // G, K).transpose(0, 2, 3, 1, 4)
    s = jnp.einsum("bgrsk,bgtk->bgrst", q_BxGxRxSxK, k_BxGxTxK, preferred_element_type=jnp.float32) / math.sqrt(K)
    s = with_alibi(s.reshape(B, H, S, -1), bias.slopes_H, positions).reshape(s.shape)
    p = jax.nn.softmax(jnp.where(visible, s, _MASKED), axis=-1)
    if bias.dropout is not None:
        from zerolm.model import dropout as dropout_lib

        keys_B, layer, rate = bias.dropout
        p = dropout_lib.drop(p.reshape(B, H, S, -1), keys_B, rate, layer, dropout_lib.ATTENTION_PROBS).reshape(p.shape)
    out = jnp.einsum("bgrst,bgtk->bgrsk", p.astype(v_BxGxTxK.dtype), v_BxGxTxK)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, S, H, K).astype(q_BxSxHxK.dtype)


def with_alibi(scores_BxHxSxT: jax.Array, slopes_H: jax.Array | None, positions: Positions) -> jax.Array:
    """The scores plus ALiBi's bias (`alibi_bias`) where the model has slopes; as they are otherwise. The one way
    an attention applies it: XLA's and decoding's over all their keys, the blockwise attention block by block
    (cuDNN's takes the bias itself)."""
    if slopes_H is None:
        return scores_BxHxSxT
    if positions.queries.ndim == 1:
        return scores_BxHxSxT + alibi_bias(slopes_H, positions.queries, positions.keys_T)
    bias_BxHxSxT = jax.vmap(alibi_bias, (None, 0, None))(slopes_H, positions.queries, positions.keys_T)[:, 0]
    return scores_BxHxSxT + bias_BxHxSxT


def _dropped(p, bias: Bias, i, j):
    """Block (i, j) of the probabilities after the blockwise attention's dropout (as is without one)."""
    if bias.dropout is None:
        return p
    from zerolm.model import dropout as dropout_lib

    keys_B, layer, rate = bias.dropout
    keep = dropout_lib.keep(keys_B, rate, p.shape[1:], layer, dropout_lib.ATTENTION_PROBS, i, j)
    return jnp.where(keep, p / (1.0 - rate), 0.0)


# The name scope of the blockwise attention's key-block loops: query block i reads key blocks 0..i, a trip count
# the compiler cannot state (its bound is the query loop's index + 1). zerolm.compile.hlo counts a loop in this scope at
# the mean of its trip counts, (N + 1) / 2 of N blocks, for the FLOPs of zerolm.compile.step_time.
TRIANGULAR_LOOP = "triangular_loop"


def block_size(seq_len: int, block: int = BLOCK) -> int:
    """The largest block ≤ `block` that divides the sequence."""
    return math.gcd(seq_len, block)


def _blocks(x_BxTxHxK, block, groups=1):
    """(B, T, H, K) -> (T/block, B, H/groups, groups·block, K): with grouped-query attention (`groups` query
    heads per key/value head), a query block holds its key/value head's group as rows, (group, position)."""
    B, T, H, K = x_BxTxHxK.shape
    x = x_BxTxHxK.reshape(B, T // block, block, H // groups, groups, K).transpose(1, 0, 3, 4, 2, 5)
    return x.reshape(T // block, B, H // groups, groups * block, K)


def _unblocks(x_NxBxGxRCxK, groups=1):
    N, B, G, RC, K = x_NxBxGxRCxK.shape
    x = x_NxBxGxRCxK.reshape(N, B, G, groups, RC // groups, K).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(B, N * (RC // groups), G * groups, K)


def _scores(q_BxGxRCxK, k_BxGxCxK, i, j, block, bias: Bias = NO_BIAS):
    """One block of scaled, causally masked float32 scores: query block i against key block j (and, with
    segment ids, (T/block, B, block), only keys of the query's segment; with slopes, ALiBi's bias added).
    A query block's rows are its key/value head's group of query heads, R of them, each over the block."""
    segs_NxBxC, slopes_H, _ = bias
    G, groups = k_BxGxCxK.shape[1], q_BxGxRCxK.shape[2] // block
    s = jnp.einsum("bhqk,bhsk->bhqs", q_BxGxRCxK, k_BxGxCxK, preferred_element_type=jnp.float32)
    s = s / math.sqrt(q_BxGxRCxK.shape[-1])
    queries, keys = i * block + jnp.tile(jnp.arange(block), groups), j * block + jnp.arange(block)
    if slopes_H is not None:  # each row's head's: heads (G, R), rows (R, block) of a key/value head's group
        B = s.shape[0]
        s = with_alibi(s.reshape(B, G * groups, block, block), slopes_H, Positions(queries[:block], keys)).reshape(
            s.shape)
    visible = queries[:, None] >= keys[None, :]
    if segs_NxBxC is not None:
        visible = visible & same_segment(jnp.tile(segs_NxBxC[i], (1, groups)), segs_NxBxC[j])
    return jnp.where(visible, s, _MASKED)


def _segment_blocks(segment_ids_BxT, block):
    """(B, T) -> (T/block, B, block), or None."""
    if segment_ids_BxT is None:
        return None
    B, T = segment_ids_BxT.shape
    return segment_ids_BxT.reshape(B, T // block, block).transpose(1, 0, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def blockwise_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, bias: Bias, block: int):
    """Causal softmax(q kᵀ/√K) v, `block` positions at a time (`block` divides T); with segment ids
    (B, T), each query sees the keys of its own segment only; with slopes (H,), ALiBi's bias is added to
    each block's scores; with dropout, each block's probabilities are dropped by a mask drawn from the
    samples' keys, the layer and the block (the same in the backward pass)."""
    return _forward(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, bias, block)[0]


def _forward(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, bias: Bias, block):
    groups = q_BxTxHxK.shape[2] // k_BxTxHxK.shape[2]
    qs, ks, vs = _blocks(q_BxTxHxK, block, groups), _blocks(k_BxTxHxK, block), _blocks(v_BxTxHxK, block)
    segs = _segment_blocks(bias.segment_ids_BxT, block)
    blocked = bias._replace(segment_ids_BxT=segs)

    def query_block(_, iq):
        i, q_BxHxCxK = iq

        def key_block(j, carry):
            m_BxHxC, l_BxHxC, acc_BxHxCxK = carry
            # A key block wholly outside the query's segment gives _MASKED everywhere; its weights are
            # cleared by the correction once a visible key (the query itself, at the latest) comes.
            s = _scores(q_BxHxCxK, ks[j], i, j, block, blocked)
            m_new = jnp.maximum(m_BxHxC, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m_BxHxC - m_new)
            l_BxHxC = l_BxHxC * correction + p.sum(-1)  # the normaliser: of the probabilities before dropout
            pv = jnp.einsum("bhqs,bhsk->bhqk", _dropped(p, blocked, i, j).astype(vs.dtype), vs[j],
                            preferred_element_type=jnp.float32)
            return m_new, l_BxHxC, acc_BxHxCxK * correction[..., None] + pv

        # Inside shard_map the carries must vary over the mesh axes as the values the loop reads do.
        row = _varying(jnp.zeros(q_BxHxCxK.shape[:-1], jnp.float32), q_BxHxCxK, ks, vs, *_arrays(blocked))
        init = (row + _MASKED, row, _varying(jnp.zeros(q_BxHxCxK.shape, jnp.float32), row))
        with jax.named_scope(TRIANGULAR_LOOP):  # key blocks 0..i: the causal ones
            m, l, acc = lax.fori_loop(0, i + 1, key_block, init)
        return None, ((acc / l[..., None]).astype(q_BxHxCxK.dtype), m + jnp.log(l))

    _, (out_NxBxHxCxK, lse_NxBxHxC) = lax.scan(query_block, None, (jnp.arange(qs.shape[0]), qs))
    out = checkpoint_name(_unblocks(out_NxBxHxCxK, groups), SAVED[0])
    lse_NxBxHxC = checkpoint_name(lse_NxBxHxC, SAVED[1])
    return out, (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, bias, out, lse_NxBxHxC)


def _backward(block, residuals, dout_BxTxHxK):
    q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, bias, out, lse_NxBxHxC = residuals
    groups = q_BxTxHxK.shape[2] // k_BxTxHxK.shape[2]
    qs, dos = _blocks(q_BxTxHxK, block, groups), _blocks(dout_BxTxHxK, block, groups)
    ks, vs = _blocks(k_BxTxHxK, block), _blocks(v_BxTxHxK, block)
    segs = _segment_blocks(bias.segment_ids_BxT, block)
    blocked = bias._replace(segment_ids_BxT=segs)
    # D = rowsum(dO ∘ O): the softmax's backward term, one number per query.
    d_NxBxHxC = _blocks((dout_BxTxHxK.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1, keepdims=True),
                        block, groups)[..., 0]
    scale = 1.0 / math.sqrt(q_BxTxHxK.shape[-1])

    def query_block(carry, inputs):
        dk_acc, dv_acc = carry  # (N, B, H, C, K) float32, over every key block
        i, q_BxHxCxK, do_BxHxCxK, lse_BxHxC, d_BxHxC = inputs

        def key_block(j, inner):
            dq_BxHxCxK, dk_acc, dv_acc = inner
            p = jnp.exp(_scores(q_BxHxCxK, ks[j], i, j, block, blocked) - lse_BxHxC[..., None])  # masked: 0
            dv = jnp.einsum("bhqs,bhqk->bhsk", _dropped(p, blocked, i, j).astype(do_BxHxCxK.dtype), do_BxHxCxK,
                            preferred_element_type=jnp.float32)
            # Through the dropout: d(dropped p) = dO vᵀ, and dp = its dropped entries (D is rowsum(dO ∘ O) as before).
            dp = _dropped(jnp.einsum("bhqk,bhsk->bhqs", do_BxHxCxK, vs[j], preferred_element_type=jnp.float32),
                          blocked, i, j)
            ds = (p * (dp - d_BxHxC[..., None]) * scale).astype(q_BxHxCxK.dtype)
            dq_BxHxCxK = dq_BxHxCxK + jnp.einsum("bhqs,bhsk->bhqk", ds, ks[j], preferred_element_type=jnp.float32)
            dk = jnp.einsum("bhqs,bhqk->bhsk", ds, q_BxHxCxK, preferred_element_type=jnp.float32)
            return dq_BxHxCxK, dk_acc.at[j].add(dk), dv_acc.at[j].add(dv)

        dq = _varying(jnp.zeros(q_BxHxCxK.shape, jnp.float32), dk_acc)
        with jax.named_scope(TRIANGULAR_LOOP):
            dq, dk_acc, dv_acc = lax.fori_loop(0, i + 1, key_block, (dq, dk_acc, dv_acc))
        return (dk_acc, dv_acc), dq

    zeros = _varying(jnp.zeros(ks.shape, jnp.float32), qs, ks, vs, dos, *_arrays(blocked), lse_NxBxHxC, d_NxBxHxC)
    (dk, dv), dq = lax.scan(query_block, (zeros, zeros),
                            (jnp.arange(qs.shape[0]), qs, dos, lse_NxBxHxC, d_NxBxHxC))
    grads = (_unblocks(dq, groups).astype(q_BxTxHxK.dtype), _unblocks(dk).astype(k_BxTxHxK.dtype),
             _unblocks(dv).astype(v_BxTxHxK.dtype))
    return (*grads, _no_bias_gradient(bias))


def _no_bias_gradient(bias: Bias) -> Bias:
    """Nothing of a Bias is trained: float0 zeros for its integers and keys, zeros for its slopes and rate."""
    def zero(x):
        x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.zeros_like(x)
        return np.zeros(x.shape, jax.dtypes.float0)
    return jax.tree.map(zero, bias)


def _arrays(bias: Bias) -> list[jax.Array]:
    """A Bias's arrays (its segment ids, slopes, dropout keys and layer), for `_varying`."""
    return [x for x in jax.tree.leaves(bias) if isinstance(x, jax.Array)]


def _varying(x, *like):
    """`x` made to vary over every manual mesh axis (inside a `shard_map`) that any of `like` varies over: a
    loop's carry must vary as the values its body combines into it. The custom VJPs' inputs need not say
    how they vary (the differentiated ones arrive unvarying, the segment ids varying), so all are asked.
    Outside a shard_map, `x`."""
    axes = frozenset().union(*(jax.typeof(y).manual_axis_type.varying for y in like if y is not None))
    missing = tuple(sorted(axes - jax.typeof(x).manual_axis_type.varying))
    return lax.pcast(x, missing, to="varying") if missing else x


def _no_gradient(ids):
    """The cotangent of an integer input (segment ids): float0 zeros, or None for no ids."""
    return None if ids is None else np.zeros(ids.shape, jax.dtypes.float0)


blockwise_attention.defvjp(_forward, _backward)


# --- Pallas flash attention (TPU v4 and later) -------------------------------------------------------

def _tpu_flash():
    from jax.experimental.pallas.ops.tpu import flash_attention

    return flash_attention


def pallas_available() -> bool:
    """Whether this JAX has the Pallas TPU flash attention functions `pallas` is wired to."""
    try:
        module = _tpu_flash()
    except ImportError:
        return False
    return all(hasattr(module, name) for name in ("_flash_attention", "_flash_attention_bwd", "BlockSizes"))


def pallas_fits(seq_len: int, block: int = BLOCK) -> bool:
    """The kernel's blocks must be whole multiples of the TPU's lanes."""
    return block_size(seq_len, block) % PALLAS_LANES == 0


def _unchecked(f, *args):
    """f(*args) with JAX's varying-axes check off (inside a `shard_map`; outside one, just f(*args)); the
    outputs are declared to vary over the mesh axes `args[0]` varies over."""
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return f(*args)
    out = jax.shard_map(f, in_specs=P(), out_specs=P(), axis_names=frozenset(), check_vma=False)(*args)
    return jax.tree.map(lambda x: _varying(x, args[0]), out)


def _pallas_settings(q_BxHxTxK, block):
    flash = _tpu_flash()
    sizes = flash.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1,
                             block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block,
                             block_q_dkv=block, block_k_major_dq=block, block_k_dq=block, block_q_dq=block)
    return flash, 1.0 / math.sqrt(q_BxHxTxK.shape[-1]), sizes


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def pallas_attention(q_BxHxTxK, k_BxHxTxK, v_BxHxTxK, segment_ids_BxT, block: int):
    """Causal softmax(q kᵀ/√K) v by Pallas's TPU flash attention; (B, H, T, K), `block` divides T; with
    segment ids (B, T), each query sees the keys of its own segment only (the kernel's SegmentIds)."""
    return _pallas_forward(q_BxHxTxK, k_BxHxTxK, v_BxHxTxK, segment_ids_BxT, block)[0]


def _pallas_segments(flash, ids):
    return None if ids is None else flash.SegmentIds(q=ids, kv=ids)


def _pallas_forward(q, k, v, ids, block):
    flash, scale, sizes = _pallas_settings(q, block)
    # save_residuals=True: the output and the per-row softmax statistics the backward pass starts from.
    o, l, m = _unchecked(lambda q, k, v, ids: flash._flash_attention(
        q, k, v, None, _pallas_segments(flash, ids), True, True, scale, sizes, False), q, k, v, ids)
    o, l, m = checkpoint_name(o, SAVED[0]), checkpoint_name(l, SAVED[1]), checkpoint_name(m, SAVED[1])
    return o, (q, k, v, ids, o, l, m)


def _pallas_backward(block, residuals, do):
    q, k, v, ids, o, l, m = residuals
    flash, scale, sizes = _pallas_settings(q, block)
    dq, dk, dv = _unchecked(lambda q, k, v, ids, o, l, m, do: flash._flash_attention_bwd(
        False, True, scale, sizes, False, (q, k, v, None, _pallas_segments(flash, ids), o, l, m), do)[:3],
        q, k, v, ids, o, l, m, do)
    return dq, dk, dv, _no_gradient(ids)


pallas_attention.defvjp(_pallas_forward, _pallas_backward)
