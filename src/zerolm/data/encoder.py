"""Tokenizing a source's chunks for `zerolm prepare`: in this process, or in worker processes started once,
taken back in order (the output is the same byte for byte whatever their number)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np

from zerolm.core.interrupts import die_with_parent
from zerolm.data import sources
from zerolm.data.ngrams import Matcher, NgramSet
from zerolm.data.packing import Encoded
from zerolm.data.sources import Skipped
from zerolm.data.tokenizer import Tokenizer, from_bytes


class Encoder:
    """Tokenizes a source's chunks in order: in this process (workers = 1, the tokenizer's own threads),
    or in `workers` processes started once (spawned: a forked child would inherit the tokenizer's threads,
    and JAX's inside `zerolm train`), with at most two chunks each in flight, taken back in order. A
    chunk's first bad record raises, unless `skipped` counts them."""

    def __init__(self, tok: Tokenizer, workers: int, text_field: str, decontaminate: NgramSet | None = None):
        """`decontaminate`: each document is marked dirty if it shares one of these n-grams."""
        self.tok, self.workers, self.text_field = tok, workers, text_field
        self.matcher = Matcher(decontaminate) if decontaminate is not None else None
        self.pool = None
        if workers > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_worker_init,
                                            initargs=(tok.filename, tok.file_bytes, text_field, os.getpid(),
                                                      decontaminate))

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def encode(self, chunks: Iterator[sources.Chunk], skipped: Skipped | None) -> Iterator[Encoded]:
        for encoded in self._encoded(chunks):
            sources.reject(encoded.bad, skipped)
            yield encoded

    def _encoded(self, chunks: Iterator[sources.Chunk]) -> Iterator[Encoded]:
        if self.pool is None:
            for chunk in chunks:
                yield _encode(chunk, self.tok, self.text_field, self.matcher)
            return
        import collections

        pending: collections.deque = collections.deque()
        try:
            for chunk in chunks:
                pending.append(self.pool.submit(_worker_encode, chunk))
                if len(pending) >= 2 * self.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def _encode(chunk: sources.Chunk, tok: Tokenizer, text_field: str, matcher: Matcher | None = None) -> Encoded:
    docs = sources.documents(chunk, text_field)
    texts = [d for d in docs if isinstance(d, str)]
    ids = tok.encode_batch(texts)
    lengths = np.array([len(x) + 1 for x in ids], np.int64)
    tokens = np.full(int(lengths.sum()), tok.eot_id, np.int32)
    at = 0
    for x in ids:
        tokens[at:at + len(x)] = x
        at += len(x) + 1
    return Encoded(tokens, lengths, [d for d in docs if isinstance(d, sources.SourceError)], chunk.stored,
                   matcher.dirty(texts) if matcher is not None else None)


_WORKER: dict[str, Any] = {}


def _worker_init(name: str, data: bytes, text_field: str, parent: int, decontaminate: NgramSet | None) -> None:
    """A worker process: one thread of the tokenizer's (the processes are the parallelism), Ctrl-C left
    to the parent, which stops the pool, and gone when the parent is (kill -9 included, also before the
    worker was ready)."""
    die_with_parent()
    if os.getppid() != parent:  # the parent died while this worker started
        os._exit(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER.update(tok=from_bytes(name, data), text_field=text_field,
                   matcher=Matcher(decontaminate) if decontaminate is not None else None)


def _worker_encode(chunk: sources.Chunk) -> Encoded:
    return _encode(chunk, _WORKER["tok"], _WORKER["text_field"], _WORKER["matcher"])
