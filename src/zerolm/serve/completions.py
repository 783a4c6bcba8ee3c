"""OpenAI's legacy completions API (`POST /v1/completions`) as `zerolm serve` reads and writes it: the request
checked field by field (a bad one is a `RequestError` naming it, as OpenAI's 400 `param` does), and the
response, whole or as stream chunks.

The fields OpenAI defines are read as OpenAI defines them (defaults included: `max_tokens` 16, `temperature`
1), of their JSON types only (no `"5"` for 5, no `true` for 1); `top_k`, `typical_p` and
`repetition_penalty` are read beside them, as vLLM reads them. A field OpenAI defines that zerolm does not
implement is accepted only at its no-op value (`presence_penalty: 0`, `best_of` equal to `n`, ...), and
refused otherwise, naming it; an unknown field is refused.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, ValidationError

from zerolm.config.sampling import Sampling, SamplingError, checked
from zerolm.config.section import problem
from zerolm.core.errors import UsageError
from zerolm.model.generate import TOP_LOGPROBS

MAX_STOP = 4  # stop sequences a request may give (OpenAI's limit)
SEEDS = (-(1 << 63), (1 << 63) - 1)  # a seed is a 64-bit integer (what jax.random.key takes)
SURROGATE = re.compile("[\ud800-\udfff]")

Prompt = str | list[str] | list[int] | list[list[int]]


class RequestError(UsageError):
    """A request's mistake: HTTP `status`, the field at fault (`param`), OpenAI's error `type`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


class _Fields(BaseModel):
    # strict, as OpenAI reads them: `true` is not a number, "5" not an integer, "yes" not a boolean (an integer
    # is a number)
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Prompt
    model: str | None = None
    max_tokens: int | None = 16  # None: to the end of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    logprobs: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # OpenAI's, accepted at their no-op values only
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None


NO_OP = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}, "suffix": None}


class Completion(BaseModel):
    """A checked request: its prompts, as texts or token ids."""

    prompts: list[str | list[int]]
    model: str | None
    max_tokens: int | None
    sampling: Sampling
    n: int
    stream: bool
    usage_in_stream: bool
    logprobs: int | None
    echo: bool
    stop: list[str]


def decoded(body: bytes) -> Any:
    """A request's JSON body; RequestError for one that is not JSON (an integer of more than Python's 4300
    digits included), nested too deeply to read, or holding a lone surrogate (JSON's "\\ud800" escape is not
    text: no tokenizer, and no UTF-8 answer, can take it), naming the field that holds it."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise RequestError("the request body is nested too deeply to read") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and an integer past Python's digit limit
        raise RequestError(f"the request body is not JSON: {str(e).split('; use sys.')[0]}") from None
    for field, held in (value.items() if isinstance(value, dict) else [(None, value)]):
        if _surrogate(field) or _surrogate(held):
            name = field if field is not None and not _surrogate(field) else None
            raise RequestError(f"{name or 'the body'}: holds a lone surrogate (a \\ud800-\\udfff escape that is not "
                               "half of a pair), which is not text", name)
    return value


def _surrogate(value: Any) -> bool:
    """Whether any string in the JSON value (its keys included) holds a lone surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str) and not item.isascii() and SURROGATE.search(item):
            return True
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
    return False


def parse(body: Any, max_choices: int) -> Completion:
    """A request's JSON body, checked; RequestError naming the first field at fault."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        fields = _Fields.model_validate(body)
    except ValidationError as error:
        key, message = problem(error)
        if message.startswith("Extra inputs"):
            message = "not a field of the completions request"
        elif key == "prompt":
            message = "must be a string, a list of strings, a list of token ids or a list of lists of token ids"
        raise RequestError(f"{key}: {message}", key.split(".")[0]) from None
    _check(fields, max_choices)
    stop = [fields.stop] if isinstance(fields.stop, str) else list(fields.stop or [])
    if len(stop) > MAX_STOP or any(s == "" for s in stop):
        raise RequestError(f"stop: at most {MAX_STOP} sequences, none empty", "stop")
    settings = {k: getattr(fields, k) for k in Sampling.model_fields}
    try:
        sampling = checked(settings)
    except SamplingError as error:
        raise RequestError(str(error), error.field) from None
    prompt = fields.prompt
    prompts = cast(list[str | list[int]], [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
                   else prompt)
    if not prompts:
        raise RequestError("prompt: empty list", "prompt")
    return Completion(prompts=prompts, model=fields.model, max_tokens=fields.max_tokens, sampling=sampling,
                      n=fields.n, stream=fields.stream, usage_in_stream=bool((fields.stream_options or {})
                                                                             .get("include_usage")),
                      logprobs=fields.logprobs, echo=fields.echo, stop=stop)


def _check(fields: _Fields, max_choices: int) -> None:
    """The checks no field's type makes."""
    for name, value in NO_OP.items():
        if getattr(fields, name) not in (value, None):
            raise RequestError(f"{name}: not supported (only {value!r})", name)
    if fields.best_of is not None and fields.best_of != fields.n:
        raise RequestError(f"best_of: not supported (only equal to n, {fields.n})", "best_of")
    if not 1 <= fields.n <= max_choices:
        raise RequestError(f"n: {fields.n} must be in [1, {max_choices}]", "n")
    if fields.max_tokens is not None and fields.max_tokens < 0:
        raise RequestError(f"max_tokens: {fields.max_tokens} must be >= 0", "max_tokens")
    if fields.logprobs is not None and not 0 <= fields.logprobs <= TOP_LOGPROBS:
        raise RequestError(f"logprobs: {fields.logprobs} must be in [0, {TOP_LOGPROBS}]", "logprobs")
    if fields.seed is not None and not SEEDS[0] <= fields.seed <= SEEDS[1]:
        raise RequestError(f"seed: {fields.seed} is not a 64-bit integer (in [-2**63, 2**63 - 1])", "seed")


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


def envelope(cid: str, model: str, choices: list[dict], usage: dict | None = None) -> dict:
    """A response, or one stream chunk: OpenAI's `text_completion` object."""
    out = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Logprobs(BaseModel):
    """A choice's `logprobs`: its tokens (as text), each one's log-probability under the model, the most likely
    tokens at each place with theirs, and where each token's text starts in the choice's text."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []

    def extend(self, other: Logprobs, offset: int) -> None:
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += [offset + o for o in other.text_offset]


FinishReason = Literal["stop", "length"] | None
