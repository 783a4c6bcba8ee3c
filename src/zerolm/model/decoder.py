"""The decoder, in flax: one GPT whose layout is a set of settings that compose (the `model:` section,
zerolm.config.model), never a second model file.

- Positions (`model.position`): a learned table (GPT-2), ALiBi's attention biases (no table: a model
  evaluates past its trained context), or rotary embeddings (Llama's rotate-half form); computed once per
  forward pass (`token_positions`, `rope_angles`), with a document mask (`model.document_mask`) per
  document.
- The block: pre-norm attention and MLP, one after the other (GPT-2) or side by side (`model.parallel_residual`:
  GPT-NeoX's, with `model.shared_norm` GPT-J's, whose two branches' output projections are one matmul, and with
  one norm their input's gradient too, so that tensor parallelism reduces once); `model.norm` LayerNorm or
  RMSNorm, `model.bias`, `model.mlp` a GELU MLP (`model.activation`: tanh or exact) or SwiGLU
  (`model.mlp_hidden`), `model.n_kv_head` for grouped-query attention; the attention by implementation
  (zerolm.model.attention); dropout on the embedding, the residual branches and the attention probabilities
  (zerolm.model.dropout).
- The output layer tied to the token embedding, or its own (`model.tie_embeddings: false`: `lm_head`).
- The layers stacked along a leading `layers` axis, in a scan (compile time flat in depth) or unrolled
  (`model.scan_layers`), with a remat policy (`model.remat`, REMAT_POLICIES).

Pure: no sharding logic. Each parameter carries *logical* axis names (`vocab`, `embed`, `heads`,
`kv_heads`, `mlp`, `qkv`, `position`, `layers`), which say what an axis means; `zerolm.parallel.sharding`'s
rule table decides which mesh axis, if any, splits it. Parameter names follow Hugging Face's GPT-2 (wte,
wpe, h.attn.c_attn, ...). `c_attn`'s kernel is (d, 3, d) = (embed, qkv, heads), so that tensor parallelism
splits whole heads of q, k and v; reshaped to (d, 3·d) it is GPT-2's, column for column.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zerolm.config.model import ModelConfig
from zerolm.model import dropout as dropout_lib
from zerolm.model.attention import SAVED, Bias, Dropout, alibi_bias, alibi_slopes, causal_attention

# model.remat -> what each block's backward pass may keep from its forward pass (the rest is recomputed).
# Every policy keeps the block's input. "none" recomputes no matmul and no attention, only what costs no
# FLOPs worth counting: the LayerNorms' and the GELU's outputs and intermediates are rebuilt from the kept
# matmul outputs instead of being stored (1_3b on an H100 at micro-batch 8: 41.5 GiB against 56.6 stored;
# docs/performance-notes.md). "dots" keeps the outputs of the weight matmuls (dots without batch
# dimensions), which cost the most to recompute per byte; "attention" keeps what the attention's backward
# pass starts from (its output and softmax statistics: `attention.SAVED`, and cuDNN's forward call whole),
# so flash attention runs once.


def _attention_saved(prim, *_, **params) -> bool:
    """The attention's outputs and softmax statistics: zerolm's attentions name them (attention.SAVED);
    cuDNN's, inside jax.nn.dot_product_attention, is one primitive whose outputs are both."""
    if prim.name == "name":
        return params["name"] in SAVED
    return prim.name == "dot_product_attention_fwd_wrapper"


# The parallel block's input projections (`projections`: a custom VJP, whose matmuls a policy that looks for dots
# does not see) are weight matmuls' outputs by name.
PROJECTIONS = "projections"


def _projections_saved(prim, *_, **params) -> bool:
    return prim.name == "name" and params["name"] == PROJECTIONS


_cp = jax.checkpoint_policies
_weight_dots = _cp.save_from_both_policies(_cp.dots_with_no_batch_dims_saveable, _projections_saved)
REMAT_POLICIES = {
    # Every matmul's output (XLA's attention is batched dots: its scores and output) and the attention's.
    "none": _cp.save_from_both_policies(_cp.save_from_both_policies(_cp.dots_saveable, _projections_saved),
                                        _attention_saved),
    "full": _cp.nothing_saveable,
    "dots": _weight_dots,
    "attention": _attention_saved,
    "dots_attention": _cp.save_from_both_policies(_weight_dots, _attention_saved),
}


