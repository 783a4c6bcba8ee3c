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
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from etils import epath
from tqdm import tqdm

from zerolm import storage
from zerolm.data import packing, sources
from zerolm.data.manifest import FORMAT, MANIFEST, DataError, Manifest, TokenizerInfo
from zerolm.data.packing import Encoded
from zerolm.data.sources import Skipped
from zerolm.data.tokenizer import MIN_BPE_VOCAB, Tokenizer, from_bytes, load_tokenizer
from zerolm.errors import ZerolmError
from zerolm.interrupts import die_with_parent

# The default BPE trains on at most this many MiB of the source's text (`bpe_sample`).
BPE_SAMPLE_MB = 100


class PrepareError(ZerolmError):
    """A prepare that cannot go ahead; one line naming the path or source at fault."""


def prepare(source: str, out: str | os.PathLike, **settings: Any) -> Manifest:
    """Prepare `source` into `out` on this machine; returns the manifest (settings: `prepare_part`'s)."""
    manifest = prepare_part(source, out, **settings)
    assert manifest is not None  # one part of one: every unit is this process's
    return manifest


def prepare_part(source: str, out: str | os.PathLike, *, tokenizer: str = "default", vocab_size: int = 2048,
            seq_len: int = 2048, text_field: str = "text", tfds_data_dir: str | None = None,
            val_every: int = 50, samples_per_shard: int = 4096, overwrite: bool = False,
            skip_bad: bool = False, progress: bool = True, catch_sigterm: bool = True, workers: int = 1,
            bpe_sample_mb: int = BPE_SAMPLE_MB, part: tuple[int, int] | None = None,
            unit_mb: int = packing.UNIT_MB) -> Manifest | None:
    """Prepare `source` into `out`; returns the manifest, or None for a part (`part=(I, N)`) that finished
    its units while other parts' are still missing.

    `workers`: processes that parse and tokenize the source's chunks (1: this process, with the
    tokenizer's own threads); the output is the same byte for byte whatever their number.
    `bpe_sample_mb`: the default BPE's training sample, at most (`bpe_sample`).
    `unit_mb`: input files are packed in units of about this many MiB as stored (zerolm.data.packing);
    `part=(I, N)`: pack units I-1, I-1+N, ... of them, as one of N parts (the module's docstring).
    `catch_sigterm=False` leaves SIGTERM to whoever owns it: in a multi-process training run JAX's
    preemption notifier holds it from C++, where Python could neither see nor put it back."""
    _check_numbers(seq_len=seq_len, val_every=val_every, samples_per_shard=samples_per_shard,
                   vocab_size=vocab_size if tokenizer == "default" else None, workers=workers,
                   bpe_sample_mb=bpe_sample_mb if tokenizer == "default" else None, unit_mb=unit_mb)
    kind, _ = sources.parse(source)  # an unknown kind, before anything else
    if part is not None:
        index, parts = part
        if not 1 <= index <= parts:
            raise PrepareError(f"--part: {index}/{parts}: the part must be 1 to {parts}")
        if kind not in sources.FILE_KINDS and parts > 1:
            raise PrepareError(f"--part: {source} has no files to share among parts; prepare it in one part")
    if storage.is_remote(out):
        storage.check(out, "--out")
    out = storage.path(out) if storage.is_remote(out) else Path(out)
    _check_out(out, overwrite, parts=part[1] if part else None)
    units = packing.plan_units(source, unit_mb << 20)

    stop = _StopSignals((signal.SIGINT, signal.SIGTERM) if catch_sigterm else (signal.SIGINT,))

    with stop:
        # What it is doing, on a terminal (stderr, as the bar; stdout is the result's line; a bad input's
        # error must be the first line a script reads).
        say = progress and sys.stderr.isatty()
        if tokenizer == "default":
            if say:
                print(f"prepare: training the tokenizer (byte-level BPE, {vocab_size:,} tokens) on up to "
                      f"{bpe_sample_mb:,} MiB of the source's text", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            # The sample's skipped records are counted by the pass that tokenizes, not twice.
            texts = bpe_sample(source, bpe_sample_mb * 2**20, val_every, text_field=text_field,
                               tfds_data_dir=tfds_data_dir, skipped=Skipped() if skip_bad else None, stop=stop)
            if not texts:
                raise PrepareError(f"{source}: empty source: no document with text in {_files_of(source)}")
            tok = load_tokenizer("default", vocab_size, texts)
            if say:
                print(f"prepare: tokenizer ready ({sum(map(len, texts)) / 2**20:,.1f} MiB of text, "
                      f"{time.perf_counter() - t0:.1f} s); tokenizing", file=sys.stderr, flush=True)
            del texts
        else:
            tok = load_tokenizer(tokenizer)
        stop.check()
        settings = {"format": FORMAT, "source": source, "units": units, "tokenizer": tok.identity, "seq_len": seq_len,
                    "val_every": val_every, "samples_per_shard": samples_per_shard, "text_field": text_field,
                    "skip_bad": skip_bad, "unit_mb": unit_mb}
        build: _LocalBuild | _BucketBuild | _PartsBuild
        if part is not None:
            build = _PartsBuild(out, part[1], settings)
        else:
            build = _BucketBuild(storage.path(out)) if storage.is_remote(out) else _LocalBuild(Path(out))
        if build.removed and progress:
            print(f"prepare: removed {', '.join(build.removed)}, left by a prepare that was killed", flush=True)
        mine = range(len(units)) if part is None else range(part[0] - 1, len(units), part[1])
        # Progress over the source's bytes as stored (a total, so a percentage and an ETA), tokens beside.
        stored = [sum(map(sources.stored_size, units[u] or ())) for u in mine]
        bar = tqdm(desc="prepare", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                   mininterval=0.5, total=sum(stored) or None)
        tokens = 0

        def advance(encoded) -> None:
            nonlocal tokens
            tokens += len(encoded.tokens)
            bar.update(encoded.stored)
            bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)

        try:
            with bar, Encoder(tok, workers, text_field) as encoder:
                for u in mine:
                    if part is not None and packing.read_unit(build.directory, u) is not None:
                        bar.update(sum(map(sources.stored_size, units[u] or ())))
                        continue  # packed by an earlier run of this part
                    skipped = Skipped() if skip_bad else None
                    chunks = _checked(sources.chunks(source, text_field=text_field, tfds_data_dir=tfds_data_dir,
                                                     only=units[u]), stop)
                    packing.write_unit(build.directory, u, units[u], encoder.encode(chunks, skipped), tok.vocab_size,
                                       seq_len, val_every, samples_per_shard, skipped, advance)
            stop.check()
            records = [packing.read_unit(build.directory, u) for u in range(len(units))]
            complete = [r for r in records if r is not None]
            if len(complete) < len(units):
                assert part is not None  # one machine packs every unit
                return None
            if isinstance(build, _PartsBuild) and not build.may_finalize():
                return build.published()  # already published, or another part is publishing it now
            tok.save(build.directory)
            manifest = packing.finalize(build.directory, complete, TokenizerInfo(**tok.identity, file=tok.filename),
                                        seq_len, val_every, samples_per_shard, source)
            if manifest.splits["train"].samples == 0:
                raise PrepareError(f"{source}: too little text for one training sample of seq_len + 1 = "
                                   f"{seq_len + 1} tokens ({manifest.documents} document(s) in {_files_of(source)}); "
                                   "use a smaller seq_len or more text")
            manifest = manifest.under(build.prefix)
            build.publish(manifest.dumps())
        except BaseException:
            build.abandon()
            raise
        return manifest


