"""A prepared dataset's manifest: what its shards hold. The writer (zerolm.data.prepare) and every reader
(zerolm.data.shards, the run's dataset identity, evaluation) share this record.

    manifest.json   {"format": "zerolm-tokens/1", "seq_len": ..., "dtype": "uint16", "tokenizer": {...},
                     "splits": {"train": {"shards": [{"name", "samples", "bytes"}, ...], ...}, "val": ...}, ...}

The manifest is written last: its presence means the dataset is complete. Shard and tokenizer names are
paths relative to the dataset's directory (a gs:// build keeps its files under a prefix of its own).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from zerolm.core.errors import ZerolmError

FORMAT = "zerolm-tokens/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


class DataError(ZerolmError):
    """A prepared dataset that does not match its manifest, or cannot be read; one line naming the file."""


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    kind: str  # hf | tiktoken
    name: str
    sha256: str  # of the tokenizer's file: what a checkpoint records and checks
    vocab_size: int
    eot_id: int
    file: str  # its copy in the dataset


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    name: str
    samples: int
    bytes: int | None = None  # absent in datasets of old zerolms


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    shards: tuple[ShardInfo, ...]
    samples: int
    tokens: int
    unigram_entropy: float | None  # nats/token: the loss of a model that learned no context


@dataclasses.dataclass(frozen=True)
class Decontamination:
    """What `zerolm prepare --decontaminate` left out: the training documents sharing an n-gram of n words with
    the tasks' documents (their n-grams' sha256: zerolm.data.ngrams); their number, and the sha256 of their
    ids ("unit-00000:17" lines, sorted; each unit's record lists its own)."""

    tasks: tuple[str, ...]
    ngram: int
    ngrams_sha256: str
    documents: int
    documents_sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    seq_len: int
    dtype: str  # of a token: uint16, or uint32 for vocabularies over 65,536
    tokenizer: TokenizerInfo
    splits: dict[str, SplitInfo]
    documents: int
    val_every: int
    val_rule: str  # how the validation split was chosen
    source: str = ""
    skipped: int = 0  # bad records skipped (prepare --skip-bad)
    skipped_first: str = ""
    seconds: float = 0.0
    units: tuple[str, ...] = ()  # the units' directories (zerolm.data.packing), shards referenced or not
    decontamination: Decontamination | None = None  # prepare --decontaminate
    format: str = FORMAT

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        """The manifest `data` (parsed JSON) at `where`; DataError naming it if it is not one this zerolm reads."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise DataError(f"{where}: format {found!r}, expected {FORMAT!r}")
        try:
            splits = {name: SplitInfo(tuple(ShardInfo(**s) for s in split["shards"]), split["samples"], split["tokens"],
                                      split.get("unigram_entropy"))
                      for name, split in data["splits"].items()}
            fields = {f.name for f in dataclasses.fields(cls)} - {"tokenizer", "splits", "units", "decontamination"}
            removed = data.get("decontamination")
            decontamination = (Decontamination(**{**removed, "tasks": tuple(removed["tasks"])}) if removed else None)
            return cls(tokenizer=TokenizerInfo(**data["tokenizer"]), splits=splits, units=tuple(data.get("units", ())),
                       decontamination=decontamination, **{k: v for k, v in data.items() if k in fields})
        except (KeyError, TypeError) as e:
            raise DataError(f"{where}: not a complete manifest ({type(e).__name__}: {e})") from None

    @classmethod
    def parse(cls, text: str | bytes, where: str) -> Manifest:
        try:
            return cls.from_json(json.loads(text), where)
        except ValueError as e:
            raise DataError(f"{where}: cannot read manifest ({e})") from None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def files(self) -> list[str]:
        """Every file of the dataset but the manifest, by name (a unit's directory by its name)."""
        return [self.tokenizer.file, *self.units, *(s.name for split in self.splits.values() for s in split.shards)]

    def under(self, prefix: str) -> Manifest:
        """The same dataset with its files' names under `prefix` ("build-.../")."""
        return dataclasses.replace(
            self, tokenizer=dataclasses.replace(self.tokenizer, file=prefix + self.tokenizer.file),
            units=tuple(prefix + u for u in self.units),
            splits={name: dataclasses.replace(split, shards=tuple(dataclasses.replace(s, name=prefix + s.name)
                                                                   for s in split.shards))
                    for name, split in self.splits.items()})
