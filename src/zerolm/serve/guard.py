"""What a request must be before `zerolm serve`'s app reads it (an ASGI middleware, `Guard`):

- its `Host` one of the server's own names: an address (an address cannot be rebound), `localhost`, this
  machine's name, `--host`, or an allowed origin's host. A web page cannot reach a server on the visitor's
  machine by pointing a name of its own at 127.0.0.1 (DNS rebinding);
- its `Origin`, where a browser sends one, the server's own, or one the user allowed (`--allow-origin`,
  answered with the CORS headers a browser needs to read the answer): another site's page cannot use the
  model through its visitor's browser;
- a body only as JSON (`Content-Type: application/json`), which a browser does not send to another site
  without asking first (a preflight, answered for allowed origins only), and of at most `max_body_bytes`
  (413, OpenAI's JSON error naming the limit): refused by its `Content-Length`, or as soon as a body sent
  without one passes the limit, so a huge body is never read whole.

Each refusal is OpenAI's JSON error. A bug of zerolm's that escapes an endpoint is one line in the log and
a JSON 500, not a traceback and a plain-text page.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import traceback
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zerolm.core.errors import UsageError
from zerolm.serve.completions import RequestError

ANY = "*"  # --allow-origin's every origin (and every Host)
BODY_METHODS = ("POST", "PUT", "PATCH")


def body_limit(context: int) -> int:
    """The default largest request body: a context of text many times over (64 bytes a token: a prompt's
    text as JSON escapes, or its token ids), and 1 MiB at least."""
    return max(1 << 20, 64 * context)


class OriginError(UsageError):
    """An `--allow-origin` value that is not an origin (one line naming the flag)."""


def origins(values: Iterable[str]) -> frozenset[str]:
    """`--allow-origin`'s values (the flag repeated, or a comma-separated list): origins as a browser sends
    them (`scheme://host[:port]`), or `*`."""
    out = set()
    for value in (v.strip() for each in values for v in each.split(",") if v.strip()):
        parts = urlsplit(value)
        if value != ANY and (parts.scheme not in ("http", "https") or not parts.hostname
                             or parts.path.strip("/") or parts.query or parts.fragment):
            raise OriginError(f"--allow-origin: {value!r} is not an origin (scheme://host[:port], as "
                              "http://localhost:3000) or *")
        out.add(value if value == ANY else f"{parts.scheme}://{parts.netloc}".lower())
    return frozenset(out)


def _hostname(host: str) -> str:
    """A Host header's name, without its port ('[::1]:8000' -> '::1')."""
    if host.startswith("["):
        return host[1:host.find("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class Guard:
    """The checks above, in front of `app`, for a server listening on `host` (an address or a name) that
    allows the origins `allowed` (`ANY`: every origin, and every Host)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, host: str = "127.0.0.1",
                 allowed: frozenset[str] = frozenset()):
        self.max_body_bytes = max_body_bytes
        self.any = ANY in allowed
        self.origins = allowed - {ANY}
        self.names = {"localhost", host.lower(), socket.gethostname().lower(), socket.getfqdn().lower(),
                      *(urlsplit(o).hostname or "" for o in self.origins)}
        self.app: ASGIApp = app
        if allowed:  # a browser lets a page read another origin's answer only with these headers
            self.app = CORSMiddleware(app, allow_origins=[ANY] if self.any else sorted(self.origins),
                                      allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600)

    def _refusal(self, scope: Scope) -> RequestError | None:
        headers = Headers(scope=scope)
        host = headers.get("host", "").strip().lower()
        name = _hostname(host)
        if host and not self.any and not (_is_address(name) or name in self.names or name.endswith(".localhost")):
            return RequestError(f"Host {host!r} is not a name of this server (a web page may not reach it through a "
                                "name of its own; zerolm serve --allow-origin allows a site)", None, 403,
                                "permission_error")
        origin = headers.get("origin")
        if origin is not None and not self.any and origin.lower() not in self.origins \
                and urlsplit(origin.lower()).netloc != host:
            return RequestError(f"Origin {origin!r} is not this server's own: a page from another site may not use "
                                "it (zerolm serve --allow-origin allows a site)", None, 403, "permission_error")
        if scope["method"] in BODY_METHODS:
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return RequestError(f"Content-Type {media or 'none'}: a request's body is JSON, sent as "
                                    "Content-Type: application/json", None, 415)
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_body_bytes:
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
