"""Packed samples and the distributed, deterministic batch loader.

The batch of optimizer step `s` is a pure function of (seed, s): samples are read in a global order
that is a seeded permutation per epoch, step `s` takes positions [s·G, (s+1)·G) of that endless
stream, and every process reads only the rows of its own devices. Resuming at step `s` therefore
needs nothing but `s`, on any number of processes.

Global batch layout, for the accumulation scan: shape (accum, dp · micro, seq_len + 1), sharded
P(None, 'dp'). Device d's rows are the contiguous block [d·A·m, (d+1)·A·m) of the step's G rows,
split into A micro-batches of m.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerolm.mesh import DP


def pack(token_docs: Sequence[np.ndarray], eot_id: int, seq_len: int) -> np.ndarray:
    """Join documents with an end-of-text token and cut the stream into (n, seq_len + 1) samples."""
    stream = np.concatenate([np.append(doc, eot_id) for doc in token_docs]).astype(np.int32)
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def unigram_entropy(samples: np.ndarray) -> float:
    """Entropy in nats/token of the corpus's unigram distribution: what a model that learned nothing
    about context would score."""
    counts = np.bincount(samples.reshape(-1))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def to_accum_layout(rows: np.ndarray, n_devices: int, accum: int, micro: int) -> np.ndarray:
    """(n_devices · accum · micro, T) rows -> (accum, n_devices · micro, T): device d's contiguous block
    of rows, split into `accum` micro-batches of `micro`."""
    T = rows.shape[-1]
    return rows.reshape(n_devices, accum, micro, T).transpose(1, 0, 2, 3).reshape(accum, n_devices * micro, T)


def _local_dp_indices(mesh: Mesh) -> list[int]:
    """The dp coordinates held by this process's devices (contiguous for the meshes jax.make_mesh builds)."""
    dp_axis = mesh.axis_names.index(DP)
    me = jax.process_index()
    idx = sorted({int(c[dp_axis]) for c, d in np.ndenumerate(mesh.devices) if d.process_index == me})
    if idx != list(range(idx[0], idx[-1] + 1)):
        raise ValueError(f"process {me} holds non-contiguous dp indices {idx}")
    return idx


class BatchLoader:
    """Global batches for optimizer steps, built from each process's own rows."""

    def __init__(self, samples: np.ndarray, mesh: Mesh, global_batch_size: int, micro_batch_size: int,
                 seed: int):
        dp = mesh.shape[DP]
        if len(samples) < global_batch_size:
            raise ValueError(f"the dataset has {len(samples)} samples, fewer than one global batch "
                             f"({global_batch_size}); use a smaller train.global_batch_size or more data")
        self.samples = samples
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.micro = micro_batch_size
        self.dp = dp
        self.accum = global_batch_size // (micro_batch_size * dp)
        self.sharding = NamedSharding(mesh, P(None, DP))
        self.local_dp = _local_dp_indices(mesh)
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The global sample order of one epoch: a pure function of (seed, epoch)."""
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.samples))}
        return self._orders[epoch]

    def indices(self, step: int, rows: slice | None = None) -> np.ndarray:
        """Sample indices of the step's global batch (or of `rows` of it), in batch order."""
        rows = rows or slice(0, self.global_batch_size)
        n = len(self.samples)
        positions = step * self.global_batch_size + np.arange(rows.start, rows.stop)
        out = np.empty(len(positions), np.int64)
        for epoch in np.unique(positions // n):
            sel = positions // n == epoch
            out[sel] = self.order(int(epoch))[positions[sel] % n]
        return out

    def local_batch(self, step: int) -> np.ndarray:
        """This process's rows, shaped (accum, local_dp · micro, seq_len + 1)."""
        per_device = self.accum * self.micro
        first, count = self.local_dp[0], len(self.local_dp)
        rows = self.samples[self.indices(step, slice(first * per_device, (first + count) * per_device))]
        return to_accum_layout(rows, count, self.accum, self.micro)

    def global_batch(self, step: int) -> jax.Array:
        shape = (self.accum, self.dp * self.micro, self.samples.shape[-1])
        return jax.make_array_from_process_local_data(self.sharding, self.local_batch(step), shape)

    def batches(self, start_step: int, prefetch: int = 2) -> Iterator[tuple[jax.Array, float]]:
        """(batch, seconds the consumer waited for it) from `start_step` on, read ahead on a thread."""
        return _prefetch((self.global_batch(s) for s in _count(start_step)), prefetch)


def _count(start: int) -> Iterator[int]:
    while True:
        yield start
        start += 1


def _prefetch(it: Iterator, depth: int) -> Iterator[tuple[object, float]]:
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce():
        try:
            for item in it:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # hand the producer's error to the consumer
            q.put((None, e))

    thread = threading.Thread(target=produce, name="batch-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            t0 = time.perf_counter()
            item, error = q.get()
            if error is not None:
                raise error
            yield item, time.perf_counter() - t0
    finally:
        stop.set()
