"""How much of each task is in a prepared dataset's training split: `zerolm contamination`.

Every training document (zerolm.data.documents: whole across samples and shards, none past an
end-of-text) is looked through for the tasks' n-grams (zerolm.data.ngrams: GPT-3's words and n-grams),
in worker processes that each hold the tasks' n-grams and one shard at a time, so memory is bounded
whatever the corpus. A task document is dirty when any of its n-grams is in some training document.

The work is the split's items (one per shard, zerolm.data.documents.Item); `--part I/N` takes items
I-1, I-1+N, ... and writes what it found to `DATASET/contamination/parts-<SET>-of-N/part-I.json` (SET: the
first 12 hex digits of the tasks' n-grams' sha256, so parts of other tasks never mix). The part that
finds all N there merges them, and any part run again merges again: the result is the one a single pass
gives, byte for byte. The result, `DATASET/contamination/<n>gram.json` (written atomically, local or
gs://), keeps the entries of tasks scanned before at the same n beside those of this scan:

    {"format": "zerolm-contamination/1", "dataset": ..., "ngram": 13,
     "training": {"documents": ..., "tokens": ..., "dirty_documents": ...},
     "tasks": {NAME: {"documents": int, "dirty": int, "dirty_fraction": float, "dirty_documents": [i, ...],
                      "examples": [{"document": i, "ngram": "...", "where": "unit-00000/train-000000.tar document 3"}],
                      "ngrams_sha256": ...}}}
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from zerolm.core import storage
from zerolm.core.errors import ZerolmError
from zerolm.core.exitcodes import EXIT_USAGE
from zerolm.data import documents as docs
from zerolm.data.ngrams import Matcher, NgramSet

FORMAT = "zerolm-contamination/1"
PART_FORMAT = "zerolm-contamination-part/1"
DIRECTORY = "contamination"  # in the dataset's directory
BATCH_TOKENS = 1 << 20  # tokens decoded and looked through at once
EXAMPLES = 3  # example matches kept per task


class ContaminationError(ZerolmError):
    """A scan that cannot run: a bad --part or --ngram, a dataset or task that is not there; one line."""

    exit_code = EXIT_USAGE


@dataclasses.dataclass
class Tally:
    """What a scan of some items found: training documents and tokens read, documents holding a task
    n-gram, and each n-gram found (by index into the set's keys) at its first place: (item, where, words)."""

    items: int = 0
    documents: int = 0
    tokens: int = 0
    dirty_documents: int = 0
    found: dict[int, tuple[int, str, str]] = dataclasses.field(default_factory=dict)

    def add(self, other: Tally) -> Tally:
        """Both tallies' sums; an n-gram's first place is the one in the earlier item."""
        found = dict(self.found)
        for key, place in other.found.items():
            if key not in found or place[0] < found[key][0]:
                found[key] = place
        return Tally(self.items + other.items, self.documents + other.documents, self.tokens + other.tokens,
                     self.dirty_documents + other.dirty_documents, found)

    def to_json(self) -> dict[str, Any]:
        return {"items": self.items, "documents": self.documents, "tokens": self.tokens,
                "dirty_documents": self.dirty_documents,
                "found": {str(k): list(v) for k, v in sorted(self.found.items())}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tally:
        found = {int(k): (int(v[0]), str(v[1]), str(v[2])) for k, v in data["found"].items()}
        return cls(data["items"], data["documents"], data["tokens"], data["dirty_documents"], found)


def scan_item(reader: docs.Reader, matcher: Matcher, index: int, item: docs.Item) -> Tally:
    """Item `index` of the split looked through (its documents in batches of about BATCH_TOKENS tokens)."""
    tally = Tally(items=1)
    tokenizer = reader.tokenizer
    where = reader.name(item)
    batch: list[docs.Piece] = []
    size = 0

    def flush() -> None:
        found = matcher.find([docs.text(tokenizer, piece) for piece in batch])
        owners = {batch[t].document for t in found.texts.tolist()}
        tally.dirty_documents += len(owners - dirty_before)
        dirty_before.update(owners)
        for key, t, words in zip(found.keys.tolist(), found.texts.tolist(), found.ngrams, strict=True):
            tally.found.setdefault(key, (index, f"{where} document {batch[t].document}", words))

    dirty_before: set[int] = set()
    for piece in reader.documents(item):
        tally.documents += piece.starts
        tally.tokens += len(piece.tokens) + piece.ends  # its end-of-text counted
        batch.append(piece)
        size += len(piece.tokens)
        if size >= BATCH_TOKENS:
            flush()
            batch, size = [], 0
    if batch:
        flush()
    return tally


def part_items(count: int, part: tuple[int, int]) -> list[int]:
    """The items (indices) of part I of N: I-1, I-1+N, ..."""
    index, parts = part
    return list(range(index - 1, count, parts))


def scan(location: str, ngrams: NgramSet, part: tuple[int, int] = (1, 1), workers: int = 1,
         pieces: docs.Pieces = docs.DEFAULT_PIECES, progress: Callable[[Tally], None] | None = None) -> Tally:
    """This part's items of the dataset at `location` looked through for `ngrams`, by `workers` processes
    (1: this one)."""
    reader = docs.Reader(location, pieces)
    mine = part_items(len(docs.items(reader.dataset.manifest)), part)
    total = Tally()
    for tally in _tallies(location, ngrams, mine, workers, pieces, reader):
        total = total.add(tally)
        if progress is not None:
            progress(tally)
    return total


def _tallies(location: str, ngrams: NgramSet, mine: list[int], workers: int, pieces: docs.Pieces,
             reader: docs.Reader) -> Iterator[Tally]:
    every = docs.items(reader.dataset.manifest)
    if workers <= 1 or len(mine) <= 1:
        matcher = Matcher(ngrams)
        for i in mine:
            yield scan_item(reader, matcher, i, every[i])
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(workers, len(mine)), mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_init, initargs=(location, ngrams, pieces, os.getpid())) as pool:
        yield from pool.map(_worker_scan, mine)


_WORKER: dict[str, Any] = {}


def _worker_init(location: str, ngrams: NgramSet, pieces: docs.Pieces, parent: int) -> None:
    """A worker process: its own reader and matcher; Ctrl-C left to the parent; gone when the parent is."""
    from zerolm.core.interrupts import die_with_parent

    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reader = docs.Reader(location, pieces)
    _WORKER.update(reader=reader, matcher=Matcher(ngrams), items=docs.items(reader.dataset.manifest))


def _worker_scan(index: int) -> Tally:
    return scan_item(_WORKER["reader"], _WORKER["matcher"], index, _WORKER["items"][index])


def report(location: str, ngrams: NgramSet, tally: Tally) -> dict[str, Any]:
    """The scan's JSON (module docstring) from what every item found."""
    found = sorted(tally.found.items(), key=lambda kv: (kv[1][0], kv[0]))  # by first place
    first: dict[int, tuple[int, str, str]] = {}  # task document -> its first n-gram found
    for key, place in found:
        for owner in ngrams.owners[ngrams.owner_starts[key]:ngrams.owner_starts[key + 1]].tolist():
            first.setdefault(owner, place)
    tasks, offset = {}, 0
    for name, count in ngrams.groups:
        dirty = sorted(d - offset for d in first if offset <= d < offset + count)
        examples = [{"document": d, "ngram": first[d + offset][2], "where": first[d + offset][1]}
                    for d in dirty[:EXAMPLES]]
        tasks[name] = {"documents": count, "dirty": len(dirty), "dirty_fraction": len(dirty) / count if count else 0.0,
                       "dirty_documents": dirty, "examples": examples, "ngrams_sha256": ngrams.fingerprint()}
        offset += count
    return {"format": FORMAT, "dataset": location, "ngram": ngrams.n,
            "training": {"documents": tally.documents, "tokens": tally.tokens,
                         "dirty_documents": tally.dirty_documents},
            "tasks": tasks}


def result_path(location: str, n: int):
    return storage.path(location) / DIRECTORY / f"{n}gram.json"


def parts_path(location: str, ngrams: NgramSet, parts: int):
    return storage.path(location) / DIRECTORY / f"parts-{ngrams.fingerprint()[:12]}-of-{parts}"


def write_result(location: str, result: dict[str, Any]) -> None:
    """The scan's JSON beside the dataset, with the tasks an earlier scan at the same n measured and this one
    did not."""
    target = result_path(location, result["ngram"])
    earlier = read_result(location, result["ngram"])
    if earlier is not None and earlier.get("training") == result["training"]:
        result = {**result, "tasks": {**earlier["tasks"], **result["tasks"]}}
    _write(target, json.dumps(result, indent=1) + "\n")


def _write(target, text: str) -> None:
    if not storage.is_remote(target):
        target.parent.mkdir(parents=True, exist_ok=True)
    storage.write_atomic(target, text)


def read_result(location: str, n: int | None = None) -> dict[str, Any] | None:
    """The contamination JSON beside a dataset: at `n`, or (None) at 13 if measured, else the smallest n
    measured; None if there is none (or it cannot be read)."""
    directory = storage.path(location) / DIRECTORY
    try:
        names = [n] if n is not None else sorted(
            (int(p.name.removesuffix("gram.json")) for p in directory.iterdir()
             if p.name.endswith("gram.json") and p.name.removesuffix("gram.json").isdigit()),
            key=lambda k: (k != 13, k))
        for k in names:
            data = json.loads((directory / f"{k}gram.json").read_text())
            if isinstance(data, dict) and data.get("format") == FORMAT:
                return data
    except (OSError, ValueError):
        return None
    return None


def write_part(location: str, ngrams: NgramSet, part: tuple[int, int], tally: Tally) -> list[int]:
    """This part's tally beside the dataset; returns the parts (1..N) not written yet."""
    directory = parts_path(location, ngrams, part[1])
    record = {"format": PART_FORMAT, "part": list(part), "ngram": ngrams.n, "ngrams_sha256": ngrams.fingerprint(),
              **tally.to_json()}
    _write(directory / f"part-{part[0]}.json", json.dumps(record) + "\n")
    present = {p.name for p in directory.iterdir()}
    return [i for i in range(1, part[1] + 1) if f"part-{i}.json" not in present]


def merge_parts(location: str, ngrams: NgramSet, parts: int) -> Tally:
    """Every part's tally, added in part order (ContaminationError naming a part that is missing or other)."""
    directory = parts_path(location, ngrams, parts)
    total = Tally()
    for i in range(1, parts + 1):
        where = directory / f"part-{i}.json"
        try:
            data = json.loads(where.read_text())
        except FileNotFoundError:
            raise ContaminationError(f"{where}: part {i} of {parts} has not been scanned yet") from None
        if data.get("format") != PART_FORMAT or data.get("ngrams_sha256") != ngrams.fingerprint():
            raise ContaminationError(f"{where}: not a part of this scan (other tasks or n)")
        total = total.add(Tally.from_json(data))
    return total


def dirty_fractions(locations: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each task measured against every one of these datasets (a run's data: one, or a mixture's), at the
    same n: its documents and dirty fraction over all of them (a document dirty in any is dirty), and its
    dirty documents. Tasks not measured against all are left out."""
    results = [read_result(location) for location in locations]
    if not results or any(r is None for r in results) or len({r["ngram"] for r in results if r}) != 1:
        return {}
    tasks: dict[str, dict[str, Any]] = {}
    names = set.intersection(*(set(r["tasks"]) for r in results if r))
    for name in sorted(names):
        entries = [r["tasks"][name] for r in results if r]
        dirty = sorted(set().union(*(e["dirty_documents"] for e in entries)))
        count = entries[0]["documents"]
        tasks[name] = {"ngram": results[0]["ngram"] if results[0] else 13, "documents": count, "dirty": len(dirty),
                       "dirty_fraction": len(dirty) / count if count else 0.0, "dirty_documents": dirty}
    return tasks


def check_part(part: tuple[int, int]) -> None:
    index, parts = part
    if not 1 <= index <= parts:
        raise ContaminationError(f"--part: {index}/{parts}: the part must be 1 to {parts}")



def measure(location: str, ngrams: NgramSet, part: tuple[int, int] | None = None, workers: int = 1,
            progress: Callable[[Tally], None] | None = None) -> tuple[dict[str, Any] | None, list[int]]:
    """Scan the dataset at `location` (or part I of N of it) and write the result beside it; returns the
    result (None while other parts are still to run) and the parts still to run."""
    if part is not None:
        check_part(part)
    tally = scan(location, ngrams, part or (1, 1), workers, progress=progress)
    if part is not None and part[1] > 1:
        missing = write_part(location, ngrams, part, tally)
        if missing:
            return None, missing
        tally = merge_parts(location, ngrams, part[1])
    result = report(location, ngrams, tally)
    write_result(location, result)
    return result, []


def training_locations(config: dict[str, Any] | None, location: str | None) -> list[str]:
    """Where a run's training data is, as its checkpoint records it: each dataset of its mixture, or the one
    dataset it read (`location`)."""
    mixture = ((config or {}).get("data") or {}).get("mixture")
    if mixture:
        return [str(entry["dataset"]) for entry in mixture]
    return [location] if location else []


def clean_scores(samples: dict[str, list[dict[str, Any]]], dirty: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each task's mean-scored metrics (acc, acc_norm, exact_match) over its clean documents only, from the
    harness's logged samples (their doc_id is the document's index, as the scan's dirty_documents are)."""
    out: dict[str, dict[str, float]] = {}
    for task, rows in samples.items():
        if task not in dirty:
            continue
        unclean = set(dirty[task]["dirty_documents"])
        clean = [row for row in rows if row.get("doc_id") not in unclean]
        for metric in ("acc", "acc_norm", "exact_match"):
            values = [float(row[metric]) for row in clean if isinstance(row.get(metric), int | float)]
            if values:
                out.setdefault(task, {})[metric] = sum(values) / len(values)
    return out


def describe_dirty(tasks: dict[str, dict[str, Any]], clean: dict[str, dict[str, float]] | None = None) -> list[str]:
    """One line per task: its dirty fraction against the run's data (and its clean-subset scores)."""
    lines = []
    for name, t in tasks.items():
        scores = ", ".join(f"{metric} {value:.4f}" for metric, value in (clean or {}).get(name, {}).items())
        lines.append(f"  {name}: {t['dirty_fraction']:.1%} dirty ({t['dirty']} of {t['documents']} documents share a "
                     f"{t['ngram']}-gram with the training data)" + (f"; on the clean ones: {scores}" if scores else ""))
    return lines