def missing_units(out: str | os.PathLike, parts: int) -> list[int]:
    """The units of an N-part prepare into `out` that no part has completed yet ([] once published)."""
    root = (storage.path(out) if storage.is_remote(out) else Path(out)) / _PartsBuild.name(parts)
    settings = json.loads((root / SETTINGS).read_text())
    return [u for u in range(len(settings["units"])) if packing.read_unit(root, u) is None]


def bpe_sample(source: str, budget_bytes: int, val_every: int, *, text_field: str = "text",
               tfds_data_dir: str | None = None, skipped: Skipped | None = None,
               stop: _StopSignals | None = None) -> list[str]:
    """The default BPE's training text, bounded and deterministic: from each of the source's files, in
    order, its first documents that the validation rule leaves to training (by their index within the
    file), until they hold an equal share of `budget_bytes` characters (at least one document each);
    from a source without files (tfds, default), its first such documents up to the budget. The same
    sample for any --workers, so the same tokenizer."""
    groups: list[list[str] | None] = [[path] for path in sources.files(source)] or [None]
    share = max(1, budget_bytes // len(groups))
    texts: list[str] = []
    for only in groups:
        taken = 0
        docs = sources.iter_documents(source, text_field=text_field, tfds_data_dir=tfds_data_dir, skipped=skipped,
                                      only=only)
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


class Encoder:
    """Tokenizes a source's chunks in order: in this process (workers = 1, the tokenizer's own threads),
    or in `workers` processes started once (spawned: a forked child would inherit the tokenizer's threads,
    and JAX's inside `zerolm train`), with at most two chunks each in flight, taken back in order. A
    chunk's first bad record raises, unless `skipped` counts them."""

    def __init__(self, tok: Tokenizer, workers: int, text_field: str):
        self.tok, self.workers, self.text_field = tok, workers, text_field
        self.pool = None
        if workers > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_worker_init,
                                            initargs=(tok.filename, tok.file_bytes, text_field, os.getpid()))

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def encode(self, chunks: Iterator[sources.Chunk], skipped: Skipped | None) -> Iterator[Encoded]:
        for encoded in self._encoded(chunks):
            sources.reject(encoded.bad, skipped)
            yield encoded

    def _encoded(self, chunks: Iterator[sources.Chunk]) -> Iterator[Encoded]:
        if self.pool is None:
            for chunk in chunks:
                yield _encode(chunk, self.tok, self.text_field)
            return
        import collections

        pending: collections.deque = collections.deque()
        try:
            for chunk in chunks:
                pending.append(self.pool.submit(_worker_encode, chunk))
                if len(pending) >= 2 * self.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def _encode(chunk: sources.Chunk, tok: Tokenizer, text_field: str) -> Encoded:
    docs = sources.documents(chunk, text_field)
    ids = tok.encode_batch([d for d in docs if isinstance(d, str)])
    lengths = np.array([len(x) + 1 for x in ids], np.int64)
    tokens = np.full(int(lengths.sum()), tok.eot_id, np.int32)
    at = 0
    for x in ids:
        tokens[at:at + len(x)] = x
        at += len(x) + 1
    return Encoded(tokens, lengths, [d for d in docs if isinstance(d, sources.SourceError)], chunk.stored)


