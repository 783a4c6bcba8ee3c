"""The GPT-2 decoder (pre-LayerNorm blocks, learned positions, GELU MLP, tied embeddings), in flax.

Pure: no sharding logic. Each parameter carries *logical* axis names (`vocab`, `embed`, `heads`,
`mlp`, `qkv`, `position`, `layers`), which say what an axis means; `zerolm.sharding`'s rule table
decides which mesh axis, if any, splits it. Parameter names follow Hugging Face's GPT-2 (wte, wpe,
h.attn.c_attn, ...). `c_attn`'s kernel is (d, 3, d) = (embed, qkv, heads), so that tensor
parallelism splits whole heads of q, k and v; reshaped to (d, 3·d) it is GPT-2's, column for column.
The blocks are stacked along a leading `layers` axis by `nn.scan`, which keeps compile time flat in
depth.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zerolm.attention import BLOCK, SAVED, causal_attention, pallas_available, pallas_fits
from zerolm.config import ModelConfig
from zerolm.hardware import tpu_generation

LN_EPS = 1e-5  # GPT-2's layer_norm_epsilon

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


_cp = jax.checkpoint_policies
REMAT_POLICIES = {
    # Every matmul's output (XLA's attention is batched dots: its scores and output) and the attention's.
    "none": _cp.save_from_both_policies(_cp.dots_saveable, _attention_saved),
    "full": _cp.nothing_saveable,
    "dots": _cp.dots_with_no_batch_dims_saveable,
    "attention": _attention_saved,
    "dots_attention": _cp.save_from_both_policies(_cp.dots_with_no_batch_dims_saveable, _attention_saved),
}


def for_device(cfg: ModelConfig, device: jax.Device | None = None) -> ModelConfig:
    """`dtype: auto` and `attention: auto` made concrete for the device the model will run on (default:
    this process's first): a TPU slice compiled for ahead of time is not this machine's backend.

    dtype: bfloat16 on GPU and TPU, float32 on CPU. attention: cuDNN flash attention on a GPU with 16-bit
    compute; Pallas's flash attention on TPU v4 and later, the blockwise attention on TPU v2/v3 (neither
    holds T×T scores; zerolm.attention); XLA's on CPU."""
    device = device or jax.devices()[0]
    dtype, attention = resolve_auto(cfg.dtype, cfg.attention, device.platform, device.device_kind, cfg.seq_len,
                                    cfg.attention_block)
    return cfg.model_copy(update={"dtype": dtype, "attention": attention,
                                  "scan_layers": resolve_scan_layers(cfg.scan_layers, device.platform, cfg.remat)})


def resolve_scan_layers(scan_layers: bool | str, platform: str, remat: str = "none") -> bool:
    """`model.scan_layers: auto` on `platform`, with `model.remat`: unrolled on a GPU without remat, where
    the compiled step of a scan keeps stacked buffers of the layers' activations, zero-filled every
    micro-step, and moves more bytes (1_3b on an H100 at micro-batch 8: 1.24× the bytes of the unrolled
    step); a scan with a remat policy that recomputes (unrolled, XLA may undo the recomputation: 760m on
    eight H100s at one micro-step, full remat, 73.5 GiB unrolled against 12.7 in a scan), on a TPU (unrolling
    1_3b cost 6× the compile time and 5 GiB more) and on a CPU. docs/performance-notes.md has the figures."""
    if scan_layers != "auto":
        return bool(scan_layers)
    return platform.lower() not in ("gpu", "cuda", "rocm") or remat not in ("none", "auto")


def unrunnable_attention(cfg: ModelConfig, device: jax.Device) -> str | None:
    """Why `cfg`'s attention cannot run on `device` (a one-line error naming the key), or None."""
    if cfg.attention == "pallas" and (device.platform != "tpu" or (tpu_generation(device.device_kind) or 0) < 4):
        return (f"model.attention: pallas runs on TPU v4 and later, not on {device.device_kind} ({device.platform}); "
                "use auto or blockwise")
    if cfg.attention == "cudnn" and device.platform not in ("gpu", "cuda"):
        return f"model.attention: cudnn runs on NVIDIA GPUs, not on {device.device_kind} ({device.platform}); use auto"
    return None


