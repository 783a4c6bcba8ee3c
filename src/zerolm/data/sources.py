"""Raw-text sources for `zerolm prepare`: `text:GLOB`, `jsonl:GLOB`, `parquet:GLOB`, `tfds:NAME` and
`default`.

A GLOB matches local files or gs:// objects (`gs://bucket/web/*.jsonl.zst`), taken in sorted order. A
`text:` file is one document, read whole; a `jsonl:` line is one record; a `parquet:` row is one
record, read in row batches of the one column named by `text_field`. `text:` and `jsonl:` files ending
in `.gz` or `.zst` (`.zstd`) are decompressed as they are read.

The source is read as a sequence of `Chunk`s: raw records of one file, about `CHUNK_BYTES` each, in
order. `documents(chunk)` turns one chunk into documents (decoding, parsing JSON, checking the text
field): a pure function, so `zerolm prepare --workers N` runs it in N processes and still gets every
document in the same order. A bad record (not UTF-8, not JSON, no text field, a null in a parquet
column) stops with one line naming the file and line (or row), unless the caller asked to skip bad
records, in which case they are counted in `Skipped`. A file that cannot be read at all (a corrupt
compressed stream, a parquet file without the column or not parquet at all) always stops, naming it.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import zlib
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from zerolm.core import storage
from zerolm.core.errors import ZerolmError, first_line
from zerolm.data.corpus import default_documents

CHUNK_BYTES = 1 << 20  # raw bytes of records per chunk: a worker's unit of work
COMPRESSED = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
FILE_KINDS = ("text", "jsonl", "parquet")
D = TypeVar("D")
USAGE = "use text:GLOB, jsonl:GLOB, parquet:GLOB, tfds:NAME[:SPLIT] or default"


class SourceError(ZerolmError):
    """Bad raw input; the message names the file (and line)."""


@dataclasses.dataclass
class Skipped:
    count: int = 0
    first: str = ""  # the first skipped record's reason, for the log

    def add(self, reason: str) -> None:
        self.count += 1
        self.first = self.first or reason


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Raw records of one file (or of a source without files), in order."""

    kind: str  # text | jsonl | parquet | docs (records that are documents already: tfds, default)
    where: str  # the file (or the source spec)
    first: int  # the first record's line (jsonl, from 1) or row (parquet, from 0)
    records: list[Any]  # text: [bytes]; jsonl: lines as bytes; parquet: values; docs: str
    stored: int = 0  # bytes of the file as stored (compressed, if it is) read for these records: progress


def parse(spec: str) -> tuple[str, str]:
    """(kind, argument) of a source spec; SourceError for one this zerolm does not read."""
    if spec == "default":
        return "default", ""
    kind, _, arg = spec.partition(":")
    if kind in (*FILE_KINDS, "tfds") and arg:
        return kind, arg
    raise SourceError(f"{spec}: unknown source; {USAGE}")


def files(spec: str) -> list[str]:
    """The files a text:/jsonl:/parquet: source names, sorted (local paths or gs:// URLs); [] for others."""
    kind, pattern = parse(spec)
    if kind not in FILE_KINDS:
        return []
    if storage.is_remote(pattern):
        storage.check(f"gs://{storage.split_gs(pattern)[0]}", "--source", read_only=True)
        found = storage.glob(pattern)
    else:
        found = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not found:
        raise SourceError(f"{spec}: no files match {pattern!r}")
    return found


def chunks(spec: str, *, text_field: str = "text", tfds_data_dir: str | None = None,
           only: list[str] | None = None) -> Iterator[Chunk]:
    """The source's records, chunk by chunk, in order; `only`: these of its files (in this order)."""
    kind, arg = parse(spec)
    if kind == "default":
        yield from _doc_chunks(spec, iter(default_documents()))
    elif kind == "tfds":
        yield from _doc_chunks(spec, _tfds(arg, text_field, tfds_data_dir))
    else:
        for path in files(spec) if only is None else only:
            yield from _file_chunks(kind, path, text_field)