_WORKER: dict[str, Any] = {}


def _worker_init(name: str, data: bytes, text_field: str, parent: int) -> None:
    """A worker process: one thread of the tokenizer's (the processes are the parallelism), Ctrl-C left
    to the parent, which stops the pool, and gone when the parent is (kill -9 included, also before the
    worker was ready)."""
    die_with_parent()
    if os.getppid() != parent:  # the parent died while this worker started
        os._exit(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER.update(tok=from_bytes(name, data), text_field=text_field)


def _worker_encode(chunk: sources.Chunk) -> Encoded:
    return _encode(chunk, _WORKER["tok"], _WORKER["text_field"])


class _LocalBuild:
    """A local dataset is built in a sibling directory and renamed into place."""

    prefix = ""  # shard names are relative to the dataset directory

    def __init__(self, out: Path):
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.removed = remove_dead_partials(out)
        self.directory = out.parent / f".{out.name}.partial-{socket.gethostname()}-{os.getpid()}"
        self.directory.mkdir()

    def publish(self, manifest: str) -> None:
        (self.directory / MANIFEST).write_text(manifest)
        _move_into_place(self.directory, self.out)

    def abandon(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# gs:// builds: OUT/build-<time>-<host>-<pid>/
_BUILD = re.compile(r"^build-\d{8}T\d{6}-(?P<host>.+)-(?P<pid>\d+)$")
_PARTS = re.compile(r"^parts-of-\d+$")


class _BucketBuild:
    """A gs:// dataset is built under a prefix of its own inside OUT and published by writing the
    manifest last (GCS has no rename; a single object write is atomic)."""

    def __init__(self, out: epath.Path):
        self.out = out
        host = socket.gethostname()
        self.removed = []
        for p in out.iterdir() if out.exists() else ():
            match = _BUILD.match(p.name)
            if match and match["host"] == host and not _alive(int(match["pid"])) and not _published(out, p.name):
                storage.remove_tree(p)
                self.removed.append(p.name)
        name = f"build-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{host}-{os.getpid()}"
        self.directory, self.prefix = out / name, f"{name}/"

    def publish(self, manifest: str) -> None:
        _publish_over(self.out, manifest, keep=self.prefix.rstrip("/"))

    def abandon(self) -> None:
        storage.remove_tree(self.directory)


SETTINGS = "settings.json"
FINALIZE_LOCK = "finalize.lock"
FINALIZE_STALE_S = 600.0  # a finalize takes seconds: a lock this old was left by a part that died


class _PartsBuild:
    """One part of an N-part prepare: units go to `OUT/parts-of-N/`, shared by every part; the first part
    to start writes the settings there, every other part must bring the same."""

    @staticmethod
    def name(parts: int) -> str:
        return f"parts-of-{parts}"

    def __init__(self, out: Path | epath.Path, parts: int, settings: dict):
        self.out, self.prefix = out, f"{self.name(parts)}/"
        self.directory = out / self.name(parts)
        where = self.directory / SETTINGS
        self.removed: list[str] = []  # a part's leftovers are its own units: write_unit replaces them
        self._locked: epath.Path | Path | None = None  # the finalize lock, while this part holds it
        mine = json.dumps(settings, indent=1, sort_keys=True)
        ours = json.loads(mine)  # the settings as JSON has them (tuples are lists)
        theirs = json.loads(storage.create_once(where, mine))
        if theirs != ours:
            key = next(k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k))
            fix = ("prepare into another --out" if self.published() is not None
                   else f"or remove {self.directory} to start again")
            raise PrepareError(f"{where}: the parts already there were prepared with {key} = "
                               f"{_short(theirs.get(key))}, this one with {_short(settings.get(key))}; every part takes "
                               f"the same source and settings ({fix})")

    def published(self) -> Manifest | None:
        """The dataset these parts published, if they did."""
        try:
            manifest = Manifest.parse((self.out / MANIFEST).read_text(), str(self.out / MANIFEST))
        except (FileNotFoundError, DataError):
            return None
        return manifest if manifest.tokenizer.file.startswith(self.prefix) else None

    def may_finalize(self) -> bool:
        """Whether this part publishes the dataset: not if it is published already, and only one part at a
        time (a lock file; one a dead process left, on this host, or older than FINALIZE_STALE_S, is taken
        over)."""
        if self.published() is not None:
            return False
        lock = self.directory / FINALIZE_LOCK
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()})
        for _ in range(2):
            if storage.create_once(lock, me) == me.encode():
                self._locked = lock
                return True
            try:
                holder = json.loads(lock.read_text())
            except (FileNotFoundError, ValueError):
                continue
            dead = holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", 0)))
            if not (dead or time.time() - float(holder.get("time", 0)) > FINALIZE_STALE_S):
                return False
            storage.remove_tree(lock)
        return False

    def publish(self, manifest: str) -> None:
        _publish_over(self.out, manifest, keep=self.prefix.rstrip("/"))
        self.abandon()

    def abandon(self) -> None:
        # The unit being packed removed itself; complete ones stay for the next run of this part.
        if self._locked is not None:
            storage.remove_tree(self._locked)
            self._locked = None


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _publish_over(out, manifest: str, keep: str) -> None:
    """Write OUT/manifest.json (the moment the dataset appears), then delete what the dataset it replaced
    held, but `keep`."""
    old = _dataset_files(out) if (out / MANIFEST).exists() else set()
    storage.write_atomic(out / MANIFEST, manifest)
    for name in sorted(old - {MANIFEST, keep}):  # --overwrite: the old one goes now
        storage.remove_tree(out / name)