def _named(init, *axes: str):
    """An initializer whose parameter carries logical axis names (metadata; see zerolm.parallel.sharding)."""
    return nn.with_logical_partitioning(init, axes)


class Weights(NamedTuple):
    """A linear layer's parameters: `kernel` (d_in, *features), `bias` (*features) or None."""

    kernel: jax.Array
    bias: jax.Array | None


class Linear(nn.Module):
    """A linear layer's parameters, declared as flax's DenseGeneral declares them (the same names, logical axes and
    initial values) and returned, not applied (`linear` applies them): so that the parallel residual block can put
    two branches' projections into one matmul (`fused_out`; `fused_in`, backward)."""

    d_in: int
    features: tuple[int, ...]
    axes: tuple[str, ...]  # the kernel's logical axes, the input's first; the bias has the features'
    kernel_init: Callable
    use_bias: bool

    @nn.compact
    def __call__(self) -> Weights:
        flat = (self.d_in, math.prod(self.features))  # DenseGeneral draws the kernel as a matrix, then reshapes it
        shape = (self.d_in, *self.features)
        kernel = self.param("kernel", _named(lambda rng, _, dtype=jnp.float32: self.kernel_init(rng, flat, dtype)
                                             .reshape(shape), *self.axes), shape, jnp.float32)
        bias = self.param("bias", _named(nn.initializers.zeros, *self.axes[1:]), self.features,
                          jnp.float32) if self.use_bias else None
        return Weights(kernel, bias)


def linear(x_BxTxN: jax.Array, w: Weights, dtype: jnp.dtype, name: str = "") -> jax.Array:
    """x's last axis times the kernel, plus the bias, in `dtype` (what flax's Dense computes)."""
    with jax.named_scope(name) if name else contextlib.nullcontext():  # its matmul named in the HLO, as flax names it
        x, kernel, bias = nn.dtypes.promote_dtype(x_BxTxN, w.kernel, w.bias, dtype=dtype)
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        return y if bias is None else y + bias


def _proj_init(cfg: ModelConfig):
    """GPT-2 scales the residual projections' init by 1/sqrt(2 * n_layer)."""
    return nn.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layer))


