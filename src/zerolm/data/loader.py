"""The distributed, deterministic, resumable batch loader.

Order (zerolm.data.order): each epoch a keyed permutation of all the split's samples, drawn from (seed,
epoch). No shuffle buffer holds state, so the sample at stream position p is a pure function of (seed,
p). Optimizer step s takes positions [s·G, (s+1)·G). The global batch of a step is therefore fixed,
whatever the number of hosts, and resuming at step s needs only s.

Layout, for the accumulation scan: (accum, dp · micro, seq_len + 1), sharded P(None, 'dp') (with several slices,
dp is slices × dp, sharded P(None, ('slice', 'dp')): data rank d is slice d // dp's dp index d % dp); with a staged
context (zerolm.data.context), each device's rows cut to the step's context. Device
d's rows are the contiguous block [d·A·m, (d+1)·A·m) of the step's G rows, split into A micro-batches
of m. Each process reads only the rows of its own devices. On a (dp, tp) mesh with tp > 1, only tp = 0
devices are fed from storage (docs/design.md, "Data on a (dp, tp) mesh"); the others hold zeros and receive the rows through a
sum over tp.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from zerolm.data.context import ContextPlan
from zerolm.data.mixture import MixedSplit
from zerolm.data.order import VERSION as ORDER_VERSION
from zerolm.data.shards import DataError, Split
from zerolm.parallel import sharding
from zerolm.parallel.mesh import TP, data_axes, data_ranks, host_reads, this_host_has_first


class BatchLoader:
    """Global batches for optimizer steps, each process reading only its own devices' rows."""

    def __init__(self, split: Split | MixedSplit, mesh: Mesh, global_batch_size: int, micro_batch_size: int,
                 seed: int, order: int = ORDER_VERSION):
        if len(split) < global_batch_size:
            raise DataError(f"{split.dataset.location} ({split.name}): {len(split)} samples, fewer than one "
                             f"global batch of {global_batch_size}; use a smaller train.global_batch_size or more data")
        self.split, self.mesh = split, mesh
        self.G, self.micro = global_batch_size, micro_batch_size
        self.dp, self.tp = data_ranks(mesh), mesh.shape[TP]  # dp: the data ranks, slices × dp
        self.accum = global_batch_size // (micro_batch_size * self.dp)
        self.order = split.order(seed, order)
        self.shape = (self.accum, self.dp * self.micro, split.T1)
        self.sharding = sharding.batch(mesh)
        # Staging array with a leading tp axis: device (dp i, tp j) holds slot j of dp block i. Only
        # slot 0 is read from storage, so a host reads the blocks of its tp = 0 devices: exactly
        # host_reads(mesh).dp_blocks of them. The sum over tp hands them to the rest.
        # (jax.make_array_from_process_local_data would need every host to read the rows of all its
        # devices, tp ≠ 0 ones included: this keeps "only tp = 0 hosts read".)
        self._staging = sharding.batch_staging(mesh)
        self._staged_shape = (self.tp, *self.shape)
        self._sum_tp = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=self.sharding)
        # The dp blocks this host reads: those of its tp = 0 devices (host_reads).
        self._devices = [(d, (idx[0].start or 0, (idx[2].start or 0) // self.micro))
                         for d, idx in self._staging.addressable_devices_indices_map(self._staged_shape).items()
                         if idx is not None]
        self.reads = this_host_has_first(mesh, data_axes(mesh))  # a host at tp = 0 loads data
        self._read_blocks = sorted({dp for _, (tp, dp) in self._devices if tp == 0})
        assert (self.reads, len(self._read_blocks)) == host_reads(mesh)

    def device_rows(self, step: int, dp_index: int) -> np.ndarray:
        """The (accum, micro, T+1) rows of dp block `dp_index` at `step`, read from storage."""
        per_device = self.accum * self.micro
        positions = step * self.G + dp_index * per_device + np.arange(per_device)
        rows = self.split.read(self.order.ids(positions))
        return rows.reshape(self.accum, self.micro, -1)

    def global_batch(self, step: int) -> jax.Array:
        return self.assemble(self.stage(step))

    def stage(self, step: int, plan: ContextPlan | None = None) -> jax.Array:
        """The step's rows on the devices that read them (zeros on tp ≠ 0 devices), cut to the step's context
        where a staged-context `plan` says: no collective, so safe on the prefetch thread."""
        read = {dp: self.device_rows(step, dp) for dp in self._read_blocks}  # each block once
        per_device = (self.accum, self.micro, self.shape[-1])
        if plan is not None:  # `step` counts from 0: it feeds step + 1
            context = plan.at(step + 1)
            read = {dp: plan.cut(rows, context) for dp, rows in read.items()}
            per_device = (self.accum, self.micro * context.rows, context.seq_len + 1)
        shape = (self.accum, self.dp * per_device[1], per_device[2])
        zeros = np.zeros(per_device, np.int32)
        arrays = []
        for d, (tp_index, dp_index) in self._devices:
            rows = read[dp_index] if tp_index == 0 else zeros
            arrays.append(jax.device_put(rows if self.tp == 1 else rows[None], d))
        if self.tp == 1:  # nothing to hand over: the rows are already where they belong
            return jax.make_array_from_single_device_arrays(shape, self.sharding, arrays)
        return jax.make_array_from_single_device_arrays((self.tp, *shape), self._staging, arrays)

    def assemble(self, staged: jax.Array) -> jax.Array:
        """The staged rows handed over tp: a collective when tp spans processes, so it must run on the
        thread that runs the steps. Collectives across processes must be issued in the same order
        everywhere (gloo and NCCL pair them by order), and the prefetch thread's would race the step's."""
        return staged if self.tp == 1 else self._sum_tp(staged)

    def batches(self, start_step: int, prefetch: int = 2, plan: ContextPlan | None = None) -> Prefetcher:
        """(batch, seconds the consumer waited for it) from `start_step` on, read ahead on a thread; each cut to
        its step's context where a staged-context `plan` says."""
        def produce():
            step = start_step
            while True:
                yield self.stage(step, plan)
                step += 1
        return Prefetcher(produce(), prefetch, finish=self.assemble)


class Prefetcher:
    """Runs an iterator on a background thread, `depth` items ahead. Iterate for (item, seconds waited).

    close() stops and joins the thread, so nothing touches JAX after the training loop ends.
    """

    def __init__(self, it: Iterator, depth: int, finish=None):
        self._finish = finish or (lambda item: item)  # on the consumer's thread
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(it,), name="batch-prefetch", daemon=True)
        self._thread.start()

    def _produce(self, it: Iterator) -> None:
        try:
            for item in it:
                while not self._stop.is_set():
                    try:
                        self._queue.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # hand the producer's error to the consumer
            self._queue.put((None, e))

    def __iter__(self):
        return self

    def __next__(self) -> tuple[Any, float]:
        t0 = time.perf_counter()
        item, error = self._queue.get()
        if error is not None:
            raise error
        waited = time.perf_counter() - t0
        return self._finish(item), waited

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a producer waiting on a full queue
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)
