"""A decoder block and its parts: the attention (its projections, grouped-query heads, rotary positions, and the
attention itself, zerolm.model.attention; over a KV cache when decoding), the MLP (GELU or SwiGLU), the norms, and
the block that joins them, sequential (GPT-2) or with a parallel residual (GPT-NeoX, GPT-J)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from zerolm.config.model import ResolvedModelConfig
from zerolm.model import dropout as dropout_lib
from zerolm.model.attention import Bias, Dropout, Positions, alibi_slopes, cached_attention, causal_attention
from zerolm.model.projections import Linear, Weights, fused_in, fused_out, linear, named, proj_init, tp_groups
from zerolm.model.rotary import Rope, rotate


class Decoding(NamedTuple):
    """A forward pass over a KV cache: row b's tokens sit at positions start_B[b] onwards (each row its own
    sequence, at its own length: prompts of any lengths decode together)."""

    start_B: jax.Array  # (B,) int32
    layer: Any = 0  # the layer whose cache an attention reads and writes (the layers' loop sets it)


class Attention(nn.Module):
    cfg: ResolvedModelConfig
    dtype: jnp.dtype
    implementation: str

    def setup(self):
        """With as many key/value heads as query heads, one `c_attn` kernel (d, 3, d) = (embed, qkv, heads), GPT-2's
        Conv1D column for column; with fewer (grouped-query attention), `c_q` (d, d) and `c_kv` (d, 2, G·K) =
        (embed, qkv, kv_heads), so tensor parallelism splits whole key/value heads with their groups of query heads."""
        cfg, D = self.cfg, self.cfg.d_model
        dense = functools.partial(Linear, D, kernel_init=nn.initializers.normal(0.02), use_bias=cfg.bias)
        if cfg.n_kv_head == cfg.n_head:
            self.c_attn = dense((3, D), ("embed", "qkv", "heads"))
        else:
            self.c_q = dense((D,), ("embed", "heads"))
            self.c_kv = dense((2, cfg.n_kv_head * cfg.head_dim), ("embed", "qkv", "kv_heads"))
        self.c_proj = Linear(D, (D,), ("heads", "embed"), proj_init(cfg), cfg.bias)

    def in_weights(self) -> list[Weights]:
        """The input projections': c_attn's, or c_q's and c_kv's."""
        return [self.c_attn()] if self.cfg.n_kv_head == self.cfg.n_head else [self.c_q(), self.c_kv()]

    def in_names(self) -> list[str]:
        return ["c_attn"] if self.cfg.n_kv_head == self.cfg.n_head else ["c_q", "c_kv"]

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
        H, G, K = self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim
        if G == H:
            q, k, v = (projected[0][:, :, i].reshape(B, T, H, K) for i in range(3))
            return q, k, v
        k, v = (projected[1][:, :, i].reshape(B, T, G, K) for i in range(2))
        return projected[0].reshape(B, T, H, K), k, v

    def _cached_attention(self, q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, decoding: Decoding, slopes_H=None):
        """Decoding: write each row's S positions' keys and values (G = model.n_kv_head heads) into the `cache`
        collection at the row's start, then attend over the row's cached positions up to each query's own, with the
        attention training's XLA one runs (zerolm.model.attention.cached_attention). A cached position past a
        query's is never read, so what a row left there (a longer prompt's padding, an earlier request's tokens)
        does not matter."""
        B, S, G, K = k_BxSxGxK.shape
        T, L = self.cfg.seq_len, self.cfg.n_layer
        # Every layer's cache, (layers, B, G, T, K), carried whole through the layers' loop (not sliced and stacked
        # again by it): the new positions are written where they go, in place, and each layer's attention
        # multiplies its own, laid out as the products read it (batch dims first), with no copy transposed.
        cached = [self.variable("cache", name, jnp.zeros, (L, B, G, T, K), k_BxSxGxK.dtype) for name in ("k", "v")]
        rows_Bx1, columns_BxS = jnp.arange(B)[:, None], decoding.start_B[:, None] + jnp.arange(S)
        for var, new in zip(cached, (k_BxSxGxK, v_BxSxGxK), strict=True):
            var.value = var.value.at[decoding.layer, rows_Bx1, :, columns_BxS].set(new.astype(var.value.dtype),
                                                                                    mode="drop")
        keys_BxGxTxK, values_BxGxTxK = (var.value[decoding.layer] for var in cached)
        return cached_attention(q_BxSxHxK, keys_BxGxTxK, values_BxGxTxK, Positions(columns_BxS, jnp.arange(T)),
                                slopes_H)


class MLP(nn.Module):
    cfg: ResolvedModelConfig
    dtype: jnp.dtype

    def setup(self):
        cfg, D, F = self.cfg, self.cfg.d_model, self.cfg.mlp_hidden
        up = functools.partial(Linear, D, (F,), ("embed", "mlp"), nn.initializers.normal(0.02), cfg.bias)
        self.c_fc = up()
        if cfg.mlp == "swiglu":
            self.c_gate = up()
        self.c_proj = Linear(F, (D,), ("mlp", "embed"), proj_init(cfg), cfg.bias)

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


class Block(nn.Module):
    """Pre-norm attention and MLP: one after the other, each adding to the residual (GPT-2), or with
    `model.parallel_residual` both reading the block's input and adding together (GPT-NeoX: a norm each; with
    `model.shared_norm`, GPT-J: one, `ln_1`). The parallel block sums the two branches' output projections in one
    matmul (`fused_out`), and with one norm makes the gradient of their common input in one (`fused_in`), so that
    tensor parallelism reduces once where the sequential block reduces twice, in each direction; with residual
    dropout in training each branch's output is dropped with its own mask, so the two are projected apart."""

    cfg: ResolvedModelConfig
    dtype: jnp.dtype
    implementation: str

    @nn.compact
    def __call__(self, carry, decoding: Decoding | None, segment_ids_BxT: jax.Array | None,
                 keys_B: jax.Array | None, rope: Rope | None = None) -> tuple[Any, None]:
        """`carry`: (the hidden states, this layer's index), the index what a decoding step's cache and a dropout
        mask (with `keys_B`, each sample's key in training: zerolm.model.dropout) are drawn or written with."""
        cfg, ln = self.cfg, functools.partial(norm, self.cfg, self.dtype)
        x_BxTxD, layer = carry
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
            return (x_BxTxD, layer + 1), None
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
        return (x_BxTxD, layer + 1), None


def norm(cfg: ResolvedModelConfig, dtype: jnp.dtype, name: str) -> nn.Module:
    """model.norm: GPT-2's LayerNorm (with a bias unless model.bias is false) or Llama's RMSNorm."""
    scale_init = named(nn.initializers.ones, "embed")
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=dtype, name=name, scale_init=scale_init)
    return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=dtype, name=name, use_bias=cfg.bias, scale_init=scale_init,
                        bias_init=named(nn.initializers.zeros, "embed"))
