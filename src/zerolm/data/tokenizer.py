"""Tokenizers: the default byte-level BPE trained on the corpus (cached), a Hugging Face
`tokenizer.json`, or a tiktoken BPE file. Each has an end-of-text token and an identity (name and
the sha256 of its file) that prepared datasets and checkpoints record.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tiktoken
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from zerolm.core.errors import ZerolmError
from zerolm.core.storage import cache_dir


class TokenizerError(ZerolmError):
    """A tokenizer file that cannot be used; one line naming it."""


EOT = "<|endoftext|>"
# A tokenizer.json's end-of-text token, the first of these it has: GPT-2's (and zerolm's own BPE's), Llama 3's,
# and the sentencepiece-era Llama's and Mistral's end of sequence.
END_OF_TEXT = (EOT, "<|end_of_text|>", "</s>")
MIN_BPE_VOCAB = 257  # a byte-level BPE holds the 256 bytes and the end-of-text token at least
# GPT-2's pre-tokenization regex (tiktoken's r50k_base); a .tiktoken file carries only the ranks.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Tokenizer:
    """Encode/decode over either backend, plus what a manifest needs to identify it."""

    def __init__(self, kind: str, backend, name: str, file_bytes: bytes, where: str | None = None):
        self.kind = kind  # "hf" | "tiktoken"
        self._backend = backend
        self.name = name
        self.file_bytes = file_bytes
        self.sha256 = hashlib.sha256(file_bytes).hexdigest()
        if kind == "hf":
            eot_id = next((i for i in map(backend.token_to_id, END_OF_TEXT) if i is not None), None)
            self.vocab_size = backend.get_vocab_size()
        else:
            eot_id = backend.eot_token
            self.vocab_size = backend.n_vocab
        if eot_id is None:
            raise TokenizerError(f"{where or f'tokenizer {name}'}: has no end-of-text token (none of "
                                 f"{', '.join(END_OF_TEXT)})")
        self.eot_id: int = eot_id
        self.eot_text: str = backend.id_to_token(eot_id) if kind == "hf" else EOT  # the end-of-text token's text

    @property
    def identity(self) -> dict:
        return {"kind": self.kind, "name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "eot_id": self.eot_id}

    @property
    def filename(self) -> str:
        return "tokenizer.json" if self.kind == "hf" else "tokenizer.tiktoken"

    def save(self, directory: Path) -> Path:
        path = directory / self.filename
        path.write_bytes(self.file_bytes)
        return path

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encoded in parallel on all cores (threads in both backends; one where TOKENIZERS_PARALLELISM is
        false, as in `zerolm prepare`'s worker processes)."""
        if self.kind == "hf":
            return [np.asarray(e.ids, dtype=np.int32) for e in self._backend.encode_batch(list(texts))]
        threads = 1 if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() == "false" else 8
        return [np.asarray(ids, dtype=np.int32)
                for ids in self._backend.encode_ordinary_batch(list(texts), num_threads=threads)]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._backend.decode([int(i) for i in ids])

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for (its bytes: every byte of a text is in one of
        its tokens, and a character is a byte at least), so a text of more than n times this has more than n
        tokens. None for a Hugging Face tokenizer that is not byte-level or normalizes the text first (it
        may drop or merge characters: no such bound holds)."""
        if self.kind == "tiktoken":
            return max(len(token) for token in self._backend.token_byte_values())
        if self._backend.normalizer is not None or "ByteLevel" not in repr(self._backend.pre_tokenizer):
            return None
        return max(len(token) for token in self._backend.get_vocab())  # byte-level: a character per byte


def train_bpe(documents: Sequence[str], vocab_size: int) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def from_file(path: Path) -> Tokenizer:
    """A tokenizer.json (Hugging Face) or, for any other name, a tiktoken BPE file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read tokenizer ({e.strerror})") from None
    return from_bytes(path.name, data, where=str(path))


def from_bytes(name: str, data: bytes, where: str | None = None) -> Tokenizer:
    """A tokenizer from its file's bytes: `name` ending in .json is Hugging Face's, any other a tiktoken
    BPE file (base64 token, rank per line)."""
    try:
        if name.endswith(".json"):
            return Tokenizer("hf", tokenizers.Tokenizer.from_str(data.decode()), name, data, where)
        ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines()
                                                                        if line)}
        enc = tiktoken.Encoding(Path(name).stem, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                special_tokens={EOT: len(ranks)})
        return Tokenizer("tiktoken", enc, name, data)
    except TokenizerError:
        raise
    except Exception as e:  # tokenizers raises a bare Exception on a bad file, tiktoken a ValueError
        raise TokenizerError(f"{where or name}: not a valid tokenizer file ({e})") from None


def load_tokenizer(spec: str, vocab_size: int = 2048, documents: Sequence[str] = ()) -> Tokenizer:
    """`default`: BPE trained on `documents`, cached by vocabulary size; otherwise a file path."""
    if spec != "default":
        return from_file(Path(spec))
    path = cache_dir() / f"tokenizer-bpe{vocab_size}-{_corpus_hash(documents)}.json"
    if not path.exists():
        if not documents:
            raise ValueError("the default tokenizer is trained on the corpus, but no documents were given")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        train_bpe(documents, vocab_size).save(str(tmp))
        os.replace(tmp, path)  # atomic: a concurrent or killed run never leaves half a file
    tok = from_file(path)
    tok.name = f"bpe{vocab_size}"
    return tok


def _corpus_hash(documents: Sequence[str]) -> str:
    h = hashlib.sha256()
    for d in documents:
        h.update(d.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]
