"""Reading a prepared dataset: the manifest, and samples by id from its webdataset tar shards.

Local shards are memory-mapped and read row by row. Every member has the same size, so sample i of a
shard sits at i × stride. URLs (https://, gs://, pipe:...) are streamed whole through webdataset and
kept in a small cache. Anything that does not match the manifest stops with one line naming the file
and sample: a member of the wrong size, and a token id outside the tokenizer's vocabulary (checked
on the host as rows are read: a max over each row). With `skip_bad`, such a row is replaced by the
next readable one in its shard and counted instead.
"""

from __future__ import annotations

import collections
import io
import json
import os
import tarfile
import threading
from pathlib import Path

import numpy as np

from zerolm.data.prepare import FORMAT, MANIFEST, webdataset
from zerolm.data.tokenizer import Tokenizer, cache_dir, from_file


class DataError(ValueError):
    """A prepared dataset that does not match its manifest; one line naming the file and sample."""


def is_url(location: str) -> bool:
    return "://" in location or location.startswith("pipe:")


def _join(location: str, name: str) -> str:
    """A file of the dataset; for pipe: locations ("pipe:gsutil cat gs://b/ds") the command's argument."""
    return f"{location.rstrip('/')}/{name}"


def _read_bytes(location: str) -> bytes:
    if is_url(location):
        with webdataset().gopen(location, "rb") as f:
            return f.read()
    return Path(location).read_bytes()


