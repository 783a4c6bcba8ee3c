"""Staged context (`train.context_stages`, `train.context_rows`): which context a step trains at, and how a
prepared sample of model.seq_len + 1 tokens is cut to it.

A run with stages trains its first stage's `steps` at that stage's `seq_len` L, then the next stage's, then
model.seq_len T for the rest. Two ways to cut a sample to L:
- `truncate` (the seed project's): its first L + 1 tokens; sequences per step are fixed, tokens per step are
  G · L, and the rest of each sample is never trained on.
- `split`: T / L rows of L + 1 tokens, row r being tokens r·L .. r·L + L (consecutive rows share one token,
  the last target of one being the first input of the next, as in the whole sample); every token is
  trained on, tokens per step stay G · T, and a device's micro-batch holds T / L times as many rows.

The data a step reads is the same whatever its context (zerolm.data.order: a pure function of the step),
so a resume at any step, inside a stage or after, reads and cuts exactly what the uninterrupted run did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Context:
    """A context a run trains at: rows of `seq_len` + 1 tokens, `rows` of them per prepared sample, over steps
    `first` .. `last` (None: to the end of the run)."""

    seq_len: int
    rows: int
    first: int
    last: int | None

    @property
    def tokens_per_sample(self) -> int:
        """The tokens a sample trains on (each row's targets)."""
        return self.seq_len * self.rows


class ContextPlan:
    """The contexts of a run, by step (`stages`: (steps, seq_len) each, as train.context_stages; `rows`:
    train.context_rows; `seq_len`: model.seq_len)."""

    def __init__(self, stages: Sequence[tuple[int, int]], rows: str, seq_len: int):
        self.seq_len, self.mode = seq_len, rows
        self.contexts: list[Context] = []
        first = 1
        for steps, length in stages:
            per_sample = seq_len // length if rows == "split" else 1
            self.contexts.append(Context(length, per_sample, first, first + steps - 1))
            first += steps
        self.contexts.append(Context(seq_len, 1, first, None))

    @classmethod
    def of(cls, train, seq_len: int) -> ContextPlan:
        """The plan of a config's train section (train.context_stages, train.context_rows) and model.seq_len."""
        return cls([(s.steps, s.seq_len) for s in train.context_stages], train.context_rows, seq_len)

    @property
    def staged(self) -> bool:
        return len(self.contexts) > 1

    def at(self, step: int) -> Context:
        """The context step `step` (counted from 1) trains at."""
        return next(c for c in self.contexts if c.last is None or step <= c.last)

    def cut(self, rows_AxMxT1: np.ndarray, context: Context) -> np.ndarray:
        """(A, M, T + 1) prepared samples -> (A, M · rows, L + 1) rows of `context` (the full context: as they are)."""
        if context.seq_len == self.seq_len:
            return rows_AxMxT1
        L = context.seq_len
        if self.mode == "truncate":
            return rows_AxMxT1[..., :L + 1]
        A, M, _ = rows_AxMxT1.shape
        windows_RxL1 = np.arange(context.rows)[:, None] * L + np.arange(L + 1)[None, :]
        return rows_AxMxT1[..., windows_RxL1].reshape(A, M * context.rows, L + 1)

    def tokens_seen(self, step: int, global_batch: int) -> int:
        """Tokens trained on in steps 1 .. `step` (each step's G samples, at its context)."""
        total = 0
        for c in self.contexts:
            if step < c.first:
                break
            steps = (step if c.last is None else min(step, c.last)) - c.first + 1
            total += steps * global_batch * c.tokens_per_sample
        return total
