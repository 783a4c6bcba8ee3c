"""The GPT-2 decoder (pre-LayerNorm blocks, learned positions, GELU MLP, tied embeddings), in flax.

Pure: no sharding logic. Parameter names follow Hugging Face's GPT-2 (wte, wpe, h.attn.c_attn, ...)
so that an export is a renaming; the blocks are stacked along a leading layer axis by `nn.scan`,
which keeps compile time flat in depth.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from zerolm.config import ModelConfig

LN_EPS = 1e-5  # GPT-2's layer_norm_epsilon


def compute_dtype(cfg: ModelConfig) -> jnp.dtype:
    if cfg.dtype == "auto":
        return jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32
    return jnp.dtype(cfg.dtype)


def attention_implementation(cfg: ModelConfig) -> str | None:
    """cuDNN flash attention needs a GPU and 16-bit inputs; elsewhere XLA's attention."""
    if cfg.attention == "auto":
        use_cudnn = jax.default_backend() == "gpu" and compute_dtype(cfg) in (jnp.bfloat16, jnp.float16)
        return "cudnn" if use_cudnn else "xla"
    return cfg.attention


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype
    implementation: str | None

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        B, T, D = x_BxTxD.shape
        H = self.cfg.n_head
        init = nn.initializers.normal(0.02)
        qkv = nn.Dense(3 * D, dtype=self.dtype, kernel_init=init, name="c_attn")(x_BxTxD)
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = (t.reshape(B, T, H, D // H) for t in jnp.split(qkv, 3, axis=-1))
        y = jax.nn.dot_product_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, is_causal=True,
                                         implementation=self.implementation)
        # GPT-2 scales the residual projections' init by 1/sqrt(2 * n_layer).
        proj_init = nn.initializers.normal(0.02 / math.sqrt(2 * self.cfg.n_layer))
        return nn.Dense(D, dtype=self.dtype, kernel_init=proj_init, name="c_proj")(y.reshape(B, T, D))


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        D = x_BxTxD.shape[-1]
        h = nn.Dense(4 * D, dtype=self.dtype, kernel_init=nn.initializers.normal(0.02), name="c_fc")(x_BxTxD)
        h = nn.gelu(h, approximate=True)  # GPT-2's "gelu_new"
        proj_init = nn.initializers.normal(0.02 / math.sqrt(2 * self.cfg.n_layer))
        return nn.Dense(D, dtype=self.dtype, kernel_init=proj_init, name="c_proj")(h)


class Block(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype
    implementation: str | None

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, _: None) -> tuple[jax.Array, None]:
        ln = lambda name: nn.LayerNorm(epsilon=LN_EPS, dtype=self.dtype, name=name)  # noqa: E731
        x_BxTxD = x_BxTxD + Attention(self.cfg, self.dtype, self.implementation, name="attn")(ln("ln_1")(x_BxTxD))
        x_BxTxD = x_BxTxD + MLP(self.cfg, self.dtype, name="mlp")(ln("ln_2")(x_BxTxD))
        return x_BxTxD, None


class GPT(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        """Float32 logits over the padded vocabulary; padded entries are -inf-like, so they get no mass."""
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        V, D = cfg.padded_vocab_size, cfg.d_model
        T = tokens_BxT.shape[1]
        wte_VxD = self.param("wte", nn.initializers.normal(0.02), (V, D), jnp.float32)
        wpe_TxD = self.param("wpe", nn.initializers.normal(0.01), (cfg.seq_len, D), jnp.float32)
        x_BxTxD = (jnp.take(wte_VxD, tokens_BxT, axis=0) + wpe_TxD[:T]).astype(dtype)

        block = nn.remat(Block, prevent_cse=False) if cfg.remat else Block
        blocks = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=cfg.n_layer, metadata_params={nn.PARTITION_NAME: None})
        x_BxTxD, _ = blocks(cfg, dtype, attention_implementation(cfg), name="h")(x_BxTxD, None)
        x_BxTxD = nn.LayerNorm(epsilon=LN_EPS, dtype=dtype, name="ln_f")(x_BxTxD)

        logits_BxTxV = jnp.einsum("btd,vd->btv", x_BxTxD, wte_VxD.astype(dtype)).astype(jnp.float32)
        real_vocab_V = jnp.arange(V) < cfg.vocab_size
        return jnp.where(real_vocab_V, logits_BxTxV, -1e30)


def token_cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Per-token next-token loss, gathering the target logit instead of building a one-hot over the vocabulary."""
    lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    target_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return lse_BxT - target_BxT


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    return jnp.mean(token_cross_entropy(logits_BxTxV, targets_BxT))


def token_losses(model: GPT, params, tokens_BxT1: jax.Array) -> jax.Array:
    """(B, seq_len) losses of a packed batch of seq_len + 1 tokens: inputs are [:-1], targets [1:]."""
    logits = model.apply({"params": params}, tokens_BxT1[:, :-1])
    return token_cross_entropy(logits, tokens_BxT1[:, 1:])


def lm_loss(model: GPT, params, tokens_BxT1: jax.Array) -> jax.Array:
    """Mean loss of a packed batch of seq_len + 1 tokens."""
    return jnp.mean(token_losses(model, params, tokens_BxT1))


def init_params(model: GPT, rng: jax.Array):
    return model.init(rng, jnp.zeros((1, model.cfg.seq_len), jnp.int32))["params"]


def count_params(params, exclude_positions: bool = False) -> int:
    n = sum(x.size for x in jax.tree.leaves(params))
    return n - (params["wpe"].size if exclude_positions else 0)