def resolve_auto(dtype: str, attention: str, platform: str, device_kind: str = "", seq_len: int | None = None,
                 block: int = BLOCK) -> tuple[str, str]:
    """The rule behind `for_device` (and the planner's device presets): (dtype, attention) on `platform`
    (a JAX platform name: cpu, gpu/cuda/rocm, tpu) and `device_kind` (a TPU's generation; a preset name
    will do). On TPU v4+ auto takes Pallas when this JAX has its kernel and the sequence cuts into blocks
    of whole 128-lane multiples, the blockwise attention otherwise."""
    platform = platform.lower()
    gpu = platform in ("gpu", "cuda", "rocm")
    if dtype == "auto":
        dtype = "bfloat16" if gpu or platform == "tpu" else "float32"
    if attention == "auto":
        if gpu:
            attention = "cudnn" if dtype in ("bfloat16", "float16") else "xla"
        elif platform == "tpu":
            pallas = ((tpu_generation(device_kind) or 0) >= 4 and pallas_available()
                      and (seq_len is None or pallas_fits(seq_len, block)))
            attention = "pallas" if pallas else "blockwise"
        else:
            attention = "xla"
    return dtype, attention


def compute_dtype(cfg: ModelConfig) -> jnp.dtype:
    return jnp.dtype(for_device(cfg).dtype if cfg.dtype == "auto" else cfg.dtype)


def scan_layers(cfg: ModelConfig) -> bool:
    return bool(for_device(cfg).scan_layers) if cfg.scan_layers == "auto" else bool(cfg.scan_layers)


def attention_implementation(cfg: ModelConfig) -> str:
    return for_device(cfg).attention if cfg.attention == "auto" else cfg.attention


def _named(init, *axes: str):
    """An initializer whose parameter carries logical axis names (metadata; see zerolm.sharding)."""
    return nn.with_logical_partitioning(init, axes)


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype
    implementation: str

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, start: jax.Array | None = None,
                 segment_ids_BxT: jax.Array | None = None) -> jax.Array:
        B, T, D = x_BxTxD.shape
        H = self.cfg.n_head
        init = nn.initializers.normal(0.02)
        qkv_BxTx3xD = nn.DenseGeneral((3, D), dtype=self.dtype, name="c_attn",
                                      kernel_init=_named(init, "embed", "qkv", "heads"),
                                      bias_init=_named(nn.initializers.zeros, "qkv", "heads"))(x_BxTxD)
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = (qkv_BxTx3xD[:, :, i].reshape(B, T, H, D // H) for i in range(3))
        if start is None:
            y = causal_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, self.implementation, self.cfg.attention_block,
                                 segment_ids_BxT)
        else:
            y = self._cached_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, start)
        # GPT-2 scales the residual projections' init by 1/sqrt(2 * n_layer).
        proj_init = nn.initializers.normal(0.02 / math.sqrt(2 * self.cfg.n_layer))
        return nn.Dense(D, dtype=self.dtype, kernel_init=_named(proj_init, "heads", "embed"),
                        bias_init=_named(nn.initializers.zeros, "embed"), name="c_proj")(y.reshape(B, T, D))


    def _cached_attention(self, q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, start):
        """Decoding: write these S positions' keys and values into the `cache` collection at `start`,
        then attend over every cached position up to each query's own."""
        B, S, H, K = q_BxSxHxK.shape
        T = self.cfg.seq_len
        cached = [self.variable("cache", name, jnp.zeros, (B, T, H, K), k_BxSxHxK.dtype) for name in ("k", "v")]
        for var, new in zip(cached, (k_BxSxHxK, v_BxSxHxK), strict=True):
            var.value = lax.dynamic_update_slice(var.value, new.astype(var.value.dtype), (0, start, 0, 0))
        visible_SxT = jnp.arange(T)[None, :] <= (start + jnp.arange(S))[:, None]
        return jax.nn.dot_product_attention(q_BxSxHxK, cached[0].value, cached[1].value,
                                            mask=visible_SxT[None, None], implementation="xla")


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        D = x_BxTxD.shape[-1]
        h = nn.Dense(4 * D, dtype=self.dtype, kernel_init=_named(nn.initializers.normal(0.02), "embed", "mlp"),
                     bias_init=_named(nn.initializers.zeros, "mlp"), name="c_fc")(x_BxTxD)
        h = nn.gelu(h, approximate=True)  # GPT-2's "gelu_new"
        proj_init = nn.initializers.normal(0.02 / math.sqrt(2 * self.cfg.n_layer))
        return nn.Dense(D, dtype=self.dtype, kernel_init=_named(proj_init, "mlp", "embed"),
                        bias_init=_named(nn.initializers.zeros, "embed"), name="c_proj")(h)


