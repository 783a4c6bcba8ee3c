"""A prepared dataset's training documents, read back from its shards as text: what a contamination scan
(zerolm.data.contamination) looks in.

A split is a stream of samples cut from documents laid end to end, each followed by end-of-text, so a
document is found again by joining consecutive samples and cutting at end-of-text tokens: a document
packed across two samples (or two shards) is read whole, and none runs past an end-of-text. The stream
of a dataset's training split is in segments (`segments`): each unit of input files (zerolm.data.packing)
is its shards, then its leftover (`leftover-train.npy`, the tokens packing kept for the tail), so each
unit's documents are whole; the tail's shards hold those leftovers again and are not read (but for
samples a small dataset kept back from validation, `tail/train-kept-*`). A dataset without units (an
older zerolm's) is one segment of its shards.

The work is shared out by shard (`Item`): an item owns the documents that start in its shard (the first
one of a segment's shard, before its first end-of-text, started in the shard before), and reads on into
the following shards only to finish its last one. A document longer than `Pieces.tokens` is read in
pieces of that many tokens that overlap by `Pieces.overlap`, so memory is bounded whatever the
documents' lengths; the word cut at each piece's edge is dropped from it (the overlap holds it whole),
so an n-gram is missed only where fewer than n words fill the overlap's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from collections.abc import Iterator

import numpy as np

from zerolm.core import storage
from zerolm.data.manifest import Manifest
from zerolm.data.packing import TAIL
from zerolm.data.shards import PreparedDataset


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive training shards (by index into the split's) whose tokens, then the leftover's (a name
    relative to the dataset, if any), are whole documents."""

    shards: tuple[int, ...]
    leftover: str | None


@dataclasses.dataclass(frozen=True)
class Item:
    """The documents that start in one shard of a segment (`shard`: a position in the segment; the
    leftover's is len(shards))."""

    segment: int
    shard: int


@dataclasses.dataclass(frozen=True)
class Pieces:
    """How long documents are read: in pieces of at most `tokens`, each overlapping the one before by `overlap`."""

    tokens: int = 1 << 20
    overlap: int = 4096


DEFAULT_PIECES = Pieces()


class Piece:
    """Part or all of a document: its tokens (end-of-text left out), its number among the documents its item
    owns, and whether it holds the document's start and its end."""

    __slots__ = ("tokens", "document", "starts", "ends")

    def __init__(self, tokens: np.ndarray, document: int, starts: bool, ends: bool):
        self.tokens, self.document, self.starts, self.ends = tokens, document, starts, ends


def segments(manifest: Manifest) -> list[Segment]:
    """The training split's segments (module docstring)."""
    shards = manifest.splits["train"].shards
    if not manifest.units:
        return [Segment(tuple(range(len(shards))), None)]
    out = []
    for unit in manifest.units:
        mine = tuple(k for k, s in enumerate(shards) if s.name.startswith(f"{unit}/"))
        out.append(Segment(mine, f"{unit}/leftover-train.npy"))
    kept = tuple(k for k, s in enumerate(shards) if s.name.rsplit("/", 1)[-1].startswith("train-kept")
                 and s.name.split("/")[-2] == TAIL)
    if kept:
        out.append(Segment(kept, None))
    return out


def items(manifest: Manifest) -> list[Item]:
    """Every item of the training split, in the stream's order."""
    return [Item(i, k) for i, seg in enumerate(segments(manifest))
            for k in range(len(seg.shards) + (seg.leftover is not None))]


