"""Raw-text sources for `zerolm prepare`: `text:GLOB`, `jsonl:GLOB`, `tfds:NAME` and `default`.

Each yields documents in a fixed order. A bad record stops with one line naming the file and line,
unless the caller asked to skip bad records, in which case they are counted in `Skipped`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
from collections.abc import Iterator
from pathlib import Path

from zerolm.data.corpus import default_documents
from zerolm.errors import ZerolmError


class SourceError(ZerolmError):
    """Bad raw input; the message names the file (and line)."""


@dataclasses.dataclass
class Skipped:
    count: int = 0
    first: str = ""  # the first skipped record's reason, for the log

    def add(self, reason: str) -> None:
        self.count += 1
        self.first = self.first or reason


def _files(pattern: str, spec: str) -> list[Path]:
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise SourceError(f"{spec}: no files match {pattern!r}")
    return files


def iter_documents(spec: str, *, text_field: str = "text", tfds_data_dir: str | None = None,
                   skipped: Skipped | None = None) -> Iterator[str]:
    kind, _, arg = spec.partition(":")
    if spec == "default":
        yield from default_documents()
    elif kind == "text" and arg:
        for path in _files(arg, spec):
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                _bad(f"{path}: cannot read as UTF-8 text ({e})", skipped)
                continue
            if text.strip():
                yield text
    elif kind == "jsonl" and arg:
        for path in _files(arg, spec):
            yield from _jsonl(path, text_field, skipped)
    elif kind == "tfds" and arg:
        yield from _tfds(arg, text_field, tfds_data_dir)
    else:
        raise SourceError(f"{spec}: unknown source; use text:GLOB, jsonl:GLOB, tfds:NAME or default")


def _bad(reason: str, skipped: Skipped | None) -> None:
    if skipped is None:
        raise SourceError(reason)
    skipped.add(reason)


def _jsonl(path: Path, field: str, skipped: Skipped | None) -> Iterator[str]:
    try:
        f = path.open(encoding="utf-8")
    except OSError as e:
        raise SourceError(f"{path}: cannot open ({e.strerror})") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                _bad(f"{path}:{lineno}: not valid JSON ({e.msg})", skipped)
                continue
            if not isinstance(record, dict) or field not in record:
                _bad(f"{path}:{lineno}: no text field {field!r}", skipped)
                continue
            text = record[field]
            if not isinstance(text, str):
                _bad(f"{path}:{lineno}: field {field!r} is not a string (got {type(text).__name__} "
                     f"{json.dumps(text)[:40]})", skipped)
                continue
            if text.strip():
                yield text


def _tfds(arg: str, field: str, data_dir: str | None) -> Iterator[str]:
    """A TFDS dataset read offline from `data_dir` with `tfds.data_source` (no TensorFlow needed)."""
    import tensorflow_datasets as tfds

    name, _, split = arg.partition(":")
    try:
        source = tfds.data_source(name, split=split or "train", data_dir=data_dir, download=False)
    except Exception as e:  # TFDS raises many types for a missing dataset
        where = data_dir or "the default TFDS data_dir"
        raise SourceError(f"tfds:{arg}: cannot open from {where} ({type(e).__name__}: {e})".splitlines()[0]) from None
    for i in range(len(source)):
        record = source[i]
        text = record.get(field) if isinstance(record, dict) else None
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if not isinstance(text, str):
            raise SourceError(f"tfds:{arg}: record {i} has no text feature {field!r} (has {sorted(record)})")
        if text.strip():
            yield text
