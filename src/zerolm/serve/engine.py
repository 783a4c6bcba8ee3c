"""The engine: one thread that owns the device and decodes every request's choices together (continuous
batching, zerolm.model.generate).

A request is one `Job` per choice (its prompt, settings, key, stops). The engine admits waiting jobs into
free rows between any two steps (the prompts of one length bucket that wait together prefilled in one call,
`TOGETHER` at a time) and drops a row the step its job ends (its stop sequence, the end-of-text
token, `max_tokens` or the end of the context, or its client gone), so a short answer never waits for a
long one. The batch runs at the fewest rows among `buckets` (1, 8 and 32 by default) that hold the jobs
in it, moved between sizes by `regroup`: one client decodes one row, as `zerolm sample` does. Each job's
text goes to its `sink` as it grows (`Piece`s), from the engine's thread: what a stop sequence could still
begin is held back until the next token decides it, and so is a character whose bytes are not all drawn.

A job draws with its own key, folded by its count of draws: its tokens do not depend on its neighbours.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from zerolm.config.sampling import Sampling
from zerolm.core.errors import UsageError
from zerolm.data.tokenizer import Tokenizer
from zerolm.model.decoder import GPT
from zerolm.model.generate import DRAWS, TOP_LOGPROBS, Arrival, Batch, admit_together, bucket, empty, prefill, regroup, step
from zerolm.serve.completions import FinishReason, Logprobs

BUCKETS = (1, 8, 32)
TOGETHER = 8  # prompts of one length bucket that arrive together are prefilled this many to a call
TOGETHER_TOKENS = 512  # ... up to this length; a longer prompt's prefill is work enough on its own


class Busy(UsageError):
    """More jobs waiting than the engine queues (HTTP 429)."""


class Piece(NamedTuple):
    """A job's next text (and its tokens' log-probabilities, if asked), and why it ended, on its last."""

    choice: int  # the job's index among its request's choices
    text: str
    logprobs: Logprobs | None
    finish_reason: FinishReason = None
    drawn: int = 0  # the job's tokens drawn so far (usage)


class Scored(NamedTuple):
    """One prompt's scores (echo), on the host: each position's log-probability, its most likely tokens and
    theirs (zerolm.model.generate.Scores, one row of it)."""

    logprob_P: np.ndarray
    top_ids_PxK: np.ndarray
    top_logprobs_PxK: np.ndarray


class Failure(NamedTuple):
    """The engine could not finish a job: a bug of zerolm's, or the server stopping (`stopped`)."""

    message: str
    stopped: bool = False


@dataclasses.dataclass(eq=False)
class Job:
    """One choice: its prompt's tokens (and its text, for echo), how its tokens are drawn, its end."""

    index: int
    prompt: np.ndarray
    prompt_text: str
    sampling: Sampling
    key: jax.Array
    max_tokens: int  # at most the context's end
    stop: list[str]
    echo: bool
    logprobs: int | None
    sink: Callable[[Piece | Failure], None]
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # its tokens' text, whole characters (`Engine._decoded`)
    prefix: int = 0  # the tokens decoded again with the new ones, for their context, and where the new ones start
    read: int = 0
    sent: int = 0  # characters of its text sent
    offset: int = 0  # characters of its tokens' text counted (logprobs' text_offset)


