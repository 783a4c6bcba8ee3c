"""The HTTP face of `zerolm serve`: a Starlette app over the engine, run by uvicorn.

- `GET /`: the page (a prompt, the sampling settings, the text streamed as it is drawn);
- `POST /v1/completions`: OpenAI's completions (zerolm.serve.completions), whole or streamed as server-sent
  events; `GET /v1/models`: the one model served;
- `GET /health`: 200 once the model is loaded and its first programs compiled;
- `GET /tokenizer_info`, `POST /tokenize`, `POST /detokenize`: the model's tokenizer, as vLLM serves it (what
  lm-evaluation-harness's `local-completions` reads with `tokenizer_backend=remote`).

A mistake in a request is a 4xx JSON error naming its field (OpenAI's shape); a full queue is 429. A client
that goes away frees its rows at the next step. The event loop only moves bytes: a request's body is read up
to a limit (zerolm.serve.guard), and decoded, checked and tokenized on a thread, so no request holds up
another's answer or `/health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

import jax
import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from zerolm.serve import completions as api
from zerolm.serve.engine import Busy, Engine, Failure, Job, Piece
from zerolm.serve.guard import Guard, body_limit

# Python hands the GIL between busy threads every 5 ms by default: the engine's thread, between two steps, would
# wait that long for the HTTP thread each time it needs it (a step of a small model takes under a millisecond).
SWITCH_INTERVAL_S = 1e-4
CUT_SECONDS = 5.0  # after a stop's grace, how long the answers cut have to send their last event
POLL_SECONDS = 0.5  # how often a whole (not streamed) answer's wait looks whether its client is still there


class Served:
    """What the app serves: the engine, the model's name, its context, the most tokens a choice may ask for."""

    def __init__(self, engine: Engine, name: str, max_tokens: int | None = None):
        self.engine, self.name = engine, name
        self.context = engine.model.cfg.seq_len
        self.max_tokens = max_tokens or self.context
        self.tokenizer = engine.tokenizer

    def jobs(self, request: api.Completion, sink: Callable[[Piece | Failure], None]) -> tuple[list[Job], int]:
        """One job per prompt and choice; the prompts' tokens counted (usage). Run on a thread: it tokenizes."""
        if request.max_tokens is not None and request.max_tokens > self.max_tokens:
            raise api.RequestError(f"max_tokens: {request.max_tokens} is past this server's limit of {self.max_tokens}",
                                   "max_tokens")
        if len(request.prompts) * request.n > self.engine.max_waiting:
            raise api.RequestError(f"prompt: {len(request.prompts)} prompts (n={request.n} choices each) are more "
                                   f"choices than this server queues ({self.engine.max_waiting}: --max-waiting)",
                                   "prompt")
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(31)
        base, jobs, counted = jax.random.key(seed), [], 0
        for p, prompt in enumerate(request.prompts):
            ids, text = self._prompt(prompt, scoring=request.max_tokens == 0)
            counted += ids.size
            room = max(0, self.context - ids.size)
            max_tokens = min(room, self.max_tokens if request.max_tokens is None else request.max_tokens)
            for c in range(request.n):
                index = p * request.n + c
                key = base if index == 0 else jax.random.fold_in(base, index)
                jobs.append(Job(index, ids, text, request.sampling, key, max_tokens, request.stop, request.echo,
                                request.logprobs, sink))
        return jobs, counted

    def _prompt(self, prompt: str | list[int], scoring: bool) -> tuple[np.ndarray, str]:
        """A prompt's tokens and text. It may have context - 1 tokens (a token is drawn after them, from the
        model's last position), or context + 1 when nothing is drawn (`scoring`, max_tokens 0: its last token
        is scored from the last position's distribution), the windows `zerolm eval --tasks` scores."""
        longest, most = self.tokenizer.max_token_chars, self.context + 1 if scoring else self.context - 1
        if isinstance(prompt, str) and longest is not None and len(prompt) > longest * most:
            # more tokens than the context holds, however it is split: refused without tokenizing it
            raise api.RequestError(f"prompt: {len(prompt)} characters, more than the model's context of "
                                   f"{self.context} tokens holds (a prompt may have at most {most} "
                                   f"tokens, of at most {longest} characters each)", "prompt")
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            if prompt and not (0 <= min(prompt) and max(prompt) < self.tokenizer.vocab_size):
                raise api.RequestError(f"prompt: token ids must be in [0, {self.tokenizer.vocab_size}) "
                                       f"(the tokenizer's vocabulary)", "prompt")
            ids = np.asarray(prompt, np.int64)
            text = self.tokenizer.decode(ids)
        if ids.size == 0:  # a new document
            ids = np.asarray([self.tokenizer.eot_id])
        if ids.size > most:
            raise api.RequestError(
                f"prompt: {ids.size} tokens, but the model's context is {self.context} tokens, so a prompt may have "
                f"at most {self.context - 1} ({self.context + 1} to score it with echo and max_tokens 0). "
                f"lm-evaluation-harness's local-completions sends max_length - 1 tokens and asks for one more: "
                f"pass it max_length={self.context} (at most)", "prompt")
        return ids.astype(np.int32), text


