"""`zerolm prepare`: raw text -> tokenized, packed webdataset shards plus a manifest.

Output directory:
    manifest.json        what the shards hold (written last; its presence means "complete")
    tokenizer.json|.tiktoken   the tokenizer, so the dataset is self-contained
    unit-00000/train-000000.tar ...  webdataset shards; member NNNNNNNNN.npy is one sample of seq_len + 1 tokens
    unit-00000/val-000000.tar ...    (and each unit's record, leftovers and token counts)
    tail/train-000000.tar ...        the units' leftovers, packed

The input is packed unit by unit (zerolm.data.packing: a unit is a run of input files of about 256 MiB;
most sources are one): its documents joined with the end-of-text token and cut into fixed seq_len + 1
samples, so every tar member has the same size and local shards can be read row by row. Every
`val_every`-th document of a unit goes to the validation split. A source of fewer than `val_every`
documents (one big text file, say) would leave that split empty: then the last 1/`val_every` of the
training samples (at least one, at most one shard's worth) are held out as validation instead, and the
manifest says so (`val_rule`).

A dataset appears whole or not at all, so a killed prepare never leaves a manifest pointing at missing
shards, and --overwrite never destroys the old dataset before the new one is complete:
  - locally, it is built in a sibling temporary directory `.<name>.partial-<host>-<pid>` and renamed
    into place at the end;
  - on gs://, which has no rename, its files are written under a prefix of their own,
    `OUT/build-<time>-<host>-<pid>/` (the manifest's file names include it), and the dataset is
    published by writing `OUT/manifest.json`, one object write that GCS makes atomic, last; with
    --overwrite the old dataset's files are deleted after that;
  - in N parts (`part=(I, N)`, one per host), part I packs units I-1, I-1+N, ... into `OUT/parts-of-N/`,
    which every part shares (so OUT is on storage every host reaches: gs://, or one machine's disk), and
    whichever part completes the last unit publishes `OUT/manifest.json`. Their settings are in
    `parts-of-N/settings.json`, written by the first part to start: a part with other settings stops. A
    unit is complete once its record is written; a part run again skips its complete units and packs
    the rest again, whole, so no sample is ever written twice or lost. The dataset is the one a single
    prepare of the same source makes, byte for byte (shards and tokenizer).
A prepare that fails or is interrupted (Ctrl-C, SIGTERM) removes what it wrote (a part: the unit it was
packing); what a `kill -9` left is removed by the next prepare of the same output on the same host, once
that process is gone (a part's: by the part's next run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from etils import epath
from tqdm import tqdm

from zerolm.core import storage
from zerolm.data import packing, sources
from zerolm.data.builds import (
    SETTINGS,
    BucketBuild,
    Build,
    LocalBuild,
    PartsBuild,
    PrepareError,
    check_out,
)
from zerolm.data.encoder import Encoder
from zerolm.data.manifest import FORMAT, Decontamination, Manifest, TokenizerInfo
from zerolm.data.ngrams import NgramSet
from zerolm.data.sources import Skipped
from zerolm.data.tokenizer import MIN_BPE_VOCAB, Tokenizer, load_tokenizer

# The default BPE trains on at most this many MiB of the source's text (`bpe_sample`).
BPE_SAMPLE_MB = 100


@dataclasses.dataclass(frozen=True)
class PrepareSettings:
    """How `zerolm prepare` packs a source (each setting is its command-line flag).

    `workers`: processes that parse and tokenize the source's chunks (1: this process, with the
    tokenizer's own threads); the output is the same byte for byte whatever their number.
    `bpe_sample_mb`: the default BPE's training sample, at most (`bpe_sample`).
    `unit_mb`: input files are packed in units of about this many MiB as stored (zerolm.data.packing);
    `part=(I, N)`: pack units I-1, I-1+N, ... of them, as one of N parts (the module's docstring).
    `decontaminate`: the tasks' n-grams (zerolm.data.ngrams; its groups are the tasks): every training document
    sharing one is left out, validation documents are not (the split is decided first, so it is the same).
    `catch_sigterm=False` leaves SIGTERM to whoever owns it: in a multi-process training run JAX's
    preemption notifier holds it from C++, where Python could neither see nor put it back."""

    tokenizer: str = "default"
    vocab_size: int = 2048
    seq_len: int = 2048
    text_field: str = "text"
    tfds_data_dir: str | None = None
    val_every: int = 50
    samples_per_shard: int = 4096
    overwrite: bool = False
    skip_bad: bool = False
    progress: bool = True
    catch_sigterm: bool = True
    workers: int = 1
    bpe_sample_mb: int = BPE_SAMPLE_MB
    part: tuple[int, int] | None = None
    unit_mb: int = packing.UNIT_MB
    decontaminate: NgramSet | None = None

    def check(self, source: str) -> None:
        """PrepareError naming the flag, for a setting no prepare of `source` can use."""
        default = self.tokenizer == "default"
        _check_numbers(seq_len=self.seq_len, val_every=self.val_every, samples_per_shard=self.samples_per_shard,
                       vocab_size=self.vocab_size if default else None, workers=self.workers,
                       bpe_sample_mb=self.bpe_sample_mb if default else None, unit_mb=self.unit_mb)
        kind, _ = sources.parse(source)  # an unknown kind, before anything else
        if self.part is not None:
            index, parts = self.part
            if not 1 <= index <= parts:
                raise PrepareError(f"--part: {index}/{parts}: the part must be 1 to {parts}")
            if kind not in sources.FILE_KINDS and parts > 1:
                raise PrepareError(f"--part: {source} has no files to share among parts; prepare it in one part")

    def recorded(self, source: str, units: list, tok: Tokenizer) -> dict[str, Any]:
        """What every part of a prepare must share (parts-of-N/settings.json)."""
        return {"format": FORMAT, "source": source, "units": units, "tokenizer": tok.identity,
                "seq_len": self.seq_len, "val_every": self.val_every, "samples_per_shard": self.samples_per_shard,
                "text_field": self.text_field, "skip_bad": self.skip_bad, "unit_mb": self.unit_mb,
                "decontaminate": _tasks_of(self.decontaminate)}


class Prepared(NamedTuple):
    """What a prepare (or one part of one) did: the dataset's manifest, None while other parts still pack
    their units; and whether this prepare published it (False: a part run again after it was published)."""

    manifest: Manifest | None
    published: bool


def prepare(source: str, out: str | os.PathLike, **settings: Any) -> Manifest:
    """Prepare `source` into `out` on this machine; returns the manifest (settings: PrepareSettings')."""
    manifest = prepare_part(source, out, **settings).manifest
    assert manifest is not None  # one part of one: every unit is this process's
    return manifest


def prepare_part(source: str, out: str | os.PathLike, **settings: Any) -> Prepared:
    """Prepare `source` into `out` (settings: PrepareSettings'), or one part of it (`part=(I, N)`)."""
    s = PrepareSettings(**settings)
    s.check(source)
    if storage.is_remote(out):
        storage.check(out, "--out")
    out = storage.path(out) if storage.is_remote(out) else Path(out)
    check_out(out, s.overwrite, parts=s.part[1] if s.part else None)
    units = packing.plan_units(source, s.unit_mb << 20)
    with _StopSignals((signal.SIGINT, signal.SIGTERM) if s.catch_sigterm else (signal.SIGINT,)) as stop:
        tok = _tokenizer(source, s, stop)
        stop.check()
        build = _open_build(out, s, s.recorded(source, units, tok))
        try:
            _pack(source, s, units, tok, build, stop)
            stop.check()
            return _publish(source, s, units, tok, build)
        except BaseException:
            build.abandon()
            raise


def _tokenizer(source: str, s: PrepareSettings, stop: _StopSignals) -> Tokenizer:
    """The named tokenizer, or the default BPE trained on the source's `bpe_sample`. What it is doing is said
    on a terminal (stderr, as the bar; stdout is the result's line; a bad input's error must be the first
    line a script reads)."""
    if s.tokenizer != "default":
        return load_tokenizer(s.tokenizer)
    say = s.progress and sys.stderr.isatty()
    if say:
        print(f"prepare: training the tokenizer (byte-level BPE, {s.vocab_size:,} tokens) on up to "
              f"{s.bpe_sample_mb:,} MiB of the source's text", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    # The sample's skipped records are counted by the pass that tokenizes, not twice.
    reading = sources.Reading(s.text_field, s.tfds_data_dir, Skipped() if s.skip_bad else None)
    texts = bpe_sample(source, s.bpe_sample_mb * 2**20, s.val_every, reading=reading, stop=stop)
    if not texts:
        raise PrepareError(f"{source}: empty source: no document with text in {_files_of(source)}")
    tok = load_tokenizer("default", s.vocab_size, texts)
    if say:
        print(f"prepare: tokenizer ready ({sum(map(len, texts)) / 2**20:,.1f} MiB of text, "
              f"{time.perf_counter() - t0:.1f} s); tokenizing", file=sys.stderr, flush=True)
    return tok


def _open_build(out: Path | epath.Path, s: PrepareSettings, recorded: dict[str, Any]) -> Build:
    """Where the dataset is built before it is published: a part's shared directory, a gs:// build prefix
    or a local partial directory (what a killed prepare left there removed, and said)."""
    build: Build
    if s.part is not None:
        build = PartsBuild(out, s.part[1], recorded)
    else:
        build = BucketBuild(storage.path(out)) if storage.is_remote(out) else LocalBuild(Path(out))
    if build.removed and s.progress:
        print(f"prepare: removed {', '.join(build.removed)}, left by a prepare that was killed", flush=True)
    return build


def _pack(source: str, s: PrepareSettings, units: list, tok: Tokenizer, build: Build, stop: _StopSignals) -> None:
    """Pack this prepare's units (a part's: every N-th, skipping those an earlier run of it completed), with a
    progress bar over the source's bytes as stored (a total, so a percentage and an ETA) and tokens beside."""
    mine = range(len(units)) if s.part is None else range(s.part[0] - 1, len(units), s.part[1])
    stored = [sum(map(sources.stored_size, units[u] or ())) for u in mine]
    bar = tqdm(desc="prepare", unit="B", unit_scale=True, unit_divisor=1024, disable=not s.progress,
               mininterval=0.5, total=sum(stored) or None)
    tokens = 0

    def advance(encoded) -> None:
        nonlocal tokens
        tokens += len(encoded.tokens)
        bar.update(encoded.stored)
        bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)

    with bar, Encoder(tok, s.workers, s.text_field, s.decontaminate) as encoder:
        for u, size in zip(mine, stored, strict=True):
            if s.part is not None and packing.read_unit(build.directory, u) is not None:
                bar.update(size)
                continue  # packed by an earlier run of this part
            skipped = Skipped() if s.skip_bad else None
            chunks = _checked(sources.chunks(source, text_field=s.text_field, tfds_data_dir=s.tfds_data_dir,
                                             only=units[u]), stop)
            packing.write_unit(packing.Unit(build.directory, u, units[u]), encoder.encode(chunks, skipped),
                               packing.Shape(s.seq_len, s.val_every, s.samples_per_shard, tok.vocab_size), skipped,
                               advance)


def _publish(source: str, s: PrepareSettings, units: list, tok: Tokenizer, build: Build) -> Prepared:
    """Once every unit is complete: the tokenizer, the manifest, and the dataset published; no manifest while
    a part's fellow parts still pack theirs."""
    records = [packing.read_unit(build.directory, u) for u in range(len(units))]
    complete = [r for r in records if r is not None]
    if len(complete) < len(units):
        assert s.part is not None  # one machine packs every unit
        return Prepared(None, False)
    if isinstance(build, PartsBuild) and not build.may_finalize():
        return Prepared(build.published(), False)  # already published, or another part is publishing it now
    tok.save(build.directory)
    manifest = packing.finalize(build.directory, complete, TokenizerInfo(**tok.identity, file=tok.filename),
                                packing.Shape(s.seq_len, s.val_every, s.samples_per_shard, tok.vocab_size), source)
    if s.decontaminate is not None:
        manifest = dataclasses.replace(manifest, decontamination=_left_out(s.decontaminate, complete))
    if manifest.splits["train"].samples == 0:
        raise PrepareError(f"{source}: too little text for one training sample of seq_len + 1 = "
                           f"{s.seq_len + 1} tokens ({manifest.documents} document(s) in {_files_of(source)}); "
                           "use a smaller seq_len or more text")
    manifest = manifest.under(build.prefix)
    build.publish(manifest.dumps())
    return Prepared(manifest, True)


def _tasks_of(ngrams: NgramSet | None) -> dict[str, Any] | None:
    """What a decontaminating prepare looks for, as its parts record it."""
    if ngrams is None:
        return None
    return {"tasks": [name for name, _ in ngrams.groups], "ngram": ngrams.n, "ngrams_sha256": ngrams.fingerprint()}


def _left_out(ngrams: NgramSet, records: list[packing.UnitRecord]) -> Decontamination:
    """The manifest's record of the training documents a decontaminating prepare left out."""
    ids = sorted(f"{packing.unit_name(r.index)}:{d}" for r in records for d in r.removed)
    return Decontamination(tuple(name for name, _ in ngrams.groups), ngrams.n, ngrams.fingerprint(), len(ids),
                           hashlib.sha256("".join(f"{i}\n" for i in ids).encode()).hexdigest())


def missing_units(out: str | os.PathLike, parts: int) -> list[int]:
    """The units of an N-part prepare into `out` that no part has completed yet ([] once published)."""
    root = (storage.path(out) if storage.is_remote(out) else Path(out)) / PartsBuild.name(parts)
    settings = json.loads((root / SETTINGS).read_text())
    return [u for u in range(len(settings["units"])) if packing.read_unit(root, u) is None]


def bpe_sample(source: str, budget_bytes: int, val_every: int, *, reading: sources.Reading | None = None,
               stop: _StopSignals | None = None) -> list[str]:
    """The default BPE's training text, bounded and deterministic: from each of the source's files, in
    order, its first documents that the validation rule leaves to training (by their index within the
    file), until they hold an equal share of `budget_bytes` characters (at least one document each);
    from a source without files (tfds, default), its first such documents up to the budget. The same
    sample for any --workers, so the same tokenizer."""
    reading = reading or sources.Reading()
    groups: list[list[str] | None] = [[path] for path in sources.files(source)] or [None]
    share = max(1, budget_bytes // len(groups))
    texts: list[str] = []
    for only in groups:
        taken = 0
        docs = sources.iter_documents(source, text_field=reading.text_field, tfds_data_dir=reading.tfds_data_dir,
                                      skipped=reading.skipped, only=only)
        for index, doc in enumerate(docs):
            if stop is not None:
                stop.check()
            if index % val_every != val_every - 1:
                texts.append(doc)
                taken += len(doc)
                if taken >= share:
                    break
        docs.close()
    return texts


def _checked(chunks: Iterator[sources.Chunk], stop: _StopSignals) -> Iterator[sources.Chunk]:
    for chunk in chunks:
        stop.check()
        yield chunk


def _files_of(source: str) -> str:
    """The files a file source names, for messages (the spec itself for other sources)."""
    try:
        files = sources.files(source)
    except sources.SourceError:
        files = []
    if not files:
        return source
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _check_numbers(**values: int | None) -> None:
    """Each numeric argument, named as its command-line flag."""
    least = {"vocab_size": MIN_BPE_VOCAB}
    for name, value in values.items():
        if value is None:
            continue
        floor = least.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < floor:
            why = f"at least {floor} (256 bytes + end-of-text)" if floor > 1 else "a positive integer"
            raise PrepareError(f"--{name.replace('_', '-')}: must be {why}, got {value!r}")


class _StopSignals:
    """Ctrl-C and SIGTERM during a prepare: noted by the handler, acted on by `check()` between documents
    (as KeyboardInterrupt, so the partial directory is removed). Raising from the handler itself could
    land inside a garbage-collection callback, where Python ignores it."""

    def __init__(self, signals=(signal.SIGINT, signal.SIGTERM)):
        self.signals = signals
        self.received: int | None = None
        self._previous: dict = {}

    def _note(self, signum, frame):
        self.received = signum

    def check(self) -> None:
        if self.received is not None:
            raise KeyboardInterrupt

    def __enter__(self) -> _StopSignals:
        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            for sig in (signal.SIGINT, signal.SIGTERM):
                if sig in self.signals:
                    self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


