"""Tokenizers: the default byte-level BPE, trained on the corpus on first use and cached on disk."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"


def cache_dir() -> Path:
    """Where built artefacts (tokenizers, tokenized corpora) are cached: $ZEROLM_CACHE or ~/.cache/zerolm."""
    return Path(os.environ.get("ZEROLM_CACHE", Path.home() / ".cache" / "zerolm"))


class Tokenizer:
    """A Hugging Face `tokenizers` tokenizer with an end-of-text token, and an identity for manifests."""

    def __init__(self, tok: tokenizers.Tokenizer, name: str):
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"tokenizer {name}: has no {EOT} token")
        self._tok = tok
        self.name = name
        self.eot_id = eot
        self.vocab_size = tok.get_vocab_size()
        self.sha256 = hashlib.sha256(tok.to_str().encode()).hexdigest()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(list(texts))]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def train_bpe(documents: Sequence[str], vocab_size: int) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def load_tokenizer(spec: str, vocab_size: int, documents: Sequence[str]) -> Tokenizer:
    """`default`: BPE trained on `documents` (cached by vocabulary size); otherwise a tokenizer.json path."""
    if spec != "default":
        path = Path(spec)
        try:
            return Tokenizer(tokenizers.Tokenizer.from_file(str(path)), name=path.name)
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise ValueError(f"{path}: cannot load tokenizer ({e})") from None
    path = cache_dir() / f"tokenizer-kjv-bpe{vocab_size}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        train_bpe(documents, vocab_size).save(str(tmp))
        os.replace(tmp, path)  # atomic: a concurrent or killed run never sees half a file
    return Tokenizer(tokenizers.Tokenizer.from_file(str(path)), name=f"kjv-bpe{vocab_size}")