class Reader:
    """A prepared dataset's training documents, item by item (local or gs://, streamed: a shard at a time)."""

    def __init__(self, location: str, pieces: Pieces = DEFAULT_PIECES):
        self.dataset = PreparedDataset(location)
        self.split = self.dataset.split("train")
        self.segments = segments(self.dataset.manifest)
        self.eot_id = self.dataset.manifest.tokenizer.eot_id
        self.pieces = pieces

    @functools.cached_property
    def tokenizer(self):
        """The dataset's tokenizer (read once)."""
        return self.dataset.tokenizer()

    def name(self, item: Item) -> str:
        """Where an item's documents start: its shard's (or leftover's) name in the dataset."""
        seg = self.segments[item.segment]
        if item.shard < len(seg.shards):
            return self.split.shards[seg.shards[item.shard]].name
        assert seg.leftover is not None
        return seg.leftover

    def tokens(self, segment: int, position: int) -> np.ndarray:
        """The tokens of one shard (or the leftover) of a segment, end to end."""
        seg = self.segments[segment]
        if position < len(seg.shards):
            return self.split.shard_tokens(seg.shards[position])
        assert seg.leftover is not None
        raw = (storage.path(self.dataset.location) / seg.leftover).read_bytes()
        return np.load(io.BytesIO(raw)).astype(np.int32)

    def documents(self, item: Item) -> Iterator[Piece]:
        """The pieces of the documents the item owns, in order."""
        seg = self.segments[item.segment]
        chunk = self.tokens(item.segment, item.shard)
        if item.shard > 0 and self._last_token(seg, item.shard - 1) != self.eot_id:
            eots = np.flatnonzero(chunk == self.eot_id)
            if not len(eots):
                return  # the middle of a document that started before this shard
            chunk = chunk[eots[0] + 1:]
        builder = _Builder(self.pieces)
        yield from builder.add(chunk, self.eot_id)
        for position in range(item.shard + 1, len(seg.shards) + (seg.leftover is not None)):
            if not builder.under_way:
                return
            yield from builder.add(self.tokens(item.segment, position), self.eot_id, first_only=True)
        yield from builder.finish()

    def _last_token(self, seg: Segment, position: int) -> int:
        """The last token of a segment's shard (one sample read)."""
        sample = int(self.split.starts[seg.shards[position] + 1]) - 1
        return int(self.split.read(np.array([sample]))[0, -1])


class _Builder:
    """Documents from consecutive chunks of tokens: whole ones at each end-of-text, and pieces of a long one
    (Pieces) as its tokens come."""

    def __init__(self, pieces: Pieces):
        self.pieces = pieces
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.document = 0
        self.starts = True

    @property
    def under_way(self) -> bool:
        """Whether a document has begun and not ended."""
        return self.pending_len > 0 or not self.starts

    def add(self, chunk: np.ndarray, eot: int, first_only: bool = False) -> Iterator[Piece]:
        """The pieces of the documents that end in `chunk` (with `first_only`, of the first one only; what
        follows is not the item's), the rest kept for the next chunk."""
        at = 0
        for e in np.flatnonzero(chunk == eot).tolist():
            yield from self._take(chunk[at:e])
            yield self._piece(ends=True)
            if first_only:
                return
            at = e + 1
        yield from self._take(chunk[at:])

    def finish(self) -> Iterator[Piece]:
        """The last document, where the segment ends without an end-of-text."""
        if self.under_way:
            yield self._piece(ends=True)

    def _take(self, tokens: np.ndarray) -> Iterator[Piece]:
        self.pending.append(tokens)
        self.pending_len += len(tokens)
        while self.pending_len > self.pieces.tokens:
            joined = np.concatenate(self.pending)
            piece = Piece(joined[:self.pieces.tokens], self.document, self.starts, False)
            rest = joined[self.pieces.tokens - self.pieces.overlap:]
            self.pending, self.pending_len, self.starts = [rest], len(rest), False
            yield piece

    def _piece(self, ends: bool) -> Piece:
        joined = np.concatenate(self.pending) if self.pending else np.zeros(0, np.int32)
        piece = Piece(joined, self.document, self.starts, ends)
        self.pending, self.pending_len, self.starts = [], 0, True
        self.document += 1
        return piece


def text(tokenizer, piece: Piece) -> str:
    """A piece's text; at an edge cut inside the document, the word cut there dropped."""
    decoded = tokenizer.decode(piece.tokens)
    if not piece.starts:
        decoded = decoded.split(None, 1)[1] if len(decoded.split(None, 1)) > 1 else ""
    if not piece.ends:
        decoded = decoded.rsplit(None, 1)[0] if len(decoded.rsplit(None, 1)) > 1 else ""
    return decoded
