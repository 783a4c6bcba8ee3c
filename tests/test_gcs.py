"""The tests' GCS server (benchmarks/lib/gcs.py) itself: seen to start whatever proxy the worker's urllib kept; a start that
fails says why and leaves no process behind."""

import os
import urllib.error
import urllib.request

import pytest

from benchmarks.lib.gcs import GCSServer

PROXIES = ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")


def test_the_server_is_reached_though_urlopen_kept_a_dead_proxy(tmp_path, monkeypatch):
    """A worker whose first urlopen was made with a dead proxy in the environment (test_harness's --download
    test) keeps sending urlopen to it: the server's start, its buckets and listings go past it."""
    monkeypatch.setattr(urllib.request, "_opener", None)  # this worker's own opener back at the end
    for variable in PROXIES:
        monkeypatch.setenv(variable, "http://127.0.0.1:9")  # nothing listens there
    for variable in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(urllib.error.URLError, match="refused"):
        urllib.request.urlopen("http://127.0.0.1:1/", timeout=5)  # the opener, built now, keeps the proxy
    # (left in the environment too: a machine behind a proxy, without no_proxy, is the same to the server)
    server = GCSServer(tmp_path / "root").start()
    try:
        bucket = server.make_bucket("bucket")
        assert bucket == "gs://bucket" and server.objects("bucket") == {}
    finally:
        server.stop()


def _fake_binary(tmp_path, body):
    """A server that does what `body` (sh) says, its pid written first to tmp_path/pid."""
    binary = tmp_path / "fake-gcs-server"
    binary.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'pid'}\n{body}\n")
    binary.chmod(0o755)
    return binary


@pytest.mark.parametrize("body, says", [
    ("exec sleep 300", r"not answering after 1 s \(the last try: .*refused.*; a TCP connection to its port is not: "),
    ("echo 'bind: address already in use' >&2; exit 1", r"it exited with 1; its log: 'bind: address already in use\\n'"),
], ids=["silent", "exits"])
def test_a_start_that_fails_says_why_and_leaves_no_process(tmp_path, body, says):
    server = GCSServer(tmp_path / "root")
    server.binary = _fake_binary(tmp_path, body)
    with pytest.raises(AssertionError, match=f"fake-gcs-server on port {server.port} did not start: {says}"):
        server.start(wait_s=1)
    assert server.process is None
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(int((tmp_path / "pid").read_text()), 0)