class Block(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype
    implementation: str

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, start: jax.Array | None,
                 segment_ids_BxT: jax.Array | None) -> tuple[jax.Array, None]:
        ln = lambda name: nn.LayerNorm(epsilon=LN_EPS, dtype=self.dtype, name=name,  # noqa: E731
                                       scale_init=_named(nn.initializers.ones, "embed"),
                                       bias_init=_named(nn.initializers.zeros, "embed"))
        x_BxTxD = x_BxTxD + Attention(self.cfg, self.dtype, self.implementation, name="attn")(ln("ln_1")(x_BxTxD),
                                                                                             start, segment_ids_BxT)
        x_BxTxD = x_BxTxD + MLP(self.cfg, self.dtype, name="mlp")(ln("ln_2")(x_BxTxD))
        return x_BxTxD, None


class GPT(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxT: jax.Array, *, hidden_only: bool = False,
                 start: jax.Array | None = None) -> jax.Array:
        """Float32 logits over the padded vocabulary; padded entries are -inf-like, so they get no mass.

        `hidden_only`: the final LayerNorm's output instead, for a loss that applies the (tied)
        output layer itself, chunk by chunk (or a sampler, at one position).
        `start`: decode with a KV cache (the mutable `cache` collection, see `init_cache`): the tokens
        sit at positions start .. start+T-1 and attend to the cached positions before them."""
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        V, D = cfg.padded_vocab_size, cfg.d_model
        T = tokens_BxT.shape[1]
        wte_VxD = self.param("wte", _named(nn.initializers.normal(0.02), "vocab", "embed"), (V, D), jnp.float32)
        wpe_TxD = self.param("wpe", _named(nn.initializers.normal(0.01), "position", "embed"), (cfg.seq_len, D),
                             jnp.float32)
        segment_ids_BxT = None
        if start is not None:  # decoding: one document, from the cached positions on
            positions = lax.dynamic_slice_in_dim(wpe_TxD, start, T)
        elif cfg.document_mask:
            segment_ids_BxT, positions_BxT = documents(tokens_BxT, cfg.eot, cfg.document_positions == "restart")
            positions = jnp.take(wpe_TxD, positions_BxT, axis=0)
        else:
            positions = wpe_TxD[:T]
        x_BxTxD = (jnp.take(wte_VxD, tokens_BxT, axis=0) + positions).astype(dtype)

        # The layers' parameters are stacked along `layers` either way; unrolled, the loop is written out
        # (scan's unroll), so no activation is stacked for the backward pass. Inside a scan the loop keeps
        # XLA from merging a rematerialised forward pass with the first one; unrolled, the remat must.
        # remat auto is resolved where the step is compiled (zerolm.step.build_and_compile); a model outside
        # the step (evaluation, sampling) takes no gradient, so any policy computes the same.
        scanned = scan_layers(cfg)
        policy = REMAT_POLICIES["none" if cfg.remat == "auto" else cfg.remat]
        block = nn.remat(Block, prevent_cse=not scanned, policy=policy)
        blocks = nn.scan(block, variable_axes={"params": 0, "cache": 0}, split_rngs={"params": True},
                         in_axes=nn.broadcast, length=cfg.n_layer, unroll=1 if scanned else cfg.n_layer,
                         metadata_params={nn.PARTITION_NAME: "layers"})
        x_BxTxD, _ = blocks(cfg, dtype, attention_implementation(cfg), name="h")(x_BxTxD, start, segment_ids_BxT)
        x_BxTxD = nn.LayerNorm(epsilon=LN_EPS, dtype=dtype, name="ln_f", scale_init=_named(nn.initializers.ones, "embed"),
                               bias_init=_named(nn.initializers.zeros, "embed"))(x_BxTxD)
        if hidden_only:
            return x_BxTxD
        return output_logits(x_BxTxD, wte_VxD, cfg.vocab)


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