def documents(chunk: Chunk, text_field: str = "text") -> list[str | SourceError]:
    """The chunk's documents in order; a bad record is its SourceError in its place (empty texts are
    dropped: they hold no token)."""
    if chunk.kind == "docs":
        return [d for d in chunk.records if d.strip()]
    if chunk.kind == "text":
        try:
            text = chunk.records[0].decode("utf-8")
        except UnicodeDecodeError as e:
            return [SourceError(f"{chunk.where}: cannot read as UTF-8 text ({e})")]
        return [text] if text.strip() else []
    if chunk.kind == "parquet":
        return [d for row, text in enumerate(chunk.records, chunk.first)
                if (d := _parquet_text(chunk.where, row, text, text_field)) is not None]
    return [d for lineno, line in enumerate(chunk.records, chunk.first) if line.strip()
            and (d := _jsonl_text(chunk.where, lineno, line, text_field)) is not None]


def _parquet_text(where: str, row: int, text, text_field: str) -> str | SourceError | None:
    """A parquet row's text column: its text, its SourceError, or None where it is blank."""
    if not isinstance(text, str):
        return SourceError(f"{where}: row {row}: column {text_field!r} is "
                           f"{'null' if text is None else type(text).__name__}, not a string")
    return text if text.strip() else None


def _jsonl_text(where: str, lineno: int, line, text_field: str) -> str | SourceError | None:
    """A JSON line's text field: its text, its SourceError, or None where it is blank."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:
        return SourceError(f"{where}:{lineno}: not UTF-8 ({e.reason} at byte {e.start})")
    except json.JSONDecodeError as e:
        # e.msg may end mid-phrase ("Invalid control character at"): the column completes it.
        return SourceError(f"{where}:{lineno}: not valid JSON ({e.msg.removesuffix(' at')}, column {e.colno})")
    if not isinstance(record, dict) or text_field not in record:
        return SourceError(f"{where}:{lineno}: no text field {text_field!r}")
    text = record[text_field]
    if not isinstance(text, str):
        return SourceError(f"{where}:{lineno}: field {text_field!r} is not a string (got "
                           f"{type(text).__name__} {json.dumps(text)[:40]})")
    return text if text.strip() else None


@dataclasses.dataclass(frozen=True)
class Reading:
    """How a source's records are read: the field that holds a record's text, tfds's data directory, and the
    count of unreadable records skipped (None: the first one stops the read)."""

    text_field: str = "text"
    tfds_data_dir: str | None = None
    skipped: Skipped | None = None


def iter_documents(spec: str, *, text_field: str = "text", tfds_data_dir: str | None = None,
                   skipped: Skipped | None = None, only: list[str] | None = None) -> Generator[str, None, None]:
    """Every document of the source in order, in this process (bad records raise, or are counted in
    `skipped`)."""
    for chunk in chunks(spec, text_field=text_field, tfds_data_dir=tfds_data_dir, only=only):
        yield from accept(documents(chunk, text_field), skipped)


def accept(docs: Sequence[D | SourceError], skipped: Skipped | None) -> Iterator[D]:
    """The documents (or their tokens) of `docs`; its first bad record raises, unless `skipped` counts them."""
    for d in docs:
        if isinstance(d, SourceError):
            reject([d], skipped)
        else:
            yield d


def reject(errors: Sequence[SourceError], skipped: Skipped | None) -> None:
    """Bad records: the first raises, unless `skipped` counts them all."""
    if errors and skipped is None:
        raise errors[0]
    for error in errors:
        assert skipped is not None
        skipped.add(str(error))


def _doc_chunks(spec: str, docs: Iterator[str]) -> Iterator[Chunk]:
    batch: list[str] = []
    size = 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= CHUNK_BYTES:
            yield Chunk("docs", spec, 0, batch, size)
            batch, size = [], 0
    if batch:
        yield Chunk("docs", spec, 0, batch, size)


def stored_size(path: str) -> int:
    """The file's size as stored."""
    return storage.size(path) if storage.is_remote(path) else Path(path).stat().st_size


def _open(path: str):
    """The file's bytes as a stream, decompressed by its suffix."""
    return _open_raw(path)[0]


def _open_raw(path: str):
    """(the file's bytes as a stream, decompressed by its suffix; the stored file under it)."""
    try:
        raw = storage.path(path).open("rb") if storage.is_remote(path) else open(path, "rb")  # noqa: SIM115
    except OSError as e:
        raise SourceError(f"{path}: cannot open ({e.strerror or e})") from None
    codec = COMPRESSED.get(Path(path).suffix)
    if codec == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if codec == "zstd":
        return io.BufferedReader(_ZstdReader(raw), buffer_size=CHUNK_BYTES), raw
    return raw, raw


