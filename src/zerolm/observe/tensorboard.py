"""A run's metrics as TensorBoard scalars (`logging.tensorboard`): every number metrics.jsonl holds, under its
name there, at its step, in event files that tensorboardX's writer writes into the run's TensorBoard directory
(`<logging.dir>/tensorboard`, or `logging.tensorboard_dir`: a local path or gs://, both of which TensorBoard
reads). A value a row repeats at the step it was already written at (`tokens_seen` beside an evaluation) is
written once.

Each launch writes a file of its own that opens with TensorBoard's restart marker (a SessionLog START at the first
step the launch trains: tensorboardX's `purge_step`). TensorBoard drops every event of that step and later ones
that the files before it hold, so the steps a killed launch logged after the checkpoint the run resumed from are
shown once, with the values of the launch that trained them again, as metrics.jsonl drops their lines.

The events are written on a thread of their own: the loop hands a row over and goes on. That thread flushes the
file within FLUSH_S seconds of a row (FLUSH_REMOTE_S on gs://, where each flush uploads the whole object again:
GCS has no append), and `flush` waits until everything handed over is in the file: the loop asks before a
checkpoint is saved and after the work between two steps, so a resume from a checkpoint finds every step up to it
here. (tensorboardX's SummaryWriter queues its events too, but its flush does not wait for the queue; so the
events go through its EventsWriter, the file writer under it, on this module's thread.) A write that fails stops
the run at the loop's next row, as any storage fault does (StorageFault).

TensorBoard's scalars are 32-bit floats: counts past 2**24 (tokens_seen, device bytes) read back to about seven
significant digits; metrics.jsonl keeps them exact.
"""

from __future__ import annotations

import os
import queue
import threading
import time

from zerolm.core import storage

FLUSH_S = 5.0  # a row is in the local file (and on a dashboard) this long after the loop wrote it, at most
FLUSH_REMOTE_S = 60.0  # on gs://: each flush uploads the file whole


class TensorBoardWriter:
    """metrics.jsonl's rows as TensorBoard scalars in `directory` (local or gs://), from step `first_step` on."""

    def __init__(self, directory: str, first_step: int):
        """`first_step`: the first step this launch trains (1, or the resumed checkpoint's step + 1): the events
        of it and later steps in the directory's earlier files are TensorBoard's to drop."""
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.record_writer import directory_check

        self.directory = directory
        self._every = FLUSH_REMOTE_S if storage.is_remote(directory) else FLUSH_S
        with storage.faults(directory, "opening a TensorBoard event file"):
            directory_check(directory)
            # events.out.tfevents.<time>.<host>.<pid>: the pid keeps a launch within the same second from
            # replacing the file of the one before.
            self._events = EventsWriter(f"{directory.rstrip('/')}/events", f".{os.getpid()}")
            self._events.write_event(Event(wall_time=time.time(), step=first_step,
                                           session_log=SessionLog(status=SessionLog.START)))
            self._events.flush()  # a directory that cannot be written stops the run here, before its first step
        self._rows: queue.SimpleQueue = queue.SimpleQueue()
        self._error: Exception | None = None
        self._told = False
        self._written: dict[str, tuple[int, float]] = {}  # each tag's last step and value
        self._thread = threading.Thread(target=self._drain, name="zerolm-tensorboard", daemon=True)
        self._thread.start()

    def write(self, step: int, values: dict[str, float]) -> None:
        """Hand a row over to the writing thread (raises what an earlier write failed with)."""
        self._raise()
        self._rows.put((step, time.time(), values))

    def flush(self) -> None:
        """Return once every row handed over before is in the file (local) or the object (gs://)."""
        done = threading.Event()
        self._rows.put(done)
        done.wait()
        self._raise()

    def close(self) -> None:
        """Write what is left and close the file (raises a failure not raised before)."""
        self._rows.put(None)
        self._thread.join()
        if self._error is None:
            try:
                with storage.faults(self.directory, "closing a TensorBoard event file"):
                    self._events.close()
            except storage.StorageFault as e:
                self._error = e
        self._raise()

    def _raise(self) -> None:
        if self._error is not None and not self._told:
            self._told = True
            raise self._error

    def _drain(self) -> None:
        """The writing thread: each row an event, the file flushed within `_every` seconds of its first unflushed
        row, and at once when asked (`flush`)."""
        due: float | None = None  # when the rows written since the last flush must be flushed
        while True:
            try:
                item = self._rows.get(timeout=None if due is None else max(due - time.monotonic(), 0))
            except queue.Empty:
                item = False  # due
            if item is None:
                return
            try:
                if self._error is None:
                    with storage.faults(self.directory, "writing TensorBoard events"):
                        if isinstance(item, tuple):
                            self._write_event(*item)
                            if due is None:
                                due = time.monotonic() + self._every
                        if due is not None and (not isinstance(item, tuple) or time.monotonic() >= due):
                            self._events.flush()
                            due = None
            except Exception as e:  # noqa: BLE001  (raised in the loop's thread: `_raise`)
                self._error = e
            finally:
                if isinstance(item, threading.Event):
                    item.set()

    def _write_event(self, step: int, wall_time: float, values: dict[str, float]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        fresh = {tag: value for tag, value in values.items() if self._written.get(tag) != (step, value)}
        if not fresh:
            return
        self._written.update({tag: (step, value) for tag, value in fresh.items()})
        self._events.write_event(Event(wall_time=wall_time, step=step, summary=Summary(
            value=[Summary.Value(tag=tag, simple_value=value) for tag, value in fresh.items()])))
