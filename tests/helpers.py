"""What only tests need: a small transformers model on disk, the config's `zero:` section. What benchmarks need
too lives in benchmarks/lib/ (a built step looked at from outside: benchmarks.lib.steps), named here for the tests
that import it from this module."""

from __future__ import annotations

from typing import Any

from benchmarks.lib.steps import bytes_per_device, to_accum_layout

__all__ = ["bytes_per_device", "tiny_transformers_model", "to_accum_layout", "zero_settings"]


def tiny_transformers_model(directory, kind: str = "gpt2", end_of_text: str = "<|endoftext|>"):
    """A two-layer transformers model of `kind` (gpt2, mpt or llama; d 32, 4 heads, context 32) with random
    weights, and a byte-level BPE of under 300 tokens whose end-of-text is `end_of_text`, saved as transformers saves
    them (config.json, model.safetensors, tokenizer.json): a model directory import-hf reads. Its transformers
    model."""
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["In the beginning God created the heaven and the earth."] * 50, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=[end_of_text], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = tok.get_vocab_size()
    shape = {"vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 0}
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, **shape)
    elif kind == "mpt":
        config = transformers.MptConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=32, **shape)
    else:
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          **shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    return model


def zero_settings(**overrides: Any):
    """The config's `zero:` section as configs/defaults.yaml sets it, with `overrides` (stage=3, ...): what
    zerolm.parallel.zero.Zero takes."""
    from zerolm.config.load import DEFAULTS, load_config

    return load_config(DEFAULTS).zero.model_copy(update=overrides)