class Engine:
    def __init__(self, model: GPT, params: Any, tokenizer: Tokenizer, buckets: tuple[int, ...] = BUCKETS,
                 max_waiting: int = 256):
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.buckets, self.max_waiting = tuple(sorted(buckets)), max_waiting
        self.batch: Batch = empty(model, self.buckets[0])
        self.rows: list[Job | None] = [None] * self.buckets[0]
        self.waiting: collections.deque[Job] = collections.deque()
        self.wake = threading.Condition()
        self.ready = threading.Event()
        self.stopping = False
        # How pieces reach their jobs' sinks: called with each turn's (job, piece) pairs at once, from the engine's
        # thread (an event loop's call_soon_threadsafe: one wake-up a step, however many rows); None: each sink
        # called from the engine's thread.
        self.post: Callable[[list[tuple[Job, Piece | Failure]]], Any] | None = None
        self.outbox: list[tuple[Job, Piece | Failure]] = []
        self.steps = 0  # steps run, the most rows any ran with, prefills run: for tests and the benchmark
        self.peak_rows = 0
        self.prefills = 0
        self.thread = threading.Thread(target=self._run, name="zerolm-engine", daemon=True)

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def start(self) -> None:
        self.thread.start()

    def halt(self) -> None:
        """The engine stops after its turn, without waiting for it: every job in a row or waiting fails
        (`Failure(stopped=True)`)."""
        with self.wake:
            self.stopping = True
            self.wake.notify()

    def stop(self) -> None:
        self.halt()
        self.thread.join()

    def submit(self, jobs: list[Job]) -> None:
        """Jobs queued for rows; Busy if the queue is full."""
        with self.wake:
            if len(self.waiting) + len(jobs) > self.max_waiting:
                raise Busy(f"{len(self.waiting)} choices are waiting for a row (at most {self.max_waiting}); "
                           "try again shortly")
            self.waiting.extend(jobs)
            self.wake.notify()

    @property
    def together(self) -> int:
        """How many prompts one prefill takes, when more than one arrive together."""
        return min(TOGETHER, self.max_rows)

    def warm(self) -> None:
        """Every program a request can run compiled before the server says it is ready (echo's prefills
        aside): each prompt bucket's prefill, alone and (short prompts) `together`, each row count's insert
        of one prompt and of `together` and its step, each regroup the engine makes. A compile under load
        would stall every row for its length."""
        model, params, T = self.model, self.params, self.model.cfg.seq_len

        def arrival(n: int) -> Arrival:
            return Arrival(np.zeros(n, np.int32), Sampling(temperature=0), jax.random.key(0))
        for size in sorted({bucket(n, T) for n in range(1, T)}):
            prompt = arrival(min(size, T - 1))
            for width in {1, self.together if size <= TOGETHER_TOKENS else 1}:
                jax.block_until_ready(prefill(model, params, np.zeros((width, size), np.int32),
                                              np.full(width, prompt.prompt.size, np.int32), echo=False))
        for i, rows in enumerate(self.buckets):
            batch = empty(model, rows)
            for width in {1, self.together if self.together <= rows else 1}:
                # into a new batch, and into one a program returned (an array a program returns has a sharding
                # of its own, which its compiled insert is for)
                for _ in range(2):
                    batch, _ = admit_together(model, params, batch, [0], [arrival(1)], width)
            batch, _ = step(model, params, batch)
            for other in self.buckets[:i] + self.buckets[i + 1:i + 2]:  # shrinking to any, growing to the next
                jax.block_until_ready(regroup(batch, np.zeros(other, np.int32)))

    def _run(self) -> None:
        self.warm()
        self.ready.set()
        while True:
            with self.wake:
                while not self.stopping and not self.waiting and not any(self.rows):
                    self.wake.wait()
                if self.stopping:
                    break
                arrivals = self._arrivals()
            try:
                self._turn(arrivals)
            except Exception:  # a bug of zerolm's: every job in flight fails, the engine goes on
                traceback.print_exc(file=sys.stderr)
                for failed in arrivals + [j for j in self.rows if j is not None]:
                    self._emit(failed, Failure("the server failed decoding this request (see its log)"))
                self.batch, self.rows = empty(self.model, self.buckets[0]), [None] * self.buckets[0]
            self._flush()
        for job in list(self.waiting) + [j for j in self.rows if j is not None]:
            self._emit(job, Failure("the server stopped before this answer finished", stopped=True))
        self._flush()

    def _emit(self, job: Job, event: Piece | Failure) -> None:
        self.outbox.append((job, event))

    def _flush(self) -> None:
        outbox, self.outbox = self.outbox, []
        if outbox and self.post is not None:
            self.post(outbox)
        elif outbox:
            for job, event in outbox:
                job.sink(event)

    def _arrivals(self) -> list[Job]:
        """The waiting jobs that rows can take now (under the lock)."""
        free = self.max_rows - sum(job is not None for job in self.rows)
        taken = []
        while self.waiting and (free > 0 or self.waiting[0].max_tokens == 0):
            job = self.waiting.popleft()
            free -= job.max_tokens > 0
            taken.append(job)
        return taken

    def _turn(self, arrivals: list[Job]) -> None:
        T, groups = self.model.cfg.seq_len, collections.defaultdict(list)
        for job in arrivals:
            if job.cancelled.is_set():
                continue
            if job.max_tokens == 0:  # scores only (echo), or nothing
                self._echo(job, self._scored(job.prompt) if job.echo else None)
                self._emit(job, Piece(job.index, "", None, "length", 0))
            elif job.echo:  # alone: its scores are the whole vocabulary's at each of its positions
                self._admit([job], 1)
            else:
                groups[bucket(job.prompt.size, T)].append(job)
        for size, group in groups.items():
            most = self.together if size <= TOGETHER_TOKENS else 1
            for start in range(0, len(group), most):
                some = group[start:start + most]
                self._admit(some, 1 if len(some) == 1 else most)
        if any(self.rows):
            self.batch, drawn = step(self.model, self.params, self.batch)
            self.steps += DRAWS
            self.peak_rows = max(self.peak_rows, sum(job is not None for job in self.rows))
            drawn = jax.device_get(drawn)
            draws = [jax.tree.map(lambda a, d=d: a[d], drawn) for d in range(DRAWS)]
            for row, held in enumerate(self.rows):
                for each in draws:  # a row's draws past its end are left unread
                    if held is not None and self._advance(held, each, row):
                        self.rows[row] = held = None
        self._fit()

    def _admit(self, jobs: list[Job], width: int) -> None:
        """Jobs of one prompt bucket (an echo's alone) into free rows, prefilled in one call of `width` prompts;
        the batch grown first, a row count at a time, if they do not fit."""
        while sum(job is None for job in self.rows) < len(jobs):
            self._resize(next(b for b in self.buckets if b > len(self.rows)))
        rows = [row for row, held in enumerate(self.rows) if held is None][:len(jobs)]
        arrivals = [Arrival(job.prompt, job.sampling, job.key, job.echo) for job in jobs]
        self.batch, prefilled = admit_together(self.model, self.params, self.batch, rows, arrivals, width)
        self.prefills += 1
        for row, job in zip(rows, jobs, strict=True):
            self.rows[row] = job
        if jobs[0].echo:
            scores = jax.device_get(prefilled.scores)
            for n, job in enumerate(jobs):
                self._echo(job, Scored(scores.logprob_NxP[n], scores.top_ids_NxPxK[n], scores.top_logprobs_NxPxK[n]))

    def _scored(self, prompt: np.ndarray) -> Scored:
        """A prompt of up to seq_len + 1 tokens scored (echo, nothing drawn): the first seq_len by a prefill,
        the one past them by the last position's next-token distribution, as `zerolm eval --tasks` scores a
        window of seq_len + 1 tokens."""
        T = self.model.cfg.seq_len
        within = prompt[:T]
        prompt_1xP = np.zeros((1, bucket(within.size, T)), np.int32)
        prompt_1xP[0, :within.size] = within
        prefilled = prefill(self.model, self.params, prompt_1xP, np.asarray([within.size], np.int32), echo=True)
        scores, logits_V = jax.device_get((prefilled.scores, prefilled.logits_NxV[0]))
        scored = Scored(scores.logprob_NxP[0], scores.top_ids_NxPxK[0], scores.top_logprobs_NxPxK[0])
        if prompt.size <= T:
            return scored
        logp_V = logits_V - np.logaddexp.reduce(logits_V)
        top_K = np.argsort(-logp_V)[:TOP_LOGPROBS]
        return Scored(np.append(scored.logprob_P, logp_V[prompt[T]]), np.vstack([scored.top_ids_PxK, top_K]),
                      np.vstack([scored.top_logprobs_PxK, logp_V[top_K]]))

    def _echo(self, job: Job, scored: Scored | None) -> None:
        """The prompt's text first, with its tokens' scores (the first has none: nothing before it)."""
        logprobs = None
        if job.logprobs is not None and scored is not None:
            logprobs = self._logprobs(job, job.prompt, *scored)
            logprobs.token_logprobs[0] = logprobs.top_logprobs[0] = None
        self._emit(job, Piece(job.index, job.prompt_text, logprobs))
        job.sent, job.offset = 0, len(job.prompt_text)

    def _logprobs(self, job: Job, ids, logprob, top_ids, top_logprobs) -> Logprobs:
        decode = self.tokenizer.decode
        out = Logprobs()
        for i, token in enumerate(ids):
            text = decode([int(token)])
            out.tokens.append(text)
            out.token_logprobs.append(float(logprob[i]))
            out.top_logprobs.append({decode([int(t)]): float(lp) for t, lp in
                                     zip(top_ids[i][:max(job.logprobs or 0, 1)], top_logprobs[i], strict=False)})
            out.text_offset.append(job.offset)
            job.offset += len(text)
        return out

    def _advance(self, job: Job, drawn, row: int) -> bool:
        """The job's token from this step; whether the job ended (its row is free)."""
        if job.cancelled.is_set():
            return True
        token = int(drawn.token_R[row])
        if token == self.tokenizer.eot_id:
            self._emit(job, Piece(job.index, self._text(job, final=True)[0], None, "stop", len(job.tokens) + 1))
            return True
        job.tokens.append(token)
        logprobs = None
        if job.logprobs is not None:
            logprobs = self._logprobs(job, [token], drawn.logprob_R[row:row + 1], drawn.top_ids_RxN[row:row + 1],
                                      drawn.top_logprobs_RxN[row:row + 1])
        text, stopped = self._text(job, final=len(job.tokens) >= job.max_tokens)
        finish: FinishReason = "stop" if stopped else ("length" if len(job.tokens) >= job.max_tokens else None)
        self._emit(job, Piece(job.index, text, logprobs, finish, len(job.tokens)))
        return finish is not None

    def _decoded(self, job: Job, final: bool) -> str:
        """The job's text, grown by its new tokens' once their characters are whole: the new tokens decoded with
        the few before them (vLLM's incremental detokenizing), not the whole text again each token."""
        decode = self.tokenizer.decode
        before, now = decode(job.tokens[job.prefix:job.read]), decode(job.tokens[job.prefix:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            job.text += now[len(before):]
            job.prefix, job.read = job.read, len(job.tokens)
        return job.text

    def _text(self, job: Job, final: bool) -> tuple[str, bool]:
        """The job's text not yet sent that no stop sequence could still claim; whether a stop sequence ended it."""
        text = self._decoded(job, final)
        longest = max((len(s) for s in job.stop), default=0)
        hits = [i for i in (text.find(s, max(0, job.sent - longest)) for s in job.stop) if i >= 0]
        if hits:
            end, stopped = min(hits), True
        elif final:
            end, stopped = len(text), False
        else:
            end, stopped = len(text), False
            while end > job.sent and text[end - 1] == "\ufffd":  # a character whose bytes are not all drawn
                end -= 1
            held = max((k for s in job.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            end = max(job.sent, min(end, len(text) - held))
        out = text[job.sent:end]
        job.sent = max(job.sent, end)
        return out, stopped

    def _resize(self, rows: int) -> None:
        """The jobs held moved into a batch of `rows` rows (in their order)."""
        held = [(row, job) for row, job in enumerate(self.rows) if job is not None]
        index = np.zeros(rows, np.int32)
        index[:len(held)] = [row for row, _ in held]
        self.batch = regroup(self.batch, index)
        self.rows = [job for _, job in held] + [None] * (rows - len(held))

    def _fit(self) -> None:
        """The fewest rows that hold the jobs, once nothing waits."""
        held = sum(job is not None for job in self.rows)
        if self.waiting or held == 0 and len(self.rows) == self.buckets[0]:
            return
        fits = next(b for b in self.buckets if b >= held)
        if fits < len(self.rows):
            self._resize(fits)