def token_cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Per-token next-token loss, gathering the target logit instead of building a one-hot over the vocabulary."""
    lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    target_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return lse_BxT - target_BxT


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    return jnp.mean(token_cross_entropy(logits_BxTxV, targets_BxT))


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


def _fused_forward(x_BxTxD, wte_VxD, targets_BxT, vocab_size, chunk):
    x_CxKxD, t_CxK, real_CxK = _chunks(x_BxTxD, targets_BxT, chunk)
    n = targets_BxT.size
    wte_c = wte_VxD.astype(x_BxTxD.dtype)

    def one(dwte_VxD, xtm):
        x_KxD, t_K, real_K = xtm
        logits_KxV = output_logits(x_KxD, wte_VxD, vocab_size)
        lse_K = jax.nn.logsumexp(logits_KxV, axis=-1)
        target_K = jnp.take_along_axis(logits_KxV, t_K[:, None], axis=-1)[:, 0]
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
    return chunked_token_cross_entropy(x_BxTxD, params["wte"], targets_BxT, model.cfg.vocab, chunk)


def _apply(model: GPT, params, inputs_BxT: jax.Array, **kw) -> jax.Array:
    """The model's output (logits, or hidden states with hidden_only), no state mutated."""
    out = model.apply({"params": params}, inputs_BxT, **kw)
    assert isinstance(out, jax.Array)
    return out


def lm_loss(model: GPT, params, tokens_BxT1: jax.Array) -> jax.Array:
    """Mean loss of a packed batch of seq_len + 1 tokens: the training loss (fused, and chunked when the
    micro-batch has more tokens than model.loss_chunk; plain autodiff when it is 0)."""
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    chunk = model.cfg.loss_chunk
    if not chunk:
        return jnp.mean(token_losses(model, params, tokens_BxT1))
    # A micro-batch of at most one chunk is one chunk: still fused, so autodiff keeps no extra copy of
    # the float32 logits (the TPU compiler's buffer assignment showed three).
    x_BxTxD = model.apply({"params": params}, inputs_BxT, hidden_only=True)
    return fused_mean_cross_entropy(x_BxTxD, params["wte"], targets_BxT, model.cfg.vocab_size,
                                    min(chunk, targets_BxT.size))


def init_params(model: GPT, rng: jax.Array):
    """Plain arrays (the logical names stripped: `logical_axes` has them)."""
    return nn.meta.unbox(_init_boxed(model, rng))


def _init_boxed(model: GPT, rng: jax.Array):
    return model.init(rng, jnp.zeros((1, model.cfg.seq_len), jnp.int32))["params"]


def init_cache(model: GPT, batch: int):
    """An empty KV cache for `batch` sequences: the `cache` collection `GPT(..., start=...)` updates,
    (layers, batch, seq_len, heads, head_dim) keys and values in the compute dtype."""
    def shapes():
        return model.init(jax.random.key(0), jnp.zeros((batch, 1), jnp.int32), start=jnp.int32(0))["cache"]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(shapes))


def logical_axes(model: GPT):
    """The params' logical axis names, as a tree of PartitionSpecs of names (no arrays are made)."""
    return nn.get_partition_spec(jax.eval_shape(functools.partial(_init_boxed, model), jax.random.key(0)))


def count_params(params, exclude_positions: bool = False) -> int:
    n = sum(x.size for x in jax.tree.leaves(params))
    return n - (params["wpe"].size if exclude_positions else 0)
