"""`zerolm serve --checkpoint DIR`: a checkpoint's model over HTTP: a page to try it, OpenAI's completions API
(zerolm.serve)."""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys

from zerolm.core.errors import UsageError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a run's checkpoint directory (its newest intact step) or one step's directory")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default: %(default)s, this machine only; the server has no "
                             "authentication)")
    parser.add_argument("--port", type=int, default=8000, help="(default: %(default)s; 0: any free port)")
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="the context served, prompt and completion (default: the trained model.seq_len; longer "
                             "only for model.position alibi or rope)")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="the most new tokens a request may ask for (max_tokens; past it: HTTP 400) and what "
                             "max_tokens: null means (default: the context)")
    parser.add_argument("--max-rows", type=int, default=32, metavar="R",
                        help="choices decoded together at most; more wait for a row (default: %(default)s)")
    parser.add_argument("--max-waiting", type=int, default=256, metavar="W",
                        help="choices waiting for a row at most; past it a request gets HTTP 429 (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=None, metavar="B",
                        help="the largest request body; a larger one gets HTTP 413 before it is read (default: 64 "
                             "bytes a token of the context, 1 MiB at least)")
    parser.add_argument("--grace", type=float, default=30.0, metavar="S",
                        help="on SIGTERM or Ctrl-C, how long the answers in flight may go on; those still going then "
                             "end with an error their clients read (default: %(default)g s)")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a site whose web pages may use the server through their visitors' browsers, as "
                             "scheme://host[:port] (repeatable, or a comma-separated list; *: any site). Without "
                             "it, only the server's own page may, and only through the server's own names")
    parser.add_argument("--name", default=None,
                        help="the model's name in the API (default: the run's checkpoint directory's name)")
    parser.add_argument("--tokenizer", default=None, metavar="FILE",
                        help="the run's tokenizer file, if its dataset is not where the checkpoint says")
    return parser


def _listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise UsageError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    limit = 1 if args.max_tokens is None else args.max_tokens
    for flag, value, least in (("--port", args.port, 0), ("--max-rows", args.max_rows, 1),
                               ("--max-waiting", args.max_waiting, 1), ("--max-tokens", limit, 1),
                               ("--max-body-bytes", 1024 if args.max_body_bytes is None else args.max_body_bytes, 1024)):
        if value < least or (flag == "--port" and value > 65535):
            raise UsageError(f"{flag}: {value} is out of range")
    if not 0 <= args.grace < float("inf"):
        raise UsageError(f"--grace: {args.grace:g} must be >= 0 seconds")
    import jax

    from zerolm.checkpoint import trained_model as restored
    from zerolm.core.storage import check
    from zerolm.serve import app
    from zerolm.serve.engine import BUCKETS, Engine
    from zerolm.serve.guard import origins

    allowed = origins(args.allow_origin)  # (OriginError: one line naming --allow-origin)

    check(args.checkpoint, "--checkpoint")
    model_run = restored.load(args.checkpoint, jax.local_devices()[:1])
    tokenizer = model_run.tokenizer(args.tokenizer)
    if args.context is not None:
        if args.context < 2:
            raise UsageError(f"--context: {args.context} must be at least 2 (a prompt token and one to draw)")
        model_run = model_run.at_context(args.context, "--context")
    sock = _listen(args.host, args.port)
    if args.host not in LOOPBACK and not _is_loopback(args.host):
        print(f"warning: listening on {args.host}: anyone who can reach this machine can use the model "
              "(the server has no authentication)", file=sys.stderr)
    buckets = tuple(b for b in BUCKETS if b < args.max_rows) + (args.max_rows,)
    engine = Engine(model_run.model, model_run.params, tokenizer, buckets, args.max_waiting)
    name = args.name or model_run.where.parent.name
    print(f"compiling {name} (step {model_run.step}, context {model_run.model.cfg.seq_len}) on "
          f"{jax.local_devices()[0].device_kind}...", file=sys.stderr, flush=True)
    engine.start()
    engine.ready.wait()
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def listening() -> None:
        print(f"serving {name} at {url}/ (OpenAI API: {url}/v1; Ctrl-C stops)", flush=True)
    served = app.Served(engine, name, args.max_tokens)
    app.run(served, sock, listening, app.create_app(served, args.max_body_bytes, args.host, allowed), args.grace)
    print("stopped", file=sys.stderr)
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
