"""What only tests and benchmarks need: the batch layout built by hand, the bytes each device holds, and
instructions counted inside and outside loops. Benchmarks import it with `tests/` on their path."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zerolm.compile import hlo


def to_accum_layout(rows: np.ndarray, n_devices: int, accum: int, micro: int) -> np.ndarray:
    """(n_devices · accum · micro, T) rows -> (accum, n_devices · micro, T): device d's contiguous block
    of rows, split into `accum` micro-batches of `micro`."""
    T = rows.shape[-1]
    return rows.reshape(n_devices, accum, micro, T).transpose(1, 0, 2, 3).reshape(accum, n_devices * micro, T)


def bytes_per_device(tree: Any) -> dict[jax.Device, int]:
    """Bytes of a (sharded) pytree that each local device actually holds."""
    per_device: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return per_device


def ops_in_loops(hlo_text: str, opcode: str) -> tuple[int, int]:
    """(instructions of `opcode` inside a while body or what it calls, instructions of it elsewhere)."""
    program = hlo.program(hlo_text)
    counts = [0, 0]
    for name, ins in program.instructions():
        counts[name not in program.in_loop] += ins.opcode == opcode
    return counts[0], counts[1]


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
