"""What a request must be before `zerolm serve`'s app reads it (an ASGI middleware, `Guard`): a body of at
most `max_body_bytes` (413, OpenAI's JSON error naming the limit), refused by its `Content-Length`, or as
soon as a body sent without one passes the limit, so a huge body is never read whole. A bug of zerolm's
that escapes an endpoint is one line in the log and a JSON 500, not a traceback and a plain-text page.
"""

from __future__ import annotations

import sys
import traceback

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zerolm.serve.completions import RequestError


def body_limit(context: int) -> int:
    """The default largest request body: a context of text many times over (64 bytes a token: a prompt's
    text as JSON escapes, or its token ids), and 1 MiB at least."""
    return max(1 << 20, 64 * context)


class Guard:
    """The checks above, in front of `app`."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    def _refusal(self, scope: Scope) -> RequestError | None:
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> RequestError:
        return RequestError(f"the request body is larger than this server's limit of {self.max_body_bytes} "
                            "bytes (zerolm serve --max-body-bytes)", None, 413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await _respond(refusal, scope, receive, send)
            return
        received, started = 0, False

        async def receiving() -> Message:  # a body without Content-Length is refused as it passes the limit
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise self._too_large()
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receiving, sending)
        except RequestError as error:  # the body's limit, raised while an endpoint read the body
            if not started:
                await _respond(error, scope, receive, send)
        except Exception as error:  # a bug of zerolm's: one line in the log, a JSON 500 to the client
            where = traceback.extract_tb(error.__traceback__)[-1]
            print(f"error: {scope['method']} {scope['path']}: {type(error).__name__}: {error} "
                  f"({where.filename}:{where.lineno})", file=sys.stderr, flush=True)
            if not started:
                await _respond(RequestError("the server failed answering this request (see its log)", None, 500,
                                            "server_error"), scope, receive, send)


async def _respond(error: RequestError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
