"""Words and n-grams as GPT-3 measured benchmark contamination (Brown et al. 2020, appendix C; the method
lm-evaluation-harness carries in lm_eval/decontamination/), and a set of them found in text.

A text's words are its whitespace-separated tokens, each lower-cased with its punctuation deleted
(ASCII's, the harness's set, and every character of Unicode's punctuation categories); a token that was
all punctuation is no word. Its n-grams are its runs of n consecutive words. A document shorter than n
words counts by its whole length: its one n-gram is all its words.

`NgramSet` holds the n-grams of some named groups of documents (a benchmark's tasks) as 64-bit hashes,
sorted, with the documents each belongs to: about 20 bytes an n-gram, whatever the text it is looked for
in. A word's hash is the first 8 bytes of its blake2b digest; an n-gram's is a polynomial in its words'
hashes modulo 2^64 (salted by its length), so every window of a long text is hashed at once with numpy
from prefix sums. Two different n-grams share a hash with probability 2^-64: across a 10^12-word corpus
and a million task n-grams, about one chance in 20 of a single false match. `Matcher` finds them in
texts: a word outside the set's vocabulary can be in none of its n-grams, so each text's tokens are
looked up once (with a cache of tokens already normalized) and only windows of known words are hashed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import string
import sys
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

# The polynomial's base (odd, so a unit modulo 2^64) and its inverse.
_BASE = 0x9E3779B97F4A7C15
_BASE_INVERSE = pow(_BASE, -1, 2**64)
_UNKNOWN, _EMPTY, _BREAK = -1, -2, -3  # a token outside the vocabulary; all punctuation; between two texts
CACHE_TOKENS = 1 << 18  # tokens a Matcher remembers normalizing, at most (then it starts again)


@functools.cache
def _punctuation() -> dict[int, None]:
    """str.translate's table deleting ASCII punctuation and Unicode's (categories Pc, Pd, Pe, Pf, Pi, Po, Ps)."""
    table: dict[int, None] = dict.fromkeys(map(ord, string.punctuation))
    table.update(dict.fromkeys(c for c in range(128, sys.maxunicode + 1) if unicodedata.category(chr(c))[0] == "P"))
    return table


def normalize(token: str) -> str:
    """One whitespace-separated token as a word: lower-cased, punctuation deleted ('' if nothing is left)."""
    return token.lower().translate(_punctuation())


def words(text: str) -> list[str]:
    """The text's words (module docstring)."""
    return [w for w in map(normalize, text.split()) if w]


def word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")


def _salt(length: int) -> np.uint64:
    return np.uint64(word_hash(f"\0{length}-gram"))


@functools.cache
def _powers(size: int) -> tuple[np.ndarray, np.ndarray]:
    """BASE^k and BASE^-k modulo 2^64 for k < size (size a power of two: a few sizes are kept)."""
    up = np.full(size, _BASE, np.uint64)
    up[0] = 1
    down = np.full(size, _BASE_INVERSE, np.uint64)
    down[0] = 1
    return np.cumprod(up, dtype=np.uint64), np.cumprod(down, dtype=np.uint64)