class _ZstdReader(io.RawIOBase):
    """A .zst file's bytes, frame after frame; a stream that ends inside a frame is an error (zstandard's
    own stream reader returns what it has and stops, so a truncated file would pass as a shorter one)."""

    def __init__(self, raw):
        import zstandard

        self._raw, self._new = raw, zstandard.ZstdDecompressor().decompressobj
        self._frame, self._in_frame = self._new(), False
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._at == len(self._out):
            data = self._raw.read(CHUNK_BYTES)
            if not data:
                if self._in_frame:
                    import zstandard

                    raise zstandard.ZstdError("the data ends inside a frame (truncated)")
                return 0
            self._out, self._at = self._decompress(data), 0
        n = min(len(b), len(self._out) - self._at)
        b[:n] = self._out[self._at:self._at + n]
        self._at += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._in_frame = not self._frame.eof
            data = self._frame.unused_data if self._frame.eof else b""
            if self._frame.eof:
                self._frame = self._new()
        return b"".join(out)

    def close(self) -> None:
        self._raw.close()
        super().close()


def _corrupt(path: str, e: Exception, lineno: int) -> SourceError:
    codec = COMPRESSED.get(Path(path).suffix, "file")
    at = f" after line {lineno}" if lineno else ""
    return SourceError(f"{path}: corrupt {codec} data{at} ({type(e).__name__}: {str(e) or 'truncated'}); "
                       "nothing of it was kept")


def _file_chunks(kind: str, path: str, text_field: str) -> Iterator[Chunk]:
    if kind == "parquet":
        yield from _parquet_chunks(path, text_field)
        return
    import zstandard

    errors = (OSError, EOFError, zlib.error, zstandard.ZstdError)
    lineno = 0
    total, done = stored_size(path), 0
    f, raw = _open_raw(path)
    with f:
        try:
            if kind == "text":
                yield Chunk("text", path, 0, [f.read()], total)
                return
            batch: list[bytes] = []
            size, first = 0, 1
            for lineno, line in enumerate(f, 1):  # noqa: B007  (lineno names where a corrupt stream broke)
                batch.append(line)
                size += len(line)
                if size >= CHUNK_BYTES:
                    at = min(raw.tell(), total)  # how far into the stored file its reader is
                    yield Chunk("jsonl", path, first, batch, at - done)
                    batch, size, first, done = [], 0, lineno + 1, at
            if batch:
                yield Chunk("jsonl", path, first, batch, total - done)
        except errors as e:
            raise _corrupt(path, e, lineno) from None


def _parquet_chunks(path: str, text_field: str) -> Iterator[Chunk]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _open(path) as f:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"{path}: not a readable parquet file ({first_line(e)})") from None
        names = pf.schema_arrow.names
        if text_field not in names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise SourceError(f"{path}: no column {text_field!r} (it has {shown}); name the text column with "
                              "--text-field")
        row, total, rows, done = 0, stored_size(path), max(pf.metadata.num_rows, 1), 0
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
                values = batch.column(0).to_pylist()
                row += len(values)
                at = total * row // rows  # rows read, as a share of the file
                yield Chunk("parquet", path, row - len(values), values, at - done)
                done = at
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"{path}: corrupt parquet data after row {row} ({first_line(e)})") from None


def _tfds(arg: str, field: str, data_dir: str | None) -> Iterator[str]:
    """A TFDS dataset read offline from `data_dir` with `tfds.data_source` (no TensorFlow needed)."""
    import tensorflow_datasets as tfds

    name, _, split = arg.partition(":")
    try:
        source = tfds.data_source(name, split=split or "train", data_dir=data_dir, download=False)
    except Exception as e:  # TFDS raises many types for a missing dataset
        where = data_dir or "the default TFDS data_dir"
        raise SourceError(f"tfds:{arg}: cannot open from {where} ({type(e).__name__}: {first_line(e)})") from None
    for i in range(len(source)):
        record = source[i]
        text = record.get(field) if isinstance(record, dict) else None
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if not isinstance(text, str):
            raise SourceError(f"tfds:{arg}: record {i} has no text feature {field!r} (has {sorted(record)})")
        yield text