class PreparedDataset:
    def __init__(self, location: str | Path):
        self.location = str(location)
        where = _join(self.location, MANIFEST)
        try:
            self.manifest = json.loads(_read_bytes(where))
        except FileNotFoundError:
            raise DataError(f"{where}: no manifest: not a prepared dataset (run `zerolm prepare`)") from None
        except (OSError, ValueError) as e:
            raise DataError(f"{where}: cannot read manifest ({e})") from None
        if self.manifest.get("format") != FORMAT:
            raise DataError(f"{where}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        self.seq_len: int = self.manifest["seq_len"]
        self.dtype = np.dtype(self.manifest["dtype"])
        self.vocab_size: int = self.manifest["tokenizer"]["vocab_size"]

    def split(self, name: str, skip_bad: bool = False) -> Split:
        return Split(self, name, skip_bad)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the dataset was prepared with; a remote one is fetched into the cache first."""
        info = self.manifest["tokenizer"]
        where = _join(self.location, info["file"])
        if is_url(where):
            local = cache_dir() / "tokenizers" / info["sha256"][:16] / info["file"]
            if not local.exists():
                local.parent.mkdir(parents=True, exist_ok=True)
                tmp = local.with_name(f".{local.name}.{os.getpid()}")
                tmp.write_bytes(_read_bytes(where))
                os.replace(tmp, local)
            where = str(local)
        tok = from_file(Path(where))
        if tok.sha256 != info["sha256"]:
            raise DataError(f"{where}: tokenizer sha256 {tok.sha256[:12]} does not match the manifest's {info['sha256'][:12]}")
        tok.name = info["name"]
        return tok


class Split:
    """One split's samples, addressed by id 0 .. len-1 (shards in manifest order)."""

    def __init__(self, dataset: PreparedDataset, name: str, skip_bad: bool):
        self.dataset, self.name, self.skip_bad = dataset, name, skip_bad
        info = dataset.manifest["splits"][name]
        self.shards: list[dict] = info["shards"]
        self.sizes = np.array([s["samples"] for s in self.shards], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])
        self.T1 = dataset.seq_len + 1
        self.rows_read = 0  # rows this process has read from storage (tests count them)
        self.bad_samples = 0  # with skip_bad: rows replaced by a neighbour because they were unreadable
        self._readers: dict[int, _LocalShard] = {}
        self._remote: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def verify(self) -> None:
        """Every local shard of the manifest is present with its recorded size: a stat per shard, so a
        missing or truncated shard stops a run before its first step, not when first read. (URL
        datasets are checked as they stream.)"""
        if is_url(self.dataset.location):
            return
        for shard in self.shards:
            path = Path(self.dataset.location) / shard["name"]
            try:
                size = path.stat().st_size
            except OSError as e:
                raise DataError(f"{path}: missing or unreadable shard ({e.strerror})") from None
            if "bytes" in shard and size != shard["bytes"]:
                raise DataError(f"{path}: {size} bytes, the manifest says {shard['bytes']} "
                                "(truncated or replaced shard)")

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows for sample ids, as int32 (n, seq_len + 1)."""
        ids = np.asarray(ids, np.int64)
        out = np.empty((len(ids), self.T1), np.int32)
        shard_of = np.searchsorted(self.starts, ids, side="right") - 1
        for k in np.unique(shard_of):
            sel = shard_of == k
            out[sel] = self._read_shard(int(k), ids[sel] - self.starts[k])
        with self._lock:
            self.rows_read += len(ids)
        return out

    def _read_shard(self, k: int, offsets: np.ndarray) -> np.ndarray:
        where = _join(self.dataset.location, self.shards[k]["name"])
        if is_url(where):
            return self._remote_shard(k, where)[offsets]
        with self._lock:
            if k not in self._readers:
                self._readers[k] = _LocalShard(Path(where), self.shards[k], self.T1, self.dataset.dtype,
                                               self.dataset.vocab_size)
            reader = self._readers[k]
        rows, bad = reader.rows(offsets, self.skip_bad)
        self.bad_samples += bad
        return rows

    def _remote_shard(self, k: int, url: str) -> np.ndarray:
        with self._lock:
            if k in self._remote:
                self._remote.move_to_end(k)
                return self._remote[k]
        rows = []
        try:
            for i, sample in enumerate(webdataset().WebDataset(url, shardshuffle=False, empty_check=False).decode()):
                rows.append(_check_row(sample.get("npy"), url, i, sample.get("__key__"), self.T1,
                                       self.dataset.vocab_size))
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{url}: cannot stream shard ({type(e).__name__}: {e})".splitlines()[0]) from None
        if len(rows) != self.shards[k]["samples"]:
            raise DataError(f"{url}: {len(rows)} samples, the manifest says {self.shards[k]['samples']}")
        array = np.stack(rows).astype(np.int32)
        with self._lock:
            self._remote[k] = array
            while len(self._remote) > 2:
                self._remote.popitem(last=False)
        return array


def _check_row(row, where: str, index: int, key, T1: int, vocab_size: int) -> np.ndarray:
    if not isinstance(row, np.ndarray) or row.shape != (T1,):
        shape = getattr(row, "shape", type(row).__name__)
        raise DataError(f"{where}: sample {index} ({key}) has shape {shape}, expected ({T1},)")
    if (top := int(row.max())) >= vocab_size:
        raise DataError(_out_of_vocab(where, index, top, vocab_size))
    return row


def _out_of_vocab(where, index: int, token: int, vocab_size: int) -> str:
    return (f"{where}: sample {index} has token id {token}, outside the tokenizer's vocabulary of {vocab_size} "
            "(corrupted data; data.skip_bad_samples: true replaces such samples)")


class _LocalShard:
    """A tar of equal-size .npy members, memory-mapped; checked against the manifest on open."""

    def __init__(self, path: Path, info: dict, T1: int, dtype: np.dtype, vocab_size: int):
        self.path, self.n, self.T1, self.vocab_size = path, info["samples"], T1, vocab_size
        try:
            size = path.stat().st_size
            self.map = np.memmap(path, np.uint8, mode="r")
        except OSError as e:
            raise DataError(f"{path}: missing or unreadable shard ({e.strerror})") from None
        if "bytes" in info and size != info["bytes"]:
            raise DataError(f"{path}: {size} bytes, the manifest says {info['bytes']} (truncated or replaced shard)")
        first = self._header(0, stride=0)
        npy = io.BytesIO(self.map[512: 512 + first.size].tobytes())
        version = np.lib.format.read_magic(npy)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, npy_dtype = read_header(npy)
        self.npy_header = npy.tell()
        self.npy_header_bytes = self.map[512: 512 + self.npy_header].tobytes()
        if shape != (T1,) or npy_dtype != dtype:
            raise DataError(f"{path}: sample 0 is {npy_dtype}{list(shape)}, the manifest says {dtype}[{T1}]")
        self.stride = 512 + -(-first.size // 512) * 512
        if size < self.n * self.stride + 1024:
            raise DataError(f"{path}: {size} bytes cannot hold the manifest's {self.n} samples (truncated shard)")
        try:
            self._header(self.n - 1, self.stride)
        except DataError as e:
            reason = str(e).removeprefix(f"{path}: ")
            raise DataError(f"{path}: does not match the manifest's {self.n} samples ({reason})") from None
        self.dtype = dtype

    def _header(self, i: int, stride: int) -> tarfile.TarInfo:
        try:
            info = tarfile.TarInfo.frombuf(self.map[i * stride: i * stride + 512].tobytes(), "utf-8",
                                           "surrogateescape")
        except tarfile.TarError as e:
            raise DataError(f"{self.path}: sample {i}: bad tar header ({e})") from None
        if info.name != f"{i:09d}.npy":
            raise DataError(f"{self.path}: sample {i}: found member {info.name!r}, expected {i:09d}.npy")
        return info

    def rows(self, offsets: np.ndarray, skip_bad: bool) -> tuple[np.ndarray, int]:
        out = np.empty((len(offsets), self.T1), np.int32)
        bad = 0
        itemsize = self.dtype.itemsize
        for j, i in enumerate(offsets):
            i = int(i)
            for attempt in range(self.n if skip_bad else 1):
                k = (i + attempt) % self.n
                start = k * self.stride + 512
                name = self.map[k * self.stride: k * self.stride + 13].tobytes()
                header = self.map[start: start + self.npy_header].tobytes()
                if name == f"{k:09d}.npy".encode() and header == self.npy_header_bytes:
                    body = self.map[start + self.npy_header: start + self.npy_header + self.T1 * itemsize]
                    out[j] = np.frombuffer(body.tobytes(), self.dtype)
                    if (top := int(out[j].max())) < self.vocab_size:
                        break
                    problem = _out_of_vocab(self.path, k, top, self.vocab_size)
                else:
                    problem = (f"{self.path}: sample {k} is not a {self.dtype}[{self.T1}] .npy member "
                               "(wrong length or corrupted)")
                if not skip_bad:
                    raise DataError(problem)
                bad += 1
            else:
                raise DataError(f"{self.path}: no readable sample in the shard")
        return out, bad
