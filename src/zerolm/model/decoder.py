"""The decoder, in flax: one GPT whose layout is a set of settings that compose (the `model:` section,
zerolm.config.model), never a second model file.

- Positions (`model.position`): a learned table (GPT-2), ALiBi's attention biases (no table: a model
  evaluates past its trained context), or rotary embeddings (Llama's rotate-half form); computed once per
  forward pass (`token_positions`, zerolm.model.rotary), with a document mask (`model.document_mask`) per
  document.
- The block (zerolm.model.block): pre-norm attention and MLP, one after the other (GPT-2) or side by side
  (`model.parallel_residual`: GPT-NeoX's, with `model.shared_norm` GPT-J's, whose two branches' projections are
  one matmul each way: zerolm.model.projections); `model.norm` LayerNorm or RMSNorm, `model.bias`, `model.mlp` a
  GELU MLP (`model.activation`: tanh or exact) or SwiGLU (`model.mlp_hidden`), `model.n_kv_head` for
  grouped-query attention; the attention by implementation (zerolm.model.attention: one for training,
  evaluation and decoding over a KV cache); dropout on the embedding, the residual branches and the attention
  probabilities (zerolm.model.dropout).
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

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from zerolm.config.model import ResolvedModelConfig
from zerolm.model import dropout as dropout_lib
from zerolm.model.attention import SAVED
from zerolm.model.block import Block, Decoding, norm
from zerolm.model.projections import PROJECTIONS, named
from zerolm.model.rotary import rope_angles

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


class GPT(nn.Module):
    """`cfg` resolved for the device it runs on (zerolm.parallel.auto.model_settings, for_device): no `auto` left
    (dtype, attention, layer loop, remat, key/value heads, MLP width), so that tracing reads no global device."""

    cfg: ResolvedModelConfig
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
        wte_VxD = self.param("wte", named(nn.initializers.normal(0.02), "vocab", "embed"), (V, D), jnp.float32)
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
        (x_BxTxD, _), _ = self._blocks()(cfg, jnp.dtype(cfg.dtype), cfg.attention, name="h")(
            (x_BxTxD, jnp.int32(0)), decoding, segment_ids_BxT, dropout_keys, rope)
        x_BxTxD = norm(cfg, jnp.dtype(cfg.dtype), "ln_f")(x_BxTxD)
        out_VxD = wte_VxD
        if not cfg.tie_embeddings:  # the output layer's own matrix, (vocab, embed) as wte
            out_VxD = self.param("lm_head", named(nn.initializers.normal(0.02), "vocab", "embed"), (V, D), jnp.float32)
        if hidden_only:
            return x_BxTxD
        return output_logits(x_BxTxD, out_VxD, cfg.vocab_size)

    def _embed(self, wte_VxD, tokens_BxT, positions_BxT, dropout_keys) -> jax.Array:
        """The tokens' embeddings, plus their learned positions' (model.position learned), after dropout."""
        cfg, T = self.cfg, tokens_BxT.shape[1]
        x_BxTxD = jnp.take(wte_VxD, tokens_BxT, axis=0)
        if cfg.position == "learned":
            wpe_TxD = self.param("wpe", named(nn.initializers.normal(0.01), "position", "embed"),
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


def token_positions(cfg: ResolvedModelConfig, tokens_BxT: jax.Array, decoding: Decoding | None
                    ) -> tuple[jax.Array | None, jax.Array | None]:
    """(segment ids, positions) of a forward pass's tokens: decoding's row b sits at start_B[b] .. start_B[b]+T-1
    (one document from the row's start: a prompt is not document-masked); a document-masked
    sample has each token's document (`documents`), its positions counted from the sample's start or its
    document's; otherwise (None, None): one sequence at 0 .. T-1."""
    B, T = tokens_BxT.shape
    if decoding is not None:
        return None, decoding.start_B[:, None] + jnp.arange(T)
    if cfg.document_mask:
        assert cfg.eot_id != "auto"  # (zerolm.parallel.auto.model_settings: a document mask needs it)
        return documents(tokens_BxT, cfg.eot_id, cfg.document_positions == "restart")
    return None, None


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
    shape = (cfg.n_layer, batch, cfg.n_kv_head, cfg.seq_len, cfg.head_dim)
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
