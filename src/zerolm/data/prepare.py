"""`zerolm prepare`: raw text -> tokenized, packed webdataset shards plus a manifest.

Output directory:
    manifest.json        what the shards hold (written last; its presence means "complete")
    tokenizer.json|.tiktoken   the tokenizer, so the dataset is self-contained
    train-000000.tar ...  webdataset shards; member NNNNNNNNN.npy is one sample of seq_len + 1 tokens
    val-000000.tar ...

Documents are joined with the end-of-text token and cut into fixed seq_len + 1 samples, so every tar
member has the same size: local shards can be read row by row. Every `val_every`-th document goes to
the validation split. A source of fewer than `val_every` documents (one big text file, say) would
leave that split empty: then the last 1/`val_every` of the training samples (at least one, at most
one shard's worth) are held out as validation instead, and the manifest says so (`val_rule`).

A dataset appears whole or not at all, so a killed prepare never leaves a manifest pointing at missing
shards, and --overwrite never destroys the old dataset before the new one is complete:
  - locally, it is built in a sibling temporary directory `.<name>.partial-<host>-<pid>` and renamed
    into place at the end;
  - on gs://, which has no rename, its shards and tokenizer are written under a prefix of their own,
    `OUT/build-<time>-<host>-<pid>/` (the manifest's file names include it), and the dataset is
    published by writing `OUT/manifest.json`, one object write that GCS makes atomic, last; with
    --overwrite the old dataset's files are deleted after that.
A prepare that fails or is interrupted (Ctrl-C, SIGTERM) removes what it wrote; what a `kill -9` left
is removed by the next prepare of the same output on the same host, once that process is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shutil
import signal
import socket
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from etils import epath
from tqdm import tqdm

from zerolm import storage
from zerolm.data import sources
from zerolm.data.manifest import MANIFEST, SPLITS, DataError, Manifest, ShardInfo, SplitInfo, TokenizerInfo
from zerolm.data.sources import Skipped
from zerolm.data.tokenizer import MIN_BPE_VOCAB, Tokenizer, from_bytes, load_tokenizer
from zerolm.errors import ZerolmError

# The default BPE trains on at most this many MiB of the source's text (`bpe_sample`).
BPE_SAMPLE_MB = 100


def webdataset():
    """The webdataset module, imported on first use: importing it imports torch where torch is installed
    (2.5 s of every process's start, training from local shards included, which never needs it)."""
    import webdataset as wds

    return wds



class PrepareError(ZerolmError):
    """A prepare that cannot go ahead; one line naming the path or source at fault."""


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy in nats/token of a unigram distribution given token counts: the loss of a model that
    learned nothing about context."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class _ShardWriter:
    """Packs a token stream into samples and writes them into tar shards of `per_shard` samples."""

    def __init__(self, directory: epath.Path, split: str, seq_len: int, dtype: np.dtype, per_shard: int,
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
        """Append a document's tokens (EOT included); returns the number of samples completed."""
        self.pending.append(tokens)
        self.pending_len += len(tokens)
        if self.pending_len < self.T1:
            return 0
        stream = np.concatenate(self.pending)
        n = len(stream) // self.T1
        rows = stream[: n * self.T1].reshape(n, self.T1)
        self.counts += np.bincount(rows.reshape(-1), minlength=len(self.counts))
        for row in rows:
            self._write(row)
        rest = stream[n * self.T1:]
        self.pending, self.pending_len = [rest], len(rest)
        return n

    def _write(self, row: np.ndarray) -> None:
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

    def close(self) -> SplitInfo:
        """The split's manifest entry. The last partial sample (fewer than seq_len + 1 tokens) is dropped."""
        if self._tar is not None:
            self._close_shard()
        samples = sum(s["samples"] for s in self.shards)
        return SplitInfo(tuple(ShardInfo(**s) for s in self.shards), samples, samples * self.T1,
                         unigram_entropy(self.counts) if samples else None)

    def take_tail(self, n: int) -> np.ndarray:
        """Remove the last `n` samples (at most the last two shards) and return them, for a held-out split."""
        rows: list[np.ndarray] = []
        while len(rows) < n:
            last = self.shards[-1]
            path = self.directory / last["name"]
            with tarfile.open(fileobj=io.BytesIO(path.read_bytes())) as tar:
                members = [np.load(io.BytesIO(_member(tar, m))) for m in tar.getmembers()]
            keep = max(0, len(members) - (n - len(rows)))
            rows = members[keep:] + rows
            path.unlink()
            self.shards.pop()
            if keep:  # rewrite the shard with the samples it keeps
                self._in_shard = 0
                for row in members[:keep]:
                    self._write(row)
                self._close_shard()
        tail = np.stack(rows)
        self.counts -= np.bincount(tail.reshape(-1).astype(np.int64), minlength=len(self.counts))
        return tail


def _member(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    file = tar.extractfile(info)
    assert file is not None, info.name  # a shard's members are files
    return file.read()


def prepare(source: str, out: str | os.PathLike, *, tokenizer: str = "default", vocab_size: int = 2048,
            seq_len: int = 2048, text_field: str = "text", tfds_data_dir: str | None = None,
            val_every: int = 50, samples_per_shard: int = 4096, overwrite: bool = False,
            skip_bad: bool = False, progress: bool = True, catch_sigterm: bool = True, workers: int = 1,
            bpe_sample_mb: int = BPE_SAMPLE_MB) -> Manifest:
    """Prepare `source` into `out`; returns the manifest.

    `workers`: processes that parse and tokenize the source's chunks (1: this process, with the
    tokenizer's own threads); the output is the same byte for byte whatever their number.
    `bpe_sample_mb`: the default BPE's training sample, at most (`bpe_sample`).
    `catch_sigterm=False` leaves SIGTERM to whoever owns it: in a multi-process training run JAX's
    preemption notifier holds it from C++, where Python could neither see nor put it back."""
    _check_numbers(seq_len=seq_len, val_every=val_every, samples_per_shard=samples_per_shard,
                   vocab_size=vocab_size if tokenizer == "default" else None, workers=workers,
                   bpe_sample_mb=bpe_sample_mb if tokenizer == "default" else None)
    sources.parse(source)  # an unknown kind, before anything else
    if storage.is_remote(out):
        storage.check(out, "--out")
    out = storage.path(out) if storage.is_remote(out) else Path(out)
    _check_out(out, overwrite)
    skipped = Skipped() if skip_bad else None

    stop = _StopSignals((signal.SIGINT, signal.SIGTERM) if catch_sigterm else (signal.SIGINT,))

    with stop:
        if tokenizer == "default":
            # The sample's skipped records are counted by the pass that tokenizes, not twice.
            texts = bpe_sample(source, bpe_sample_mb * 2**20, val_every, text_field=text_field,
                               tfds_data_dir=tfds_data_dir, skipped=Skipped() if skip_bad else None, stop=stop)
            if not texts:
                raise PrepareError(f"{source}: empty source: no document with text in {_files_of(source)}")
            tok = load_tokenizer("default", vocab_size, texts)
            del texts
        else:
            tok = load_tokenizer(tokenizer)
        stop.check()
        chunks = _checked(sources.chunks(source, text_field=text_field, tfds_data_dir=tfds_data_dir), stop)
        tokenized = tokenize(chunks, tok, workers, text_field, skipped)
        return _prepare_into(out, source, tokenized, tok, seq_len, val_every, samples_per_shard, skipped,
                             progress, stop)


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


@dataclasses.dataclass
class Encoded:
    """One chunk's documents, tokenized: their tokens end to end, each followed by end-of-text, the
    length of each (end-of-text included), and the chunk's bad records in order."""

    tokens: np.ndarray
    lengths: np.ndarray
    bad: list[sources.SourceError]


def tokenize(chunks: Iterator[sources.Chunk], tok: Tokenizer, workers: int, text_field: str,
             skipped: Skipped | None) -> Iterator[Encoded]:
    """Every chunk's documents, tokenized, in the source's order: in this process (workers = 1, the
    tokenizer's own threads), or in `workers` processes with at most two chunks each in flight, taken
    back in order. A chunk's first bad record raises, unless `skipped` counts them."""
    for encoded in _encode_all(chunks, tok, workers, text_field):
        if encoded.bad and skipped is None:
            raise encoded.bad[0]
        for error in encoded.bad:
            assert skipped is not None
            skipped.add(str(error))
        yield encoded


def _encode_all(chunks: Iterator[sources.Chunk], tok: Tokenizer, workers: int, text_field: str) -> Iterator[Encoded]:
    if workers == 1:
        for chunk in chunks:
            yield _encode(chunk, tok, text_field)
        return
    import collections
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: a forked child would inherit the tokenizer's threads (and JAX's, inside `zerolm train`).
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                               initargs=(tok.filename, tok.file_bytes, text_field))
    pending: collections.deque = collections.deque()
    try:
        for chunk in chunks:
            pending.append(pool.submit(_worker_encode, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _encode(chunk: sources.Chunk, tok: Tokenizer, text_field: str) -> Encoded:
    docs = sources.documents(chunk, text_field)
    ids = tok.encode_batch([d for d in docs if isinstance(d, str)])
    lengths = np.array([len(x) + 1 for x in ids], np.int64)
    tokens = np.full(int(lengths.sum()), tok.eot_id, np.int32)
    at = 0
    for x in ids:
        tokens[at:at + len(x)] = x
        at += len(x) + 1
    return Encoded(tokens, lengths, [d for d in docs if isinstance(d, sources.SourceError)])


_WORKER: dict[str, Any] = {}


def _worker_init(name: str, data: bytes, text_field: str) -> None:
    """A worker process: one thread of the tokenizer's (the processes are the parallelism), and Ctrl-C
    left to the parent, which stops the pool."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER.update(tok=from_bytes(name, data), text_field=text_field)


def _worker_encode(chunk: sources.Chunk) -> Encoded:
    return _encode(chunk, _WORKER["tok"], _WORKER["text_field"])


def _prepare_into(out: Path | epath.Path, source: str, tokenized: Iterator[Encoded], tok: Tokenizer, seq_len: int,
                  val_every: int,
                  samples_per_shard: int, skipped: Skipped | None, progress: bool, stop: _StopSignals) -> Manifest:
    dtype = token_dtype(tok.vocab_size)
    build = (_BucketBuild if storage.is_remote(out) else _LocalBuild)(out)
    if build.removed and progress:
        print(f"prepare: removed {', '.join(build.removed)}, left by a prepare that was killed", flush=True)
    try:
        manifest = _write_splits(build.directory, tokenized, tok, seq_len, dtype, val_every, samples_per_shard,
                                 progress)
        stop.check()
        if manifest.splits["train"].samples == 0:
            raise PrepareError(f"{source}: too little text for one training sample of seq_len + 1 = {seq_len + 1} "
                               f"tokens ({manifest.documents} document(s) in {_files_of(source)}); use a smaller "
                               "seq_len or more text")
        manifest = dataclasses.replace(manifest, source=source, skipped=skipped.count if skipped else 0,
                                       skipped_first=skipped.first if skipped else "").under(build.prefix)
        tok.save(build.directory)
        build.publish(manifest.dumps())
    except BaseException:
        build.abandon()
        raise
    return manifest


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
        old = _dataset_files(self.out) if (self.out / MANIFEST).exists() else set()
        storage.write_atomic(self.out / MANIFEST, manifest)  # the moment the new dataset appears
        for name in sorted(old - {MANIFEST, self.prefix.rstrip("/")}):  # --overwrite: the old one goes now
            storage.remove_tree(self.out / name)

    def abandon(self) -> None:
        storage.remove_tree(self.directory)


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


def _check_out(out: Path | epath.Path, overwrite: bool) -> None:
    """prepare writes only into a missing or empty directory, or (--overwrite) over an earlier prepared
    dataset that holds nothing else: never over files of the user's. (Builds that a prepare into gs://
    left unfinished are its own files.)"""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"{out}: exists and is not a directory")
    names = {p.name for p in out.iterdir()} if out.exists() else set()
    names = {n for n in names if not (storage.is_remote(out) and _BUILD.match(n))}
    if not names:
        return
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


def _write_splits(directory: Path | epath.Path, tokenized: Iterator[Encoded], tok: Tokenizer, seq_len: int, dtype,
                  val_every: int, per_shard: int, progress: bool) -> Manifest:
    writers = {s: _ShardWriter(directory, s, seq_len, dtype, per_shard, tok.vocab_size) for s in SPLITS}
    bar = tqdm(desc="prepare", unit="tok", unit_scale=True, disable=not progress, mininterval=0.5)
    n_docs = 0
    start = time.perf_counter()
    with bar:
        for encoded in tokenized:
            # Document i (in the source's order) is validation when i % val_every == val_every - 1.
            n = len(encoded.lengths)
            val = np.repeat((n_docs + np.arange(n)) % val_every == val_every - 1, encoded.lengths)
            writers["train"].add(encoded.tokens[~val])
            writers["val"].add(encoded.tokens[val])
            bar.update(len(encoded.tokens))
            n_docs += n
    splits = {s: w.close() for s, w in writers.items()}
    val_rule = f"every {val_every}th document"
    train_samples = splits["train"].samples
    if splits["val"].samples == 0 and train_samples >= 2:
        held = min(max(1, train_samples // val_every), per_shard)
        writers["val"].pending, writers["val"].pending_len = [], 0  # the val documents' leftover tokens, if any
        for row in writers["train"].take_tail(held):
            writers["val"].add(row)
        splits = {s: w.close() for s, w in writers.items()}
        val_rule = (f"the last {held} training sample(s), since {n_docs} document(s) are too few for every "
                    f"{val_every}th document to give a validation sample")
    return Manifest(seq_len=seq_len, dtype=dtype.name, tokenizer=TokenizerInfo(**tok.identity, file=tok.filename),
                    splits=splits, documents=n_docs, val_every=val_every, val_rule=val_rule,
                    seconds=round(time.perf_counter() - start, 3))


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
