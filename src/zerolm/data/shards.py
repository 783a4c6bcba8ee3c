"""Reading a prepared dataset: the manifest, and samples by id from its webdataset tar shards.

Every member of a shard has the same size, so sample i of a shard sits at i × stride, and a row is
read by itself: with pread locally, and as byte ranges from a URL (gs://, or any other location fsspec
reads: https://, file://), so that each host reads only its own rows wherever the dataset lives. The
data order spreads a batch over many shards (zerolm.data.order), so a read of many rows is one
concurrent request for all their ranges, whichever shards hold them, and the shards first touched by
it are opened (checked against the manifest) concurrently too: a step's rows cost about one round trip,
not one per shard. Anything that does not match the manifest stops with one line naming
the file and sample: a member of the wrong size, and a token id outside the tokenizer's vocabulary
(checked on the host as rows are read: a max over each row). With `skip_bad`, such a row is replaced
by the next readable one in its shard and counted instead.
"""

from __future__ import annotations

import io
import os
import tarfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from zerolm.core import storage
from zerolm.core.storage import cache_dir
from zerolm.data.manifest import MANIFEST, DataError, Manifest, ShardInfo
from zerolm.data.order import VERSION as ORDER_VERSION
from zerolm.data.order import GlobalOrder, ShardOrder, sample_order
from zerolm.data.tokenizer import Tokenizer, from_file


def _join(location: str, name: str) -> str:
    return f"{location.rstrip('/')}/{name}"


def _read_bytes(location: str) -> bytes:
    if storage.is_remote(location):
        with storage.faults(location, "reading"):
            return storage.read_bytes(location)
    return Path(location).read_bytes()


