"""The keys of a transformers `config.json` that `zerolm import-hf` accepts, per layout: an allow-list, listed
from what transformers' `GPT2LMHeadModel`, `MptForCausalLM`, `LlamaForCausalLM` and `GPTNeoXForCausalLM` read
(transformers 5's modeling and configuration files) and from the keys older versions wrote. Each key is

- *read*: it becomes a zerolm model setting (the shape, the norm's epsilon, rotary's base);
- *needed* at a value: it changes what transformers' forward pass computes, and zerolm's model computes the same
  only at the values listed (GPT-2's `scale_attn_weights: true`). A key the file leaves out takes
  transformers' default, which is always one of them;
- *inert*: the forward pass does not read it, reads it only in training (dropout rates), only for how it
  computes the same numbers (an attention implementation, float32 upcasting), or it is about what comes after
  the logits (token ids, sampling defaults, the labels of a classification head).

Any other key is refused: zerolm cannot tell what transformers computes with it. A nested config (MPT's
`attn_config`) has a table of its own, its keys named `attn_config.KEY`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Need(NamedTuple):
    ok: Callable[[Any, dict], bool]  # (the value, the config that holds it) -> zerolm computes the same
    what: str  # what zerolm's layout computes, in words


def one_of(*values: Any) -> Callable[[Any, dict], bool]:
    return lambda value, hf: value in values


@dataclass(frozen=True)
class Keys:
    read: frozenset[str] = frozenset()
    inert: frozenset[str] = frozenset()
    need: dict[str, Need] = field(default_factory=dict)
    nested: dict[str, Keys] = field(default_factory=dict)  # a key holding a config of its own
    # What several keys decide together, or a key left out (transformers' default): (the config) -> (the key to
    # name, its value, what zerolm computes) where zerolm would not compute the same, else None.
    whole: tuple[Callable[[dict], tuple[str, Any, str] | None], ...] = ()


# Every config's: what the file is and how transformers loads it, token ids and sampling defaults (generate's,
# after the logits), a fresh model's initialisation, what a call returns, fine-tuning heads' labels.
COMMON = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "auto_map", "dtype", "torch_dtype",
    "_commit_hash", "use_bfloat16", "torchscript", "tf_legacy_loss", "attn_implementation", "_attn_implementation",
    "_attn_implementation_autoset", "gradient_checkpointing", "cross_attention_hidden_size",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "initializer_range", "use_cache", "output_hidden_states", "output_attentions", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "tie_encoder_decoder", "id2label", "label2id",
    "num_labels", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
    "encoder_repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind"})
COMMON_NEED = {
    "add_cross_attention": Need(one_of(False, None), "no cross-attention (a decoder alone)"),
    "pruned_heads": Need(lambda value, hf: not value, "every attention head (none pruned)"),
}


def _table(read: set[str], inert: set[str], need: dict[str, Need], nested: dict[str, Keys] | None = None,
           whole: tuple = ()) -> Keys:
    return Keys(frozenset(read), COMMON | inert, {**COMMON_NEED, **need}, nested or {}, whole)


TIED = Need(one_of(True), "its output layer tied to the token embedding")

GPT2 = _table(
    read={"vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "layer_norm_epsilon"},
    inert={"n_ctx",  # older configs' copy of n_positions, read by nothing
           "resid_pdrop", "embd_pdrop", "attn_pdrop",  # dropout
           "reorder_and_upcast_attn",  # float32 scores, the same numbers in float32
           "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
           "summary_first_dropout", "summary_last_dropout"},  # GPT2DoubleHeadsModel's head
    need={"activation_function": Need(one_of("gelu_new", "gelu_pytorch_tanh"), "the tanh GELU (gelu_new)"),
          "n_inner": Need(lambda value, hf: value in (None, 4 * hf.get("n_embd", 768)), "an MLP of 4 × n_embd"),
          "scale_attn_weights": Need(one_of(True), "scores scaled by 1/√head_dim"),
          "scale_attn_by_inverse_layer_idx": Need(one_of(False), "the same score scale in every layer"),
          "tie_word_embeddings": TIED})

MPT_ATTENTION = _table(
    read=set(),
    inert={"attn_impl",  # torch, flash or triton: the same attention
           "attn_pdrop"},  # dropout
    need={"alibi": Need(one_of(True), "ALiBi positions"),
          "alibi_bias_max": Need(one_of(8), "ALiBi's slopes of bias max 8 (what transformers computes, whatever "
                                            "the file says)"),
          "softmax_scale": Need(one_of(None), "scores scaled by 1/√head_dim"),
          "clip_qkv": Need(one_of(None), "queries, keys and values unclipped"),
          "attn_type": Need(one_of("multihead_attention"), "multi-head attention"),
          "prefix_lm": Need(one_of(False), "causal attention at every position"),
          "qk_ln": Need(one_of(False), "no LayerNorm of the queries and keys"),
          "attn_uses_sequence_id": Need(one_of(False), "attention across the whole sample")})

MPT = _table(
    read={"vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len", "layer_norm_epsilon"},
    inert={"resid_pdrop", "emb_pdrop",  # dropout
           # transformers' MptForCausalLM has neither a position table nor biases, whatever these say (a tensor
           # of either in the weights is refused with them)
           "learned_pos_emb", "no_bias",
           "embedding_fraction",  # scales the embedding's gradient; the forward pass is the same
           "init_device", "init_config", "verbose", "tokenizer_name"},  # MosaicML's own code's
    need={"expansion_ratio": Need(one_of(4), "an MLP of 4 × d_model"),
          "logit_scale": Need(one_of(None), "unscaled logits"),
          "norm_type": Need(one_of("low_precision_layernorm", "layernorm"), "LayerNorms"),
          "tie_word_embeddings": TIED,
          "attn_config": Need(lambda value, hf: value is None or isinstance(value, dict), "attention set by a "
                                                                                          "mapping")},
    nested={"attn_config": MPT_ATTENTION})

ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def _unscaled_rope(value: Any, hf: dict, whole_head: bool = True) -> bool:
    """Rotary positions as zerolm computes them: no scaling (transformers' `rope_type: default`, or the older
    `type`), the whole head rotated (unless another check sees to that: GPT-NeoX's `_whole_heads`)."""
    if value is None:
        return True
    return (isinstance(value, dict) and set(value) <= ROPE_KEYS
            and value.get("rope_type", value.get("type", "default")) == "default"
            and (not whole_head or value.get("partial_rotary_factor") in (None, 1, 1.0)))


UNSCALED = Need(_unscaled_rope, "rotary positions without scaling (rope_type default)")
UNSCALED_ANY_PART = Need(lambda value, hf: _unscaled_rope(value, hf, whole_head=False), UNSCALED.what)

LLAMA = _table(
    read={"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_theta"},
    inert={"attention_dropout",  # dropout
           "pretraining_tp"},  # how transformers 4 split the same matmuls; 5 reads it not
    need={"hidden_act": Need(one_of("silu"), "SwiGLU (silu)"),
          "attention_bias": Need(one_of(False, None), "attention without biases"),
          "mlp_bias": Need(one_of(False, None), "an MLP without biases"),
          "head_dim": Need(lambda value, hf: value in (None, hf.get("hidden_size", 4096) // hf.get("num_attention_heads", 32)),
                           "heads of hidden_size / num_attention_heads"),
          # transformers 5 reads `rope_scaling` (older files' key) first, then `rope_parameters`
          "rope_scaling": UNSCALED, "rope_parameters": UNSCALED})



def rope_of(hf: dict) -> dict:
    """The rotary settings transformers 5 reads: `rope_scaling` (older files' key) over `rope_parameters`."""
    return hf.get("rope_scaling") or hf.get("rope_parameters") or {}


def _whole_heads(hf: dict) -> tuple[str, Any, str] | None:
    """GPT-NeoX rotates the first rotary_pct of each head (transformers 5: rope_parameters' partial_rotary_factor, or
    the older rotary_pct, else 0.25); zerolm rotates the whole head."""
    rope = rope_of(hf)
    key = next((k for k in ("rope_scaling", "rope_parameters") if "partial_rotary_factor" in (hf.get(k) or {})),
               "rotary_pct")
    factor = rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    if factor in (1, 1.0):
        return None
    return key, hf.get(key, factor), "rotary positions over each whole head (rotary_pct 1; transformers' default 0.25)"


GPT_NEOX = _table(
    read={"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
          "max_position_embeddings", "layer_norm_eps", "use_parallel_residual", "tie_word_embeddings",
          "rotary_emb_base", "rotary_pct"},  # (rotary_pct: `_whole_heads`)
    inert={"hidden_dropout", "attention_dropout", "classifier_dropout", "attention_probs_dropout_prob",
           "hidden_dropout_prob"},  # dropout, and the classification head's
    need={"hidden_act": Need(one_of("gelu", "gelu_new", "gelu_pytorch_tanh"), "the exact or the tanh GELU"),
          "attention_bias": Need(one_of(True, None), "attention with biases"),
          "rope_scaling": UNSCALED_ANY_PART, "rope_parameters": UNSCALED_ANY_PART},
    whole=(_whole_heads,))

TABLES = {"gpt2": GPT2, "mpt": MPT, "llama": LLAMA, "gpt_neox": GPT_NEOX}


def first_refused(hf: dict, keys: Keys, prefix: str = "") -> tuple[str, Any, str | None] | None:
    """The first key of `hf` the table refuses: (its name, its value, what zerolm computes instead, or None for
    a key the table does not know); None if every key is accepted."""
    for key, value in hf.items():
        name = prefix + key
        if key in keys.need and not keys.need[key].ok(value, hf):
            return name, value, keys.need[key].what
        if key in keys.nested and isinstance(value, dict):
            if refused := first_refused(value, keys.nested[key], name + "."):
                return refused
        elif key not in keys.need and key not in keys.read | keys.inert:
            return name, value, None
    return next((refused for check in keys.whole if (refused := check(hf))), None)
