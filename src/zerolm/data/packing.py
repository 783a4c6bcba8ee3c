"""Tokenized documents -> samples -> tar shards, one unit of input files at a time, and the dataset's
finalize. `zerolm prepare` (zerolm.data.prepare) drives it, on one machine or in parts on many.

A unit is a run of consecutive input files holding about UNIT_BYTES as stored (a source without files,
tfds or the default corpus, is one unit). Each unit is packed on its own into `unit-NNNNN/` of the
dataset: its documents in order, each followed by end-of-text, document j of the unit going to the
validation split when j % val_every == val_every - 1, cut into samples of seq_len + 1 tokens, written
into shards of samples_per_shard (`train-000000.tar`, ...). What is left of each split, fewer than
seq_len + 1 tokens, stays beside them (`leftover-<split>.npy`) with the split's token counts
(`counts-<split>.npy`), and the unit's record (`unit.json`) is written last: a unit with a record is
complete, and its files never change again.

`finalize` packs the units' leftovers, in unit order, into `tail/` shards (the last partial sample of
all is dropped), holds validation samples out of the training split's end if the rule gave none (one
big document), and makes the manifest: the units' shards in unit order, then the tail's. The dataset
is a function of its units alone: one machine or N parts, in any order, killed and run again, give it
byte for byte. (With a single unit, which every source under UNIT_BYTES is, this is the packing of
earlier zerolms: the same shards.)
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
from etils import epath

from zerolm.core import storage
from zerolm.data import sources
from zerolm.data.manifest import SPLITS, Manifest, ShardInfo, SplitInfo, TokenizerInfo

UNIT_MB = 256
UNIT_BYTES = UNIT_MB << 20
UNIT_RECORD = "unit.json"
TAIL = "tail"

AnyPath: TypeAlias = Path | epath.Path


def webdataset():
    """The webdataset module, imported on first use: importing it imports torch where torch is installed
    (2.5 s of every process's start, training from local shards included, which never needs it)."""
    import webdataset as wds

    return wds


@dataclasses.dataclass
class Encoded:
    """One chunk's documents, tokenized: their tokens end to end, each followed by end-of-text, the
    length of each (end-of-text included), and the chunk's bad records in order."""

    tokens: np.ndarray
    lengths: np.ndarray
    bad: list[sources.SourceError]
    stored: int = 0  # the chunk's bytes of the source as stored (sources.Chunk.stored): progress
    dirty: np.ndarray | None = None  # per document: it shares an n-gram with the tasks (prepare --decontaminate)


@dataclasses.dataclass(frozen=True)
class UnitRecord:
    """What a packed unit holds (its `unit.json`)."""

    index: int
    files: tuple[str, ...]
    documents: int
    skipped: int
    skipped_first: str
    seconds: float
    shards: dict[str, tuple[ShardInfo, ...]]  # split -> shards, named within the unit's directory
    removed: tuple[int, ...] = ()  # training documents left out (prepare --decontaminate), by index in the unit

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def parse(cls, text: bytes | str) -> UnitRecord:
        data = json.loads(text)
        shards = {split: tuple(ShardInfo(**s) for s in found) for split, found in data.pop("shards").items()}
        return cls(**{**data, "files": tuple(data["files"]), "removed": tuple(data.get("removed", ()))},
                   shards=shards)


def unit_name(index: int) -> str:
    return f"unit-{index:05d}"


def plan_units(source: str, unit_bytes: int = UNIT_BYTES) -> list[list[str] | None]:
    """The source's units: consecutive files, in order, until they hold `unit_bytes` as stored; [None] for
    a source without files."""
    files = sources.files(source)
    if not files:
        return [None]
    units: list[list[str] | None] = []
    current: list[str] = []
    size = 0
    for path in files:
        current.append(path)
        size += sources.stored_size(path)
        if size >= unit_bytes:
            units.append(current)
            current, size = [], 0
    if current:
        units.append(current)
    return units


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy in nats/token of a unigram distribution given token counts: the loss of a model that
    learned nothing about context."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ShardWriter:
    """Packs a token stream into samples and writes them into tar shards of `per_shard` samples."""

    def __init__(self, directory: AnyPath, split: str, seq_len: int, dtype: np.dtype, per_shard: int,
                 vocab_size: int):
        self.directory, self.split, self.T1, self.dtype, self.per_shard = directory, split, seq_len + 1, dtype, per_shard
        self.counts = np.zeros(vocab_size, np.int64)  # unigram counts, for the entropy baseline
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.shards: list[dict] = []
        self._tar: Any = None  # the shard being written, and its file
        self._file: Any = None
        self._in_shard = 0

    def add(self, tokens: np.ndarray) -> int:
        """Append tokens to the stream; returns the number of samples completed."""
        self.pending.append(tokens)
        self.pending_len += len(tokens)
        if self.pending_len < self.T1:
            return 0
        stream = np.concatenate(self.pending)
        n = len(stream) // self.T1
        rows = stream[: n * self.T1].reshape(n, self.T1)
        self.counts += np.bincount(rows.reshape(-1), minlength=len(self.counts))
        for row in rows:
            self.write(row)
        rest = stream[n * self.T1:]
        self.pending, self.pending_len = [rest], len(rest)
        return n

    def leftover(self) -> np.ndarray:
        return np.concatenate(self.pending) if self.pending else np.zeros(0, np.int32)

    def write(self, row: np.ndarray) -> None:
        if self._tar is None:
            name = f"{self.split}-{len(self.shards):06d}.tar"
            self.shards.append({"name": name, "samples": 0})
            self._file = (self.directory / name).open("wb")
            self._tar = webdataset().TarWriter(self._file, mtime=0)  # mtime=0: reproducible bytes
        self._tar.write({"__key__": f"{self._in_shard:09d}", "npy": row.astype(self.dtype)})
        self._in_shard += 1
        self.shards[-1]["samples"] += 1
        if self._in_shard == self.per_shard:
            self._close_shard()

    def _close_shard(self) -> None:
        self._tar.close()
        self.shards[-1]["bytes"] = self._file.tell()
        self._file.close()  # TarWriter leaves a stream it was given open
        self._tar = self._file = None
        self._in_shard = 0

    def abandon(self) -> None:
        """Drop the shard being written and write nothing more (a unit that fails or is interrupted is removed
        whole): its tar stream is marked closed and its file discarded, so that neither flushes into a file
        already gone when collected (a gs:// upload's buffer printed "Exception ignored" tracebacks)."""
        if self._tar is None:
            return
        tar = self._tar.tarstream
        tar.closed = True
        if hasattr(tar.fileobj, "closed"):  # tarfile's stream adapter (mode "w|"), which closes on collection
            tar.fileobj.closed = True
        discard = getattr(self._file, "discard", None)  # fsspec's buffered files: drop the pending upload
        (discard or self._file.close)()
        self._tar = self._file = None

    def close(self) -> tuple[ShardInfo, ...]:
        """The shards written; the last partial sample (fewer than seq_len + 1 tokens) stays in `leftover`."""
        if self._tar is not None:
            self._close_shard()
        return tuple(ShardInfo(**s) for s in self.shards)


@dataclasses.dataclass(frozen=True)
class Shape:
    """How a dataset is cut: samples of seq_len + 1 tokens, every val_every-th document to validation,
    per_shard samples a shard; tokens below vocab_size (their dtype: token_dtype)."""

    seq_len: int
    val_every: int
    per_shard: int
    vocab_size: int


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit of a build: `root/unit-NNNNN/`, and the input files whose documents it packs (None: a source
    without files)."""

    root: AnyPath
    index: int
    files: list[str] | None


def write_unit(unit: Unit, encoded: Iterator[Encoded], shape: Shape, skipped: sources.Skipped | None,
               progress) -> UnitRecord:
    """Pack one unit's documents (`encoded`, in order) into `root/unit-NNNNN/`; its record last. What a
    failure or an interrupt left of the unit is removed (the unit is written again, whole, next time)."""
    index, files, vocab_size = unit.index, unit.files, shape.vocab_size
    directory = unit.root / unit_name(index)
    storage.remove_tree(directory)
    if not storage.is_remote(directory):
        directory.mkdir(parents=True)
    dtype = token_dtype(vocab_size)
    seq_len, val_every = shape.seq_len, shape.val_every
    writers = {s: ShardWriter(directory, s, seq_len, dtype, shape.per_shard, vocab_size) for s in SPLITS}
    start, documents, removed = time.perf_counter(), 0, []
    try:
        for chunk in encoded:
            n = len(chunk.lengths)
            val = (documents + np.arange(n)) % val_every == val_every - 1
            left_out = ~val & (chunk.dirty if chunk.dirty is not None else np.zeros(n, bool))
            removed += (documents + np.flatnonzero(left_out)).tolist()
            writers["train"].add(chunk.tokens[np.repeat(~val & ~left_out, chunk.lengths)])
            writers["val"].add(chunk.tokens[np.repeat(val, chunk.lengths)])
            progress(chunk)
            documents += n
        shards = {s: w.close() for s, w in writers.items()}
        for split, w in writers.items():
            _save_npy(directory / f"leftover-{split}.npy", w.leftover().astype(dtype))
            _save_npy(directory / f"counts-{split}.npy", w.counts)
        record = UnitRecord(index, tuple(files or ()), documents, skipped.count if skipped else 0,
                            skipped.first if skipped else "", round(time.perf_counter() - start, 3), shards,
                            tuple(removed))
        storage.write_atomic(directory / UNIT_RECORD, record.dumps())
    except BaseException:
        for w in writers.values():
            w.abandon()
        storage.remove_tree(directory)
        raise
    return record


def read_unit(root: AnyPath, index: int) -> UnitRecord | None:
    """The unit's record, if the unit is complete."""
    try:
        return UnitRecord.parse((root / unit_name(index) / UNIT_RECORD).read_bytes())
    except FileNotFoundError:
        return None


def finalize(root: AnyPath, records: list[UnitRecord], tokenizer: TokenizerInfo, shape: Shape, source: str) -> Manifest:
    """The dataset of complete units (`records`, in unit order): the tail packed from their leftovers,
    validation held out if the rule gave none, and the manifest (names relative to `root`). Writes only
    under `root/tail/`, from scratch: running it again gives the same bytes."""
    seq_len, val_every, per_shard = shape.seq_len, shape.val_every, shape.per_shard
    tail = root / TAIL
    storage.remove_tree(tail)
    if not storage.is_remote(tail):
        tail.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    entries: dict[str, list[ShardInfo]] = {}
    counts: dict[str, np.ndarray] = {}
    tail_writers = {}
    for split in SPLITS:
        entries[split] = [dataclasses.replace(s, name=f"{unit_name(r.index)}/{s.name}") for r in records
                          for s in r.shards[split]]
        counts[split] = sum((_load_npy(root / unit_name(r.index) / f"counts-{split}.npy") for r in records),
                            np.zeros(tokenizer.vocab_size, np.int64))
        w = tail_writers[split] = ShardWriter(tail, split, seq_len, dtype, per_shard, tokenizer.vocab_size)
        for r in records:
            w.add(_load_npy(root / unit_name(r.index) / f"leftover-{split}.npy").astype(np.int64))
    for split, w in tail_writers.items():
        entries[split] += [dataclasses.replace(s, name=f"{TAIL}/{s.name}") for s in w.close()]
        counts[split] = counts[split] + w.counts
    documents = sum(r.documents for r in records)
    val_rule = f"every {val_every}th document" + (" of each unit of input files" if len(records) > 1 else "")
    train_samples = sum(s.samples for s in entries["train"])
    if not entries["val"] and train_samples >= 2:
        held = min(max(1, train_samples // val_every), per_shard)
        rows, entries["train"] = _take_last(root, entries["train"], held, tail, dtype)
        val = ShardWriter(tail, "val", seq_len, dtype, per_shard, tokenizer.vocab_size)
        for row in rows:
            val.write(row)
        entries["val"] = [dataclasses.replace(s, name=f"{TAIL}/{s.name}") for s in val.close()]
        moved = np.bincount(rows.reshape(-1).astype(np.int64), minlength=tokenizer.vocab_size)
        counts["train"], counts["val"] = counts["train"] - moved, moved
        val_rule = (f"the last {held} training sample(s), since {documents} document(s) are too few for every "
                    f"{val_every}th document to give a validation sample")
    splits = {}
    for split in SPLITS:
        samples = sum(s.samples for s in entries[split])
        splits[split] = SplitInfo(tuple(entries[split]), samples, samples * (seq_len + 1),
                                  unigram_entropy(counts[split]) if samples else None)
    if not storage.is_remote(tail) and not any(tail.iterdir()):
        tail.rmdir()  # nothing left over: no tail
    skipped = [r for r in records if r.skipped]
    return Manifest(seq_len=seq_len, dtype=dtype.name, tokenizer=tokenizer, splits=splits, documents=documents,
                    val_every=val_every, val_rule=val_rule, source=source, skipped=sum(r.skipped for r in records),
                    skipped_first=skipped[0].skipped_first if skipped else "",
                    seconds=round(sum(r.seconds for r in records), 3), units=tuple(unit_name(r.index) for r in records))


def _take_last(root: AnyPath, shards: list[ShardInfo], n: int, tail: AnyPath,
               dtype: np.dtype) -> tuple[np.ndarray, list[ShardInfo]]:
    """The last `n` samples of `shards` (at most two shards' worth), and the shards without them: a
    shard that keeps some is copied, with what it keeps, to `tail/train-kept.tar` (units stay as written)."""
    shards = list(shards)
    rows: list[np.ndarray] = []
    while len(rows) < n:
        last = shards.pop()
        with tarfile.open(fileobj=io.BytesIO((root / last.name).read_bytes())) as tar:
            members = [np.load(io.BytesIO(_member(tar, m))) for m in tar.getmembers()]
        keep = max(0, len(members) - (n - len(rows)))
        rows = members[keep:] + rows
        if keep:  # train-kept-000000.tar
            kept = ShardWriter(tail, "train-kept", len(members[0]) - 1, dtype, keep, 1)
            for row in members[:keep]:
                kept.write(row)
            (info,) = kept.close()
            shards.append(dataclasses.replace(info, name=f"{TAIL}/{info.name}"))
    return np.stack(rows), shards


def _member(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    file = tar.extractfile(info)
    assert file is not None, info.name  # a shard's members are files
    return file.read()


def _save_npy(path: AnyPath, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array)
    storage.write_atomic(path, buffer.getvalue())


def _load_npy(path: AnyPath) -> np.ndarray:
    return np.load(io.BytesIO(path.read_bytes()))