class Decoding(NamedTuple):
    """A forward pass over a KV cache: row b's tokens sit at positions start_B[b] onwards (each row its own
    sequence, at its own length: prompts of any lengths decode together)."""

    start_B: jax.Array  # (B,) int32
    layer: Any = 0  # the layer whose cache an attention reads and writes (the layers' loop sets it)


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype
    implementation: str

    def setup(self):
        """With as many key/value heads as query heads, one `c_attn` kernel (d, 3, d) = (embed, qkv, heads), GPT-2's
        Conv1D column for column; with fewer (grouped-query attention), `c_q` (d, d) and `c_kv` (d, 2, G·K) =
        (embed, qkv, kv_heads), so tensor parallelism splits whole key/value heads with their groups of query heads."""
        cfg, D = self.cfg, self.cfg.d_model
        dense = functools.partial(Linear, D, kernel_init=nn.initializers.normal(0.02), use_bias=cfg.bias)
        if cfg.kv_heads == cfg.n_head:
            self.c_attn = dense((3, D), ("embed", "qkv", "heads"))
        else:
            self.c_q = dense((D,), ("embed", "heads"))
            self.c_kv = dense((2, cfg.kv_heads * cfg.head_dim), ("embed", "qkv", "kv_heads"))
        self.c_proj = Linear(D, (D,), ("heads", "embed"), _proj_init(cfg), cfg.bias)

    def in_weights(self) -> list[Weights]:
        """The input projections': c_attn's, or c_q's and c_kv's."""
        return [self.c_attn()] if self.cfg.kv_heads == self.cfg.n_head else [self.c_q(), self.c_kv()]

    def in_names(self) -> list[str]:
        return ["c_attn"] if self.cfg.kv_heads == self.cfg.n_head else ["c_q", "c_kv"]

    def out_weights(self) -> Weights:
        return self.c_proj()

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, decoding: Decoding | None = None,
                 segment_ids_BxT: jax.Array | None = None, dropout: Dropout | None = None,
                 rope: Rope | None = None, projected: list[jax.Array] | None = None) -> jax.Array:
        """The heads' outputs (B, T, D), which the block projects with `out_weights` (alone, or with the MLP's in
        one matmul). `rope`: the rotary embedding's angles of every position, computed once per forward pass
        (`rope_angles`). `projected`: the input projections of x (`in_weights`' outputs) made elsewhere (a parallel
        block's `fused_in`)."""
        B, T, D = x_BxTxD.shape
        if projected is None:
            projected = [linear(x_BxTxD, w, self.dtype, n) for w, n in zip(self.in_weights(), self.in_names(), strict=True)]
        q_BxTxHxK, k_BxTxGxK, v_BxTxGxK = self._heads(projected, B, T)
        if rope is not None:
            q_BxTxHxK, k_BxTxGxK = rotate(q_BxTxHxK, rope), rotate(k_BxTxGxK, rope)
        slopes_H = jnp.asarray(alibi_slopes(self.cfg.n_head)) if self.cfg.position == "alibi" else None
        if decoding is None:
            y = causal_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, self.implementation, self.cfg.attention_block,
                                 Bias(segment_ids_BxT, slopes_H, dropout))
        else:
            y = self._cached_attention(q_BxTxHxK, k_BxTxGxK, v_BxTxGxK, decoding, slopes_H)
        return y.reshape(B, T, D)

    def _heads(self, projected: list[jax.Array], B: int, T: int):
        """Queries (B, T, H, K), keys and values (B, T, G, K) of G = model.n_kv_head heads, from the input
        projections' outputs: c_attn's (B, T, 3, D), or c_q's (B, T, D) and c_kv's (B, T, 2, G·K)."""
        H, G, K = self.cfg.n_head, self.cfg.kv_heads, self.cfg.head_dim
        if G == H:
            q, k, v = (projected[0][:, :, i].reshape(B, T, H, K) for i in range(3))
            return q, k, v
        k, v = (projected[1][:, :, i].reshape(B, T, G, K) for i in range(2))
        return projected[0].reshape(B, T, H, K), k, v

    def _cached_attention(self, q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, decoding: Decoding, slopes_H=None):
        """Decoding: write each row's S positions' keys and values (G = model.n_kv_head heads) into the `cache`
        collection at the row's start, then attend over the row's cached positions up to each query's own
        (with ALiBi's bias, given slopes). A cached position past a query's is never read, so what a row
        left there (a longer prompt's padding, an earlier request's tokens) does not matter."""
        B, S, G, K = k_BxSxGxK.shape
        T, L, H = self.cfg.seq_len, self.cfg.n_layer, self.cfg.n_head
        # Every layer's cache, (layers, B, G, T, K), carried whole through the layers' loop (not sliced and stacked
        # again by it): the new positions are written where they go, in place, and each layer's attention
        # multiplies its own, laid out as the products read it (batch dims first), with no copy transposed.
        cached = [self.variable("cache", name, jnp.zeros, (L, B, G, T, K), k_BxSxGxK.dtype) for name in ("k", "v")]
        rows_Bx1, columns_BxS = jnp.arange(B)[:, None], decoding.start_B[:, None] + jnp.arange(S)
        for var, new in zip(cached, (k_BxSxGxK, v_BxSxGxK), strict=True):
            var.value = var.value.at[decoding.layer, rows_Bx1, :, columns_BxS].set(new.astype(var.value.dtype),
                                                                                    mode="drop")
        keys_BxGxTxK, values_BxGxTxK = (var.value[decoding.layer] for var in cached)
        q_BxGxHgxSxK = q_BxSxHxK.reshape(B, S, G, H // G, K).transpose(0, 2, 3, 1, 4)
        logits = jnp.einsum("bghsk,bgtk->bghst", q_BxGxHgxSxK, keys_BxGxTxK,
                            preferred_element_type=jnp.float32) / math.sqrt(K)
        queries_BxS = decoding.start_B[:, None] + jnp.arange(S)
        if slopes_H is not None:
            bias_BxHxSxT = jax.vmap(alibi_bias, (None, 0, None))(slopes_H, queries_BxS, jnp.arange(T))[:, 0]
            logits = logits + bias_BxHxSxT.reshape(B, G, H // G, S, T).astype(jnp.float32)
        visible_Bx1x1xSxT = (jnp.arange(T)[None, None, :] <= queries_BxS[:, :, None])[:, None, None]
        probs = jax.nn.softmax(jnp.where(visible_Bx1x1xSxT, logits, -jnp.inf), axis=-1).astype(values_BxGxTxK.dtype)
        y_BxGxHgxSxK = jnp.einsum("bghst,bgtk->bghsk", probs, values_BxGxTxK)
        return y_BxGxHgxSxK.transpose(0, 3, 1, 2, 4).reshape(B, S, H, K)


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


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype

    def setup(self):
        cfg, D, F = self.cfg, self.cfg.d_model, self.cfg.mlp_width
        up = functools.partial(Linear, D, (F,), ("embed", "mlp"), nn.initializers.normal(0.02), cfg.bias)
        self.c_fc = up()
        if cfg.mlp == "swiglu":
            self.c_gate = up()
        self.c_proj = Linear(F, (D,), ("mlp", "embed"), _proj_init(cfg), cfg.bias)

    def in_weights(self) -> list[Weights]:
        """The input projections': c_fc's, and SwiGLU's c_gate's."""
        return [self.c_fc(), self.c_gate()] if self.cfg.mlp == "swiglu" else [self.c_fc()]

    def in_names(self) -> list[str]:
        return ["c_fc", "c_gate"] if self.cfg.mlp == "swiglu" else ["c_fc"]

    def out_weights(self) -> Weights:
        return self.c_proj()

    def __call__(self, x_BxTxD: jax.Array, projected: list[jax.Array] | None = None) -> jax.Array:
        """The hidden units (B, T, F), which the block projects with `out_weights`; `projected` as Attention's."""
        h, *gate = projected if projected is not None else [
            linear(x_BxTxD, w, self.dtype, n) for w, n in zip(self.in_weights(), self.in_names(), strict=True)]
        if self.cfg.mlp == "swiglu":  # Llama's: silu of the gate times the up projection (c_fc)
            h = nn.silu(gate[0]) * h
        else:
            h = nn.gelu(h, approximate=self.cfg.activation == "gelu_tanh")  # GPT-2's "gelu_new", or the exact one
        return h


def tp_groups(cfg: ModelConfig) -> int:
    """How many equal groups of columns every tensor-parallel split of a block keeps whole: gcd(n_head, n_kv_head,
    MLP width), which any tp the model allows divides (it splits whole query and key/value heads and the MLP's
    units: zerolm.config.model.tp_split_problem)."""
    return math.gcd(cfg.n_head, cfg.kv_heads, cfg.mlp_width)


def _grouped(x: jax.Array, groups: int, axis: int) -> jax.Array:
    """x's last axis (a kernel's output columns, which tensor parallelism splits) in `groups`, the groups moved to
    `axis` and each group's columns (of every axis between) flattened after it: a kernel (d, *lead, n) as
    (d, groups, ·) with axis 1, a projection's output (B, T, *lead, n) as (B, T, groups, ·) with axis 2."""
    *rest, n = x.shape
    return jnp.moveaxis(x.reshape(*rest, groups, n // groups), -2, axis).reshape(*rest[:axis], groups, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def projections(x_BxTxD: jax.Array, kernels: tuple[jax.Array, ...], groups: int) -> tuple[jax.Array, ...]:
    """x times each kernel (d, *lead, n), each its own matmul (as `linear`'s), whose backward pass makes x's gradient
    one matmul over every kernel's columns: one sum, so that tensor parallelism reduces it once where a matmul each
    reduces it once each. The columns go in `groups` (`_grouped`), which keep a tp device's columns on it."""
    return tuple(lax.dot_general(x_BxTxD, k, (((x_BxTxD.ndim - 1,), (0,)), ((), ()))) for k in kernels)


def _projections_fwd(x_BxTxD, kernels, groups):
    return projections(x_BxTxD, kernels, groups), (x_BxTxD, kernels)


def _projections_bwd(groups, residuals, grads):
    x_BxTxD, kernels = residuals
    g_BxTxGxC = jnp.concatenate([_grouped(g, groups, 2) for g in grads], axis=-1)
    kernel_DxGxC = jnp.concatenate([_grouped(k, groups, 1) for k in kernels], axis=-1)
    dx = jnp.einsum("btgc,dgc->btd", g_BxTxGxC, kernel_DxGxC)
    return dx, tuple(jnp.tensordot(x_BxTxD, g, axes=((0, 1), (0, 1))) for g in grads)


projections.defvjp(_projections_fwd, _projections_bwd)


def fused_in(x_BxTxD: jax.Array, weights: list[Weights], groups: int, dtype: jnp.dtype) -> list[jax.Array]:
    """`[linear(x, w, dtype) for w in weights]`, x's gradient made in one matmul (`projections`), the outputs named
    for the remat policies that keep weight matmuls' (PROJECTIONS)."""
    x, *kernels = nn.dtypes.promote_dtype(x_BxTxD, *[w.kernel for w in weights], dtype=dtype)
    outs = [checkpoint_name(y, PROJECTIONS) for y in projections(x, tuple(kernels), groups)]
    return [y if w.bias is None else y + w.bias.astype(dtype) for y, w in zip(outs, weights, strict=True)]


def fused_out(parts: list[tuple[jax.Array, Weights]], groups: int, dtype: jnp.dtype) -> jax.Array:
    """The sum of `linear(y, w, dtype)` over the (y, w) parts as one matmul, so that the sum is made before tensor
    parallelism's reduction (one all-reduce where two matmuls need two): each y (B, T, n) and kernel (n, D) in
    `groups` groups of n (whole heads, whole blocks of the MLP's units), the groups concatenated."""
    ys, kernels = [], []
    for y, w in parts:
        B, T, n = y.shape
        ys.append(y.reshape(B, T, groups, n // groups))
        kernels.append(w.kernel.reshape(groups, n // groups, -1))
    y_BxTxGxC, kernel = nn.dtypes.promote_dtype(jnp.concatenate(ys, axis=-1), jnp.concatenate(kernels, axis=1),
                                                 dtype=dtype)
    out_BxTxD = jnp.einsum("btgc,gcd->btd", y_BxTxGxC, kernel)
    for _, w in parts:
        out_BxTxD = out_BxTxD if w.bias is None else out_BxTxD + w.bias.astype(dtype)
    return out_BxTxD


class Block(nn.Module):
    """Pre-norm attention and MLP: one after the other, each adding to the residual (GPT-2), or with
    `model.parallel_residual` both reading the block's input and adding together (GPT-NeoX: a norm each; with
    `model.shared_norm`, GPT-J: one, `ln_1`). The parallel block sums the two branches' output projections in one
    matmul (`fused_out`), and with one norm makes the gradient of their common input in one (`fused_in`), so that
    tensor parallelism reduces once where the sequential block reduces twice, in each direction; with residual
    dropout in training each branch's output is dropped with its own mask, so the two are projected apart."""

    cfg: ModelConfig
    dtype: jnp.dtype
    implementation: str

    @nn.compact
    def __call__(self, carry, decoding: Decoding | None, segment_ids_BxT: jax.Array | None,
                 keys_B: jax.Array | None, rope: Rope | None = None) -> tuple[Any, None]:
        """`carry`: the hidden states, or in training with dropout (`keys_B`, each sample's key) the pair
        (hidden states, this layer's index), which each mask is drawn with (zerolm.model.dropout)."""
        cfg, ln = self.cfg, functools.partial(norm, self.cfg, self.dtype)
        counted = keys_B is not None or decoding is not None  # the carry counts the layers
        x_BxTxD, layer = carry if counted else (carry, jnp.int32(0))
        if decoding is not None:
            decoding = decoding._replace(layer=layer)
        attention_dropout = None
        if keys_B is not None and cfg.attention_dropout:
            attention_dropout = Dropout(keys_B, layer, cfg.attention_dropout)
        attn = Attention(cfg, self.dtype, self.implementation, name="attn")
        mlp = MLP(cfg, self.dtype, name="mlp")

        def out(y, branch, site):  # a branch's output projection, with its residual dropout
            return dropout_lib.drop(linear(y, branch.out_weights(), self.dtype, f"{branch.name}/c_proj"), keys_B,
                                    cfg.residual_dropout, layer, site)

        if not cfg.parallel_residual:
            y = attn(ln("ln_1")(x_BxTxD), decoding, segment_ids_BxT, attention_dropout, rope)
            x_BxTxD = x_BxTxD + out(y, attn, dropout_lib.ATTENTION_OUT)
            x_BxTxD = x_BxTxD + out(mlp(ln("ln_2")(x_BxTxD)), mlp, dropout_lib.MLP_OUT)
            return ((x_BxTxD, layer + 1) if counted else x_BxTxD), None
        groups, h_BxTxD = tp_groups(cfg), ln("ln_1")(x_BxTxD)
        a_in = m_in = None
        if cfg.shared_norm:
            a_w, m_w = attn.in_weights(), mlp.in_weights()
            projected = fused_in(h_BxTxD, a_w + m_w, groups, self.dtype)
            a_in, m_in = projected[:len(a_w)], projected[len(a_w):]
        y = attn(h_BxTxD, decoding, segment_ids_BxT, attention_dropout, rope, a_in)
        z = mlp(h_BxTxD if cfg.shared_norm else ln("ln_2")(x_BxTxD), m_in)
        if keys_B is not None and cfg.residual_dropout:  # each branch its own mask, after its own projection
            x_BxTxD = x_BxTxD + (out(y, attn, dropout_lib.ATTENTION_OUT) + out(z, mlp, dropout_lib.MLP_OUT))
        else:
            x_BxTxD = x_BxTxD + fused_out([(y, attn.out_weights()), (z, mlp.out_weights())], groups, self.dtype)
        return ((x_BxTxD, layer + 1) if counted else x_BxTxD), None


class TPReductions(NamedTuple):
    """The activations (B, T, d_model) that tensor parallelism all-reduces per block and micro-step in training."""

    forward: int
    rerun: int  # of the forward pass's, those full remat runs again: the ones whose result the backward pass reads
    backward: int

    def per_layer(self, full_remat: bool) -> int:
        return self.forward + (self.rerun if full_remat else 0) + self.backward


def tp_all_reduces(parallel_residual: bool, shared_norm: bool, residual_dropout: bool) -> TPReductions:
    """The sequential block's: its two row-parallel outputs forward, of which full remat reruns the attention's (the
    MLP reads it; the MLP's output only joins the residual), and its two norms' input gradients backward
    (Megatron's 2 + 2). The parallel residual's: one forward (the branches summed before the reduction; two with
    residual dropout, each branch's output dropped with its own mask after its own reduction), none rerun (its
    output only joins the residual), and backward one with a shared norm (one input projection), two with a norm
    each (each norm's input gradient)."""
    if not parallel_residual:
        return TPReductions(2, 1, 2)
    return TPReductions(2 if residual_dropout else 1, 0, 1 if shared_norm else 2)


class GPT(nn.Module):
    """`cfg` resolved for the device it runs on (zerolm.parallel.auto.model_settings, for_device): no `auto` left
    (dtype, attention, layer loop, remat, key/value heads, MLP width), so that tracing reads no global device."""

    cfg: ModelConfig
    # What a layer reads of its parameters, given them as stored: None, as they are. ZeRO-3 (zerolm.parallel.zero)
    # stores them split over dp and gathers each layer's here, inside the layers' loop and its remat.
    layer_params: Callable[[Any], Any] | None = None

    def __post_init__(self):
        unresolved = [k for k in ("dtype", "attention", "scan_layers", "remat", "n_kv_head", "mlp_hidden")
                      if getattr(self.cfg, k) == "auto"]
        if unresolved:
            raise ValueError(f"GPT needs a config resolved for its device (zerolm.parallel.auto.for_device): "
                             f"model.{', model.'.join(unresolved)} is auto")
        super().__post_init__()

    @nn.compact
    def __call__(self, tokens_BxT: jax.Array, *, hidden_only: bool = False,
                 decoding: Decoding | None = None, dropout_keys: jax.Array | None = None) -> jax.Array:
        """Float32 logits over the padded vocabulary; padded entries are -inf-like, so they get no mass.

        `hidden_only`: the final LayerNorm's output instead, for a loss that applies the (tied)
        output layer itself, chunk by chunk (or a sampler, at one position).
        `decoding`: decode with a KV cache (the mutable `cache` collection, see `init_cache`): row b's tokens
        sit at positions start_B[b] .. start_B[b]+T-1 and attend to the row's cached positions before them.
        `dropout_keys`: in training, each sample's key (zerolm.model.dropout.row_keys): the model.*_dropout
        rates apply, each mask drawn from the sample's key, the layer and the site; None: no dropout."""
        cfg = self.cfg
        V, D = cfg.padded_vocab_size, cfg.d_model
        wte_VxD = self.param("wte", _named(nn.initializers.normal(0.02), "vocab", "embed"), (V, D), jnp.float32)
        segment_ids_BxT, positions_BxT = token_positions(cfg, tokens_BxT, decoding)
        x_BxTxD = self._embed(wte_VxD, tokens_BxT, positions_BxT, dropout_keys)
        # Positions, once per forward pass: learned ones are added above; rotary angles go to every layer;
        # ALiBi's bias comes from the positions' distance inside each attention (zerolm.model.attention.alibi_bias),
        # which is the same counted from a document's start or the sample's.
        rope = None
        if cfg.position == "rope":
            T = tokens_BxT.shape[1]
            rope = rope_angles(positions_BxT if positions_BxT is not None else jnp.broadcast_to(
                jnp.arange(T), tokens_BxT.shape), cfg.head_dim, cfg.rope_theta)
        carry = x_BxTxD if dropout_keys is None and decoding is None else (x_BxTxD, jnp.int32(0))
        carry, _ = self._blocks()(cfg, jnp.dtype(cfg.dtype), cfg.attention, name="h")(carry, decoding, segment_ids_BxT,
                                                                                     dropout_keys, rope)
        x_BxTxD = norm(cfg, jnp.dtype(cfg.dtype), "ln_f")(carry if dropout_keys is None and decoding is None
                                                          else carry[0])
        out_VxD = wte_VxD
        if not cfg.tie_embeddings:  # the output layer's own matrix, (vocab, embed) as wte
            out_VxD = self.param("lm_head", _named(nn.initializers.normal(0.02), "vocab", "embed"), (V, D), jnp.float32)
        if hidden_only:
            return x_BxTxD
        return output_logits(x_BxTxD, out_VxD, cfg.vocab)

    def _embed(self, wte_VxD, tokens_BxT, positions_BxT, dropout_keys) -> jax.Array:
        """The tokens' embeddings, plus their learned positions' (model.position learned), after dropout."""
        cfg, T = self.cfg, tokens_BxT.shape[1]
        x_BxTxD = jnp.take(wte_VxD, tokens_BxT, axis=0)
        if cfg.position == "learned":
            wpe_TxD = self.param("wpe", _named(nn.initializers.normal(0.01), "position", "embed"),
                                 (cfg.seq_len, cfg.d_model), jnp.float32)
            if positions_BxT is not None:
                positions = jnp.take(wpe_TxD, positions_BxT, axis=0)
            else:
                positions = wpe_TxD[:T]
            x_BxTxD = x_BxTxD + positions
        x_BxTxD = dropout_lib.drop(x_BxTxD, dropout_keys, cfg.embedding_dropout, dropout_lib.EMBEDDING_LAYER,
                                   dropout_lib.EMBEDDING)
        return x_BxTxD.astype(jnp.dtype(cfg.dtype))

    def _blocks(self):
        """The layers' loop: the blocks' parameters stacked along `layers` either way; unrolled, the loop is
        written out (scan's unroll), so no activation is stacked for the backward pass. Inside a scan the loop
        keeps XLA from merging a rematerialised forward pass with the first one; unrolled, the remat must.
        The remat policy is the config's, resolved (zerolm.parallel.auto: by the compile of a step, the least
        recomputed for a model outside it, which takes no gradient)."""
        cfg = self.cfg
        scanned = bool(cfg.scan_layers)
        block = Block
        if (layer_params := self.layer_params) is not None:
            block = nn.map_variables(Block, "params", trans_in_fn=lambda v: {"params": layer_params(v["params"])},
                                     mutable=False)
        block = nn.remat(block, prevent_cse=not scanned, policy=REMAT_POLICIES[cfg.remat])
        return nn.scan(block, variable_axes={"params": 0}, variable_carry="cache", split_rngs={"params": True},
                       in_axes=nn.broadcast, length=cfg.n_layer, unroll=1 if scanned else cfg.n_layer,
                       metadata_params={nn.PARTITION_NAME: "layers"})


def token_positions(cfg: ModelConfig, tokens_BxT: jax.Array, decoding: Decoding | None
                    ) -> tuple[jax.Array | None, jax.Array | None]:
    """(segment ids, positions) of a forward pass's tokens: decoding's row b sits at start_B[b] .. start_B[b]+T-1
    (one document from the row's start: a prompt is not document-masked); a document-masked
    sample has each token's document (`documents`), its positions counted from the sample's start or its
    document's; otherwise (None, None): one sequence at 0 .. T-1."""
    B, T = tokens_BxT.shape
    if decoding is not None:
        return None, decoding.start_B[:, None] + jnp.arange(T)
    if cfg.document_mask:
        return documents(tokens_BxT, cfg.eot, cfg.document_positions == "restart")
    return None, None


def norm(cfg: ModelConfig, dtype: jnp.dtype, name: str) -> nn.Module:
    """model.norm: GPT-2's LayerNorm (with a bias unless model.bias is false) or Llama's RMSNorm."""
    scale_init = _named(nn.initializers.ones, "embed")
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=dtype, name=name, scale_init=scale_init)
    return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=dtype, name=name, use_bias=cfg.bias, scale_init=scale_init,
                        bias_init=_named(nn.initializers.zeros, "embed"))


def output_embedding(params) -> jax.Array:
    """The output layer's (vocab, embed) matrix: `lm_head` where the model has its own (model.tie_embeddings
    false), else the token embedding `wte`."""
    return params["lm_head"] if "lm_head" in params else params["wte"]


def documents(tokens_BxT: jax.Array, eot_id: int, restart: bool) -> tuple[jax.Array, jax.Array]:
    """(segment ids, positions) of a packed sample's tokens: a document ends with its end-of-text token,
    so a token's segment is the number of end-of-text tokens before it; positions count from the sample's
    start, or (`restart`) from the token's document's."""
    eot_BxT = (tokens_BxT == eot_id).astype(jnp.int32)
    segment_ids_BxT = jnp.cumsum(eot_BxT, axis=1) - eot_BxT
    T = tokens_BxT.shape[1]
    index_BxT = jnp.broadcast_to(jnp.arange(T), tokens_BxT.shape)
    if not restart:
        return segment_ids_BxT, index_BxT
    # A document starts at 0 and after each end-of-text: the latest start at or before each token.
    starts_BxT = jnp.where(jnp.pad(eot_BxT[:, :-1], ((0, 0), (1, 0))) == 1, index_BxT, 0)
    return segment_ids_BxT, index_BxT - lax.cummax(starts_BxT, axis=1)


def output_logits(x_NxD: jax.Array, wte_VxD: jax.Array, vocab_size: int) -> jax.Array:
    """The tied output layer: float32 logits (the matmul accumulates in float32 whatever the compute
    dtype), the vocabulary's padding masked to -inf-like."""
    logits = jnp.einsum("...d,vd->...v", x_NxD, wte_VxD.astype(x_NxD.dtype), preferred_element_type=jnp.float32)
    return jnp.where(jnp.arange(wte_VxD.shape[0]) < vocab_size, logits, -1e30)


def init_params(model: GPT, rng: jax.Array):
    """Plain arrays (the logical names stripped: `logical_axes` has them)."""
    return nn.meta.unbox(_init_boxed(model, rng))


def _init_boxed(model: GPT, rng: jax.Array):
    return model.init(rng, jnp.zeros((1, model.cfg.seq_len), jnp.int32))["params"]


def init_cache(model: GPT, batch: int):
    """An empty KV cache for `batch` sequences: the `cache` collection `GPT(..., decoding=...)` updates, every
    layer's keys and values (layers, batch, kv heads, seq_len, head_dim) in the compute dtype. Made here, not
    by `init`: the layers' loop carries it whole (variable_carry), so it exists before the loop runs."""
    cfg = model.cfg
    shape = (cfg.n_layer, batch, cfg.kv_heads, cfg.seq_len, cfg.head_dim)
    return {"h": {"attn": {name: jnp.zeros(shape, jnp.dtype(cfg.dtype)) for name in ("k", "v")}}}


def logical_axes(model: GPT):
    """The params' logical axis names, as a tree of PartitionSpecs of names (no arrays are made)."""
    return nn.get_partition_spec(jax.eval_shape(functools.partial(_init_boxed, model), jax.random.key(0)))


def count_params(params, matmul_only: bool = False) -> int:
    """Every parameter, or (`matmul_only`, the N of MFU's 6·N: zerolm.observe.mfu) those a matmul reads: without the
    position table, and without the token embedding where the output layer has its own matrix (a lookup)."""
    n = sum(x.size for x in jax.tree.leaves(params))
    if not matmul_only:
        return n
    lookups = ("wpe", "wte") if "lm_head" in params else ("wpe",)
    return n - sum(params[k].size for k in lookups if k in params)