def _ours(out, parts: int) -> bool:
    try:
        return _PartsBuild.name(parts) in _dataset_files(out)
    except (OSError, DataError):
        return False


def _dataset_files(out) -> set[str]:
    """The top-level names of a prepared dataset's files (a gs:// build is one name)."""
    manifest = Manifest.parse((out / MANIFEST).read_text(), str(out / MANIFEST))
    return {MANIFEST, *(name.split("/", 1)[0] for name in manifest.files())}


def _published(out, name: str) -> bool:
    try:
        return name in _dataset_files(out)
    except (OSError, DataError):
        return False


def _files_of(source: str) -> str:
    """The files a file source names, for messages (the spec itself for other sources)."""
    try:
        files = sources.files(source)
    except sources.SourceError:
        files = []
    if not files:
        return source
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _check_out(out: Path | epath.Path, overwrite: bool, parts: int | None = None) -> None:
    """prepare writes only into a missing or empty directory, or (--overwrite) over an earlier prepared
    dataset that holds nothing else: never over files of the user's. (Builds that a prepare into gs://
    left unfinished are its own files.)"""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"{out}: exists and is not a directory")
    names = {p.name for p in out.iterdir()} if out.exists() else set()
    names = {n for n in names if not (storage.is_remote(out) and _BUILD.match(n)) and not _PARTS.match(n)}
    if not names:
        return
    if MANIFEST in names and parts is not None and _ours(out, parts):
        return  # these parts' own dataset: the settings decide (a part run again after it was published)
    if MANIFEST not in names:
        raise PrepareError(f"{out}: is not empty and holds no prepared dataset ({MANIFEST}); prepare writes only "
                           "into a missing or empty directory: choose another --out")
    if not overwrite:
        raise PrepareError(f"{out}: already holds a prepared dataset; pass --overwrite to replace it")
    try:
        ours = _dataset_files(out)
    except (DataError, OSError) as e:
        raise PrepareError(f"{out}/{MANIFEST}: unreadable ({e}); --overwrite replaces only a prepared dataset, "
                           "so nothing was touched") from None
    foreign = sorted(names - ours)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise PrepareError(f"{out}: holds {foreign[0]}{more}, which no prepare wrote; --overwrite replaces only a "
                           "prepared dataset: move them out first")


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


def remove_dead_partials(out: Path) -> list[str]:
    """Partial directories of `out` left by a prepare on this host whose process is gone."""
    removed = []
    prefix = f".{out.name}.partial-{socket.gethostname()}-"
    for path in out.parent.glob(f".{out.name}.partial-*"):
        pid = path.name.removeprefix(prefix)
        if path.name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def _move_into_place(tmp: Path, out: Path) -> None:
    """Swap the finished directory in; the old dataset (if any) is removed only after."""
    if out.exists() and any(out.iterdir()):
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