class _Windows:
    """Every window's hash of a sequence of word hashes (0 where a word is not known), from one pass of
    prefix sums: the window of `length` at i is sum_j h[i+j] BASE^(length-1-j), salted by its length."""

    def __init__(self, hashes: np.ndarray, known: np.ndarray):
        size = 1 << max(4, (len(hashes) - 1).bit_length())
        self.up, down = _powers(size)
        self.prefix = np.zeros(len(hashes) + 1, np.uint64)
        np.cumsum(hashes * down[:len(hashes)], dtype=np.uint64, out=self.prefix[1:])
        self.unknown = np.zeros(len(hashes) + 1, np.int64)
        np.cumsum(~known, out=self.unknown[1:])

    def __call__(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The hashes of every window of `length` words, and whether each is all known words."""
        m = len(self.prefix) - 1
        if m < length:
            return np.zeros(0, np.uint64), np.zeros(0, bool)
        sums = (self.prefix[length:] - self.prefix[:-length]) * self.up[length - 1:m]
        return sums ^ _salt(length), self.unknown[length:] == self.unknown[:-length]


@dataclasses.dataclass(frozen=True, eq=False)
class NgramSet:
    """The n-grams of groups of documents (each group named: a task), hashed (module docstring). Documents
    are numbered through the groups in order; `owners[owner_starts[k]:owner_starts[k + 1]]` are the
    documents holding n-gram `keys[k]`. `lengths`: the window lengths looked for (n, and those of documents
    shorter than n)."""

    n: int
    groups: tuple[tuple[str, int], ...]  # (name, documents)
    vocabulary: tuple[str, ...]  # every word of the documents
    keys: np.ndarray  # uint64, sorted, unique
    owner_starts: np.ndarray  # int64, len(keys) + 1
    owners: np.ndarray  # int32 document numbers
    lengths: tuple[int, ...]

    @classmethod
    def build(cls, groups: Mapping[str, Sequence[str]], n: int) -> NgramSet:
        """The n-grams of each group's documents (texts, in order)."""
        vocabulary: dict[str, int] = {}
        ids = [[vocabulary.setdefault(w, len(vocabulary)) for w in words(text)]
               for texts in groups.values() for text in texts]
        table = np.array([word_hash(w) for w in vocabulary], np.uint64)
        flat = np.array([i for doc in ids for i in doc], np.int64)
        windows = _Windows(table[flat], np.ones(len(flat), bool))
        starts = _windows_of(ids, n)
        key = np.concatenate([windows(length)[0][rows[:, 0]] for length, rows in starts.items()] or [np.zeros(0, np.uint64)])
        owner = np.concatenate([rows[:, 1] for rows in starts.values()] or [np.zeros(0, np.int64)])
        pairs = np.unique(np.stack([key, owner.astype(np.uint64)], 1), axis=0)
        unique, first = np.unique(pairs[:, 0], return_index=True)
        return cls(n, tuple((name, len(texts)) for name, texts in groups.items()), tuple(vocabulary), unique,
                   np.append(first, len(pairs)).astype(np.int64), pairs[:, 1].astype(np.int32), tuple(sorted(starts)))

    @property
    def documents(self) -> int:
        return sum(count for _, count in self.groups)

    def owners_of(self, key_indices: Iterable[int]) -> np.ndarray:
        """The documents holding any of these n-grams (by index into `keys`), sorted."""
        found = [self.owners[self.owner_starts[k]:self.owner_starts[k + 1]] for k in key_indices]
        return np.unique(np.concatenate(found)) if found else np.zeros(0, np.int32)

    def group_of(self, document: int) -> tuple[str, int]:
        """The group a document number is in, and its number within the group."""
        for name, count in self.groups:
            if document < count:
                return name, document
            document -= count
        raise IndexError(document)

    def fingerprint(self) -> str:
        """The sha256 of what the set holds (n, its groups, its n-grams and their documents)."""
        digest = hashlib.sha256(repr((self.n, self.groups, self.lengths)).encode())
        for array in (self.keys, self.owner_starts, self.owners):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()


def _windows_of(ids: list[list[int]], n: int) -> dict[int, np.ndarray]:
    """Where each document's n-grams start in the documents laid end to end, by length: (start, document)
    rows; a document shorter than n (and not empty) has one, itself."""
    by_length: dict[int, list[tuple[int, int]]] = {}
    at = 0
    for document, doc in enumerate(ids):
        if len(doc) >= n:
            by_length.setdefault(n, []).extend((at + i, document) for i in range(len(doc) - n + 1))
        elif doc:
            by_length.setdefault(len(doc), []).append((at, document))
        at += len(doc)
    return {length: np.array(rows, np.int64).reshape(-1, 2) for length, rows in by_length.items()}


class Found(NamedTuple):
    """The n-grams of a set found in a batch of texts: each n-gram (by index into the set's keys) once, at its
    first place (the text's index in the batch and the word's in the text), with its words."""

    keys: np.ndarray
    texts: np.ndarray
    positions: np.ndarray
    ngrams: list[str]


class _Tokens(dict):
    """Token -> its word's number in the vocabulary (_UNKNOWN, or _EMPTY if it was all punctuation), each
    token normalized once while at most CACHE_TOKENS are kept."""

    def __init__(self, vocabulary: dict[str, int]):
        super().__init__()
        self.vocabulary = vocabulary
        self[""] = _BREAK  # what the batch puts between two texts (str.split yields no empty token)

    def __missing__(self, token: str) -> int:
        word = normalize(token)
        found = self.vocabulary.get(word, _UNKNOWN) if word else _EMPTY
        if len(self) >= CACHE_TOKENS:
            self.clear()
            self[""] = _BREAK
        self[token] = found
        return found


class Matcher:
    """An NgramSet's n-grams found in texts, in one process (each has its own: it caches tokens)."""

    def __init__(self, ngrams: NgramSet):
        self.ngrams = ngrams
        self.vocabulary = ngrams.vocabulary
        self.table = np.array([word_hash(w) for w in ngrams.vocabulary] + [0], np.uint64)  # [-1]: no word
        self.tokens = _Tokens({w: i for i, w in enumerate(ngrams.vocabulary)})
        bits = max(10, int(len(ngrams.keys)).bit_length() + 3)  # a presence table: most windows stop there
        self.shift = np.uint64(64 - bits)
        self.present = np.zeros(1 << bits, bool)
        self.present[ngrams.keys >> self.shift] = True

    def find(self, texts: Sequence[str]) -> Found:
        """Each of the set's n-grams in `texts`, once, at its first place (no n-gram runs from one text into
        the next)."""
        ids, key, start, lengths = self._hits(texts)
        order = np.lexsort((key, start))  # by place, then n-gram: the first place of each comes first
        key, start, lengths = key[order], start[order], lengths[order]
        _, first = np.unique(key, return_index=True)
        first.sort()
        key, start, lengths = key[first], start[first], lengths[first]
        ends = np.flatnonzero(ids == _BREAK)
        text = np.searchsorted(ends, start)
        begins = np.concatenate([[0], ends + 1])[text]
        ngrams = [" ".join(self.vocabulary[i] for i in ids[s:s + n]) for s, n in zip(start, lengths, strict=True)]
        return Found(key, text, start - begins, ngrams)

    def dirty(self, texts: Sequence[str]) -> np.ndarray:
        """Whether each text holds any of the set's n-grams."""
        ids, _, start, _ = self._hits(texts)
        found = np.zeros(len(texts), bool)
        found[np.searchsorted(np.flatnonzero(ids == _BREAK), start)] = True
        return found

    def _hits(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The texts' word numbers end to end (_BREAK after each), and every window of them that is one of the
        set's n-grams: its index into the set's keys, where it starts, its length."""
        tokens: list[str] = []
        for text in texts:
            tokens += text.split()
            tokens.append("")
        ids = np.fromiter(map(self.tokens.__getitem__, tokens), np.int64, len(tokens))
        ids = ids[ids != _EMPTY]
        windows = _Windows(self.table[np.maximum(ids, _UNKNOWN)], ids >= 0)
        keys, starts, lengths = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for length in self.ngrams.lengths:
            hashes, known = windows(length)
            candidates = np.flatnonzero(known & self.present[hashes >> self.shift])
            at = np.minimum(np.searchsorted(self.ngrams.keys, hashes[candidates]), len(self.ngrams.keys) - 1)
            hit = self.ngrams.keys[at] == hashes[candidates]
            keys.append(at[hit].astype(np.int64))
            starts.append(candidates[hit].astype(np.int64))
            lengths.append(np.full(int(hit.sum()), length, np.int64))
        return ids, np.concatenate(keys), np.concatenate(starts), np.concatenate(lengths)