def _error(error: api.RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _body(request: Request) -> Any:
    return await run_in_threadpool(api.decoded, await request.body())


def _deliver(items: list[tuple[Job, Piece | Failure]]) -> None:
    for job, event in items:
        job.sink(event)


class Answer:
    """One request's choices, assembled from the engine's pieces. Made on a thread (`opened`): its prompts are
    tokenized."""

    def __init__(self, served: Served, request: api.Completion, loop: asyncio.AbstractEventLoop):
        self.served, self.request = served, request
        self.queue: asyncio.Queue[Piece | Failure] = asyncio.Queue()
        if served.engine.post is None:  # each step's pieces, delivered on this loop at once
            def post(items: list[tuple[Job, Piece | Failure]]) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: the server is stopping
                    loop.call_soon_threadsafe(_deliver, items)
            served.engine.post = post
        self.jobs, self.prompt_tokens = served.jobs(request, self.queue.put_nowait)
        self.open = len(self.jobs)
        self.tokens = [0] * len(self.jobs)

    @classmethod
    async def opened(cls, served: Served, body: bytes) -> Answer:
        """A request's body decoded, checked and tokenized off the event loop (a long prompt takes a while)."""
        def open_(loop: asyncio.AbstractEventLoop) -> Answer:
            parsed = api.parse(api.decoded(body), served.engine.max_rows)
            if parsed.model not in (None, served.name):
                raise api.RequestError(f"model: {parsed.model!r} is not served here (this server serves "
                                       f"{served.name!r})", "model", 404, "model_not_found")
            return cls(served, parsed, loop)
        return await run_in_threadpool(open_, asyncio.get_running_loop())

    def start(self) -> None:
        try:
            self.served.engine.submit(self.jobs)
        except Busy as e:
            raise api.RequestError(str(e), None, 429, "rate_limit_exceeded") from None

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancelled.set()

    async def next(self) -> Piece:
        return self._taken(await self.queue.get())

    def more(self) -> list[Piece]:
        """The pieces already queued, without waiting: a streamed answer sends them together."""
        out = []
        while not self.queue.empty():
            out.append(self._taken(self.queue.get_nowait()))
        return out

    def _taken(self, event: Piece | Failure) -> Piece:
        if isinstance(event, Failure) and event.stopped:  # the server's grace for answers in flight ran out
            print(f"stopping: cut a {'streamed' if self.request.stream else 'whole'} answer in flight after "
                  f"{sum(self.tokens)} tokens", file=sys.stderr, flush=True)
            raise api.RequestError(event.message, None, 503, "server_error")
        if isinstance(event, Failure):
            raise api.RequestError(event.message, None, 500, "server_error")
        self.tokens[event.choice] = event.drawn
        self.open -= event.finish_reason is not None
        return event

    def usage(self) -> dict:
        return api.usage(self.prompt_tokens, sum(self.tokens))

    def choice(self, piece: Piece) -> dict:
        logprobs = piece.logprobs.model_dump() if piece.logprobs is not None else None
        if logprobs is None and self.request.logprobs is not None:
            logprobs = api.Logprobs().model_dump()
        return {"index": piece.choice, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish_reason}


async def _whole(request: Request, answer: Answer) -> Response:
    texts = [""] * len(answer.jobs)
    logprobs = [api.Logprobs() for _ in answer.jobs]
    finish: list[Any] = [None] * len(answer.jobs)
    while answer.open:
        try:
            piece = await asyncio.wait_for(answer.next(), POLL_SECONDS)
        except TimeoutError:
            if await request.is_disconnected():
                answer.cancel()
                return Response(status_code=499)
            continue
        if piece.logprobs is not None:
            logprobs[piece.choice].extend(piece.logprobs, 0)
        texts[piece.choice] += piece.text
        finish[piece.choice] = piece.finish_reason or finish[piece.choice]
    choices = [{"index": i, "text": texts[i], "finish_reason": finish[i],
                "logprobs": logprobs[i].model_dump() if answer.request.logprobs is not None else None}
               for i in range(len(texts))]
    return JSONResponse(api.envelope(api.completion_id(), answer.served.name, choices, answer.usage()))


def _joined(pieces: list[Piece]) -> list[Piece]:
    """A choice's consecutive pieces as one (those without log-probabilities): a client that reads slower than
    the engine draws gets fewer, longer chunks."""
    out: list[Piece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if last is not None and last.choice == piece.choice and last.logprobs is None and piece.logprobs is None \
                and last.finish_reason is None:
            out[-1] = piece._replace(text=last.text + piece.text)
        else:
            out.append(piece)
    return out


def _streamed(answer: Answer) -> StreamingResponse:
    cid, name = api.completion_id(), answer.served.name

    async def events() -> AsyncIterator[str]:
        try:
            while answer.open:
                try:
                    pieces = _joined([await answer.next(), *answer.more()])
                except api.RequestError as e:
                    yield f"data: {json.dumps(e.body())}\n\n"
                    return
                yield "".join(f"data: {json.dumps(api.envelope(cid, name, [answer.choice(piece)]))}\n\n"
                              for piece in pieces if piece.text or piece.finish_reason or piece.logprobs is not None)
            if answer.request.usage_in_stream:
                yield f"data: {json.dumps(api.envelope(cid, name, [], answer.usage()))}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # done, or the client went away: its rows are freed at the next step
            answer.cancel()
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _served(request: Request) -> Served:
    return request.app.state.served


async def _completions(request: Request) -> Response:
    try:
        answer = await Answer.opened(_served(request), await request.body())
        answer.start()
    except api.RequestError as e:
        return _error(e)
    if answer.request.stream:
        return _streamed(answer)
    try:
        return await _whole(request, answer)
    except api.RequestError as e:
        return _error(e)
    finally:
        answer.cancel()


async def _models(request: Request) -> Response:
    served = _served(request)
    return JSONResponse({"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                                     "owned_by": "zerolm", "max_model_len": served.context}]})


async def _health(request: Request) -> Response:
    """200 once the engine is ready, with its rows in use, its queue, its steps, the most rows a step ran and
    its prefills (calls: prompts that arrive together share one)."""
    engine = _served(request).engine
    ready = engine.ready.is_set() and engine.thread.is_alive()
    return JSONResponse({"status": "ok" if ready else "starting", "rows": sum(j is not None for j in engine.rows),
                         "waiting": len(engine.waiting), "steps": engine.steps, "peak_rows": engine.peak_rows,
                         "prefills": engine.prefills}, status_code=200 if ready else 503)


async def _page(request: Request) -> Response:
    served = _served(request)
    return HTMLResponse(resources.files("zerolm.serve").joinpath("page.html").read_text()
                        .replace("{{model}}", served.name).replace("{{context}}", str(served.context)))


async def _tokenizer_info(request: Request) -> Response:
    served = _served(request)
    tok = served.tokenizer
    return JSONResponse({"eos_token": tok.eot_text, "bos_token": None, "pad_token": None,
                         "model_max_length": served.context, "vocab_size": tok.vocab_size})


async def _tokenize(request: Request) -> Response:
    try:
        body = await _body(request)
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise api.RequestError("prompt: a string to tokenize", "prompt")
    except api.RequestError as e:
        return _error(e)
    served = _served(request)
    tokens = (await run_in_threadpool(served.tokenizer.encode, body["prompt"])).tolist()
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": served.context})


async def _detokenize(request: Request) -> Response:
    tokenizer = _served(request).tokenizer
    try:
        body = await _body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < tokenizer.vocab_size
                                                    for t in tokens):
            raise api.RequestError("tokens: a list of token ids of the tokenizer's vocabulary", "tokens")
    except api.RequestError as e:
        return _error(e)
    return JSONResponse({"prompt": tokenizer.decode(tokens)})


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(api.RequestError(exc.detail, None, exc.status_code, "not_found_error"))


ROUTES = [Route("/", _page), Route("/health", _health), Route("/v1/models", _models),
          Route("/v1/completions", _completions, methods=["POST"]), Route("/tokenizer_info", _tokenizer_info),
          Route("/tokenize", _tokenize, methods=["POST"]), Route("/detokenize", _detokenize, methods=["POST"])]


def create_app(served: Served, max_body_bytes: int | None = None, host: str = "127.0.0.1",
               allowed: frozenset[str] = frozenset()) -> ASGIApp:
    """The app: its routes behind the guard (zerolm.serve.guard: a body over `max_body_bytes`, default
    `body_limit`, is 413; the server's names are `host`'s, its origins its own and `allowed`)."""
    app = Starlette(routes=ROUTES, exception_handlers={HTTPException: _http_error})
    app.state.served = served
    return Guard(app, max_body_bytes or body_limit(served.context), host, allowed)


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it listens, and stopping the engine once a stop's grace is over: each
    answer still in flight then ends with an error its client reads (a stream's last event), not a cut
    connection."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[], None], grace: float,
                 on_grace_end: Callable[[], None]):
        super().__init__(config)
        self.on_listening, self.grace, self.on_grace_end = on_listening, grace, on_grace_end

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace_end = asyncio.get_running_loop().call_later(self.grace, self.on_grace_end)
        try:
            await super().shutdown(sockets)
        finally:
            grace_end.cancel()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_listening()


def run(served: Served, sock: socket.socket, on_listening: Callable[[], None], app: ASGIApp,
        grace: float) -> None:
    """Serves `app` (create_app's, for `served`) on `sock` until SIGTERM or Ctrl-C: then it stops taking
    connections, lets the answers in flight finish (`grace` seconds at most; then each ends with an error)
    and stops the engine."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=math.ceil(grace + CUT_SECONDS))
    # uvicorn raises the signal that stopped it again once it has stopped: a stop asked for is a clean exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        _Server(config, on_listening, grace, served.engine.halt).run(sockets=[sock])
    finally:
        served.engine.stop()
