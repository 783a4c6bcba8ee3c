"""The tests' GCS server (tests/gcs.py) itself: it is seen to start whatever proxy the worker's urllib kept."""

import urllib.error
import urllib.request

import pytest

from gcs import GCSServer

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