class PreparedDataset:
    def __init__(self, location: str | Path):
        self.location = str(location)
        where = _join(self.location, MANIFEST)
        if self.location.startswith("pipe:"):
            raise DataError(f"{self.location}: pipe: datasets are not read any more; name the dataset by its URL "
                            "(gs://BUCKET/PATH, https://...) and it is read directly")
        try:
            text = _read_bytes(where)
        except FileNotFoundError:
            raise DataError(f"{where}: no manifest: not a prepared dataset (run `zerolm prepare`)") from None
        except OSError as e:
            raise DataError(f"{where}: cannot read manifest ({e})") from None
        self.manifest = Manifest.parse(text, where)
        self.seq_len: int = self.manifest.seq_len
        self.dtype = np.dtype(self.manifest.dtype)
        self.vocab_size: int = self.manifest.tokenizer.vocab_size

    def split(self, name: str, skip_bad: bool = False) -> Split:
        return Split(self, name, skip_bad)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the dataset was prepared with; a remote one is fetched into the cache first."""
        info = self.manifest.tokenizer
        where = _join(self.location, info.file)
        if storage.is_remote(where):
            local = cache_dir() / "tokenizers" / info.sha256[:16] / info.file.rsplit("/", 1)[-1]
            if not local.exists():
                local.parent.mkdir(parents=True, exist_ok=True)
                tmp = local.with_name(f".{local.name}.{os.getpid()}")
                tmp.write_bytes(_read_bytes(where))
                os.replace(tmp, local)
            where = str(local)
        tok = from_file(Path(where))
        if tok.sha256 != info.sha256:
            raise DataError(f"{where}: tokenizer sha256 {tok.sha256[:12]} does not match the manifest's {info.sha256[:12]}")
        tok.name = info.name
        return tok


class Split:
    """One split's samples, addressed by id 0 .. len-1 (shards in manifest order)."""

    def __init__(self, dataset: PreparedDataset, name: str, skip_bad: bool):
        self.dataset, self.name, self.skip_bad = dataset, name, skip_bad
        self.shards = dataset.manifest.splits[name].shards
        self.sizes = np.array([s.samples for s in self.shards], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])
        self.T1 = dataset.seq_len + 1
        self.rows_read = 0  # rows this process has read from storage (tests count them)
        self.bad_samples = 0  # with skip_bad: rows replaced by a neighbour because they were unreadable
        self._readers: dict[int, _Shard] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def order(self, seed: int, version: int = ORDER_VERSION) -> GlobalOrder | ShardOrder:
        """The order a run reads this split in (zerolm.data.order)."""
        return sample_order(self.sizes, seed, version)

    def head(self, n: int) -> np.ndarray:
        """The split's first `n` samples (for evaluation)."""
        return self.read(np.arange(n))

    def verify(self) -> None:
        """Every shard of the manifest is present with its recorded size, so that a missing or
        truncated shard stops a run before its first step, not when first read: a stat per shard
        locally, one listing of the dataset on gs://."""
        location = self.dataset.location
        if storage.is_remote(location):
            with storage.faults(location, "listing the dataset"):
                present = storage.sizes(storage.path(location))
        for shard in self.shards:
            where = _join(location, shard.name)
            if storage.is_remote(location):
                size = present.get(shard.name)
                if size is None:
                    raise DataError(f"{where}: missing shard")
            else:
                try:
                    size = Path(where).stat().st_size
                except OSError as e:
                    raise DataError(f"{where}: missing or unreadable shard ({e.strerror})") from None
            if shard.bytes is not None and size != shard.bytes:
                raise DataError(f"{where}: {size} bytes, the manifest says {shard.bytes} "
                                "(truncated or replaced shard)")

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows for sample ids, as int32 (n, seq_len + 1): every range in one concurrent request."""
        ids = np.asarray(ids, np.int64)
        out = np.empty((len(ids), self.T1), np.int32)
        shard_of = np.searchsorted(self.starts, ids, side="right") - 1
        shards = [int(k) for k in np.unique(shard_of)]
        readers = self._open(shards)
        picks = [(k, shard_of == k) for k in shards]
        wanted = [(readers[k], [int(i) for i in ids[sel] - self.starts[k]]) for k, sel in picks]
        members = iter(_fetch_all([(reader, reader.ranges(offsets)) for reader, offsets in wanted]))
        for (_, sel), (reader, offsets) in zip(picks, wanted, strict=True):
            rows, bad = reader.rows(offsets, self.skip_bad, [next(members) for _ in offsets])
            out[sel] = rows
            self.bad_samples += bad
        with self._lock:
            self.rows_read += len(ids)
        return out

    def shard_tokens(self, k: int) -> np.ndarray:
        """Shard k's samples end to end, as int32: the whole shard in one read, each row checked as `read`
        checks it (a scan of every token: zerolm.data.documents)."""
        (shard,) = self._open([k]).values()
        raw = shard.bytes.read([(0, shard.n * shard.stride)])[0]
        members = [raw[i * shard.stride:i * shard.stride + shard.member] for i in range(shard.n)]
        rows, bad = shard.rows(list(range(shard.n)), self.skip_bad, members)
        self.bad_samples += bad
        return rows.reshape(-1)

    def _open(self, shards: list[int]) -> dict[int, _Shard]:
        """Readers of these shards; those not open yet are opened (and checked) concurrently."""
        def open_one(k: int) -> _Shard:
            where = _join(self.dataset.location, self.shards[k].name)
            return _Shard(where, self.shards[k], self.T1, self.dataset.dtype, self.dataset.vocab_size)

        with self._lock:
            missing = [k for k in shards if k not in self._readers]
        if len(missing) > 1 and storage.is_remote(self.dataset.location):
            with ThreadPoolExecutor(min(len(missing), 32), thread_name_prefix="shard-open") as pool:
                opened = list(pool.map(open_one, missing))
        else:
            opened = [open_one(k) for k in missing]
        with self._lock:
            self._readers.update(zip(missing, opened, strict=True))
            return {k: self._readers[k] for k in shards}


def _out_of_vocab(where, index: int, token: int, vocab_size: int) -> str:
    return (f"{where}: sample {index} has token id {token}, outside the tokenizer's vocabulary of {vocab_size} "
            "(corrupted data; data.skip_bad_samples: true replaces such samples)")


class _LocalBytes:
    """A local file's bytes, read with pread; the file is open only while it is read (a run touches every
    shard of a split, and thousands of them held open would exhaust the process's file descriptors)."""

    def __init__(self, where: str):
        self.where = where
        try:
            self.size = os.stat(where).st_size
        except OSError as e:
            raise DataError(f"{where}: missing or unreadable shard ({e.strerror})") from None

    def read(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        try:
            fd = os.open(self.where, os.O_RDONLY)
        except OSError as e:
            raise DataError(f"{self.where}: missing or unreadable shard ({e.strerror})") from None
        try:
            return [os.pread(fd, b - a, a) for a, b in ranges]
        finally:
            os.close(fd)


class _RemoteBytes:
    """A remote file's bytes, read as ranges (concurrent requests; nothing cached)."""

    def __init__(self, where: str, size: int | None):
        self.where = where
        with storage.faults(where, "reading the shard"):
            try:
                self.size = size if size is not None else storage.size(where)
            except FileNotFoundError:
                raise DataError(f"{where}: missing shard") from None

    def read(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        with storage.faults(self.where, "reading the shard"):
            try:
                return storage.read_ranges_of([self.where] * len(ranges), ranges)
            except FileNotFoundError:
                raise DataError(f"{self.where}: missing shard") from None


class _Shard:
    """A tar of equal-size .npy members, read member by member; checked against the manifest on open."""

    def __init__(self, where: str, info: ShardInfo, T1: int, dtype: np.dtype, vocab_size: int):
        self.path, self.n, self.T1, self.vocab_size = where, info.samples, T1, vocab_size
        self.bytes = (_RemoteBytes(where, info.bytes) if storage.is_remote(where) else _LocalBytes(where))
        size = self.bytes.size
        if info.bytes is not None and size != info.bytes:
            raise DataError(f"{where}: {size} bytes, the manifest says {info.bytes} (truncated or replaced shard)")
        head = self.bytes.read([(0, min(size, 1024))])[0]
        first = self._header(0, head)
        npy = io.BytesIO(head[512: 512 + first.size])
        try:
            version = np.lib.format.read_magic(npy)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                           np.lib.format.read_array_header_2_0)
            shape, _, npy_dtype = read_header(npy)
        except ValueError as e:
            raise DataError(f"{where}: sample 0 is not a .npy member ({e})") from None
        self.npy_header = npy.tell()
        self.npy_header_bytes = head[512: 512 + self.npy_header]
        if shape != (T1,) or npy_dtype != dtype:
            raise DataError(f"{where}: sample 0 is {npy_dtype}{list(shape)}, the manifest says {dtype}[{T1}]")
        self.stride = 512 + -(-first.size // 512) * 512
        self.member = 512 + self.npy_header + T1 * dtype.itemsize  # the bytes of a member that are read
        if size < self.n * self.stride + 1024:
            raise DataError(f"{where}: {size} bytes cannot hold the manifest's {self.n} samples (truncated shard)")
        last = (self.n - 1) * self.stride
        try:
            self._header(self.n - 1, self.bytes.read([(last, last + 512)])[0])
        except DataError as e:
            reason = str(e).removeprefix(f"{where}: ")
            raise DataError(f"{where}: does not match the manifest's {self.n} samples ({reason})") from None
        self.dtype = dtype

    def _header(self, i: int, block: bytes) -> tarfile.TarInfo:
        try:
            info = tarfile.TarInfo.frombuf(block[:512], "utf-8", "surrogateescape")
        except tarfile.TarError as e:
            raise DataError(f"{self.path}: sample {i}: bad tar header ({e})") from None
        if info.name != f"{i:09d}.npy":
            raise DataError(f"{self.path}: sample {i}: found member {info.name!r}, expected {i:09d}.npy")
        return info

    def ranges(self, members: list[int]) -> list[tuple[int, int]]:
        return [(k * self.stride, k * self.stride + self.member) for k in members]

    def _fetch(self, members: list[int]) -> list[bytes]:
        return self.bytes.read(self.ranges(members))

    def rows(self, offsets: list[int], skip_bad: bool, fetched: list[bytes]) -> tuple[np.ndarray, int]:
        """The rows of members `offsets`, whose bytes are `fetched`; a bad one raises DataError, or with
        `skip_bad` is replaced by the next readable member."""
        out = np.empty((len(offsets), self.T1), np.int32)
        bad = 0
        name_end, body = 13, 512 + self.npy_header
        for j, (i, member) in enumerate(zip(offsets, fetched, strict=True)):
            i = int(i)
            for attempt in range(self.n if skip_bad else 1):
                k = (i + attempt) % self.n
                if attempt:
                    member = self._fetch([k])[0]
                if (len(member) == self.member and member[:name_end] == f"{k:09d}.npy".encode()
                        and member[512:body] == self.npy_header_bytes):
                    out[j] = np.frombuffer(member[body:], self.dtype, count=self.T1)
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


def _fetch_all(wanted: list[tuple[_Shard, list[tuple[int, int]]]]) -> list[bytes]:
    """The bytes of every (shard, ranges), in order: locally shard by shard; from a URL in one concurrent
    request whatever the number of shards."""
    if not wanted or not isinstance(wanted[0][0].bytes, _RemoteBytes):
        return [member for shard, ranges in wanted for member in shard.bytes.read(ranges)]
    urls = [shard.path for shard, ranges in wanted for _ in ranges]
    where = urls[0].rsplit("/", 1)[0] if len(wanted) > 1 else urls[0]
    with storage.faults(where, "reading the shards"):
        try:
            return storage.read_ranges_of(urls, [r for _, ranges in wanted for r in ranges])
        except FileNotFoundError as e:
            raise DataError(f"{e.filename or where}: missing shard") from None
