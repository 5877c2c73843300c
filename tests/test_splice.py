"""A plain-HTTP shard body goes from the socket to its file by ``splice`` (issue 63): byte for byte what the store
sent, with the same checks as the buffered path (a short body is truncated, a stop ends it, a checksum or TLS takes
the buffered path). A real HTTP server on 127.0.0.1, the real transport; ``os.splice`` is only counted, not replaced.
"""

import hashlib
import http.server
import os
import threading
import time

import pytest

from feedline.sampler import splice
from feedline.sampler.errors import FetchAborted, FetchError
from feedline.sampler.http import HttpTransport
from feedline.sampler.ratelimit import RateLimiter
from feedline.sampler.sources import SourceShard

DATA = os.urandom(5 * (1 << 20) + 12345)  # more than a pipe's worth, not a multiple of it


class Store(http.server.ThreadingHTTPServer):
    """Serves DATA at /whole; /short announces DATA's length and sends a third of it, then closes; /stall sends a
    megabyte and then nothing until ``release``."""

    daemon_threads = True

    def __init__(self) -> None:
        self.release = threading.Event()
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", str(len(DATA)))
                self.end_headers()
                if self.path == "/whole":
                    self.wfile.write(DATA)
                elif self.path == "/short":
                    self.wfile.write(DATA[: len(DATA) // 3])
                    self.close_connection = True
                elif self.path == "/stall":
                    self.wfile.write(DATA[: 1 << 20])
                    self.wfile.flush()
                    store.release.wait(30)
                    self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


@pytest.fixture
def store():
    s = Store()
    t = threading.Thread(target=s.serve_forever, daemon=True)
    t.start()
    yield s
    s.release.set()
    s.shutdown()
    s.server_close()


@pytest.fixture
def spliced(monkeypatch):
    """How many bytes ``os.splice`` moved (the real call, counted)."""
    moved = {"bytes": 0}
    real = os.splice

    def counted(*args, **kwargs):
        n = real(*args, **kwargs)
        moved["bytes"] += n
        return n

    monkeypatch.setattr(os, "splice", counted)
    return moved


def transport(stop=None, min_rate=0.0, timeout=10.0):
    return HttpTransport(timeout, stop or threading.Event(), RateLimiter(0), min_rate)


def test_a_plain_http_body_goes_from_socket_to_file_by_splice_byte_for_byte(store, spliced, tmp_path):
    dest = str(tmp_path / "a.tar")
    n = transport().get(SourceShard(store.url("/whole"), "a"), dest, 1 << 30)
    assert n == len(DATA)
    assert open(dest, "rb").read() == DATA
    # the socket into the pipe and the pipe into the file: all but what came with the headers, twice
    assert spliced["bytes"] >= 2 * (len(DATA) - (1 << 16))


def test_a_body_with_a_checksum_to_compute_takes_the_buffered_path(store, spliced, tmp_path):
    dest = str(tmp_path / "a.tar")
    shard = SourceShard(store.url("/whole"), "a", sha256=hashlib.sha256(DATA).hexdigest())
    assert transport().get(shard, dest, 1 << 30) == len(DATA)
    assert open(dest, "rb").read() == DATA
    assert spliced["bytes"] == 0


def test_a_body_cut_short_while_spliced_is_truncated(store, tmp_path):
    with pytest.raises(FetchError) as err:
        transport().get(SourceShard(store.url("/short"), "a"), str(tmp_path / "a.tar"), 1 << 30)
    assert err.value.reason == "truncated"


def test_a_stop_during_a_stalled_splice_ends_the_fetch_at_once(store, tmp_path):
    stop = threading.Event()
    t = transport(stop=stop, timeout=30.0)
    threading.Timer(0.5, lambda: (stop.set(), t.abort())).start()
    started = time.monotonic()
    with pytest.raises((FetchAborted, FetchError)):
        t.get(SourceShard(store.url("/stall"), "a"), str(tmp_path / "a.tar"), 1 << 30)
    assert time.monotonic() - started < 5


def test_a_silent_store_mid_splice_is_a_stall_after_the_timeout(store, tmp_path):
    started = time.monotonic()
    with pytest.raises(FetchError) as err:
        transport(timeout=1.0).get(SourceShard(store.url("/stall"), "a"), str(tmp_path / "a.tar"), 1 << 30)
    assert err.value.reason == "timeout" and time.monotonic() - started < 10


def test_tls_chunked_and_checksummed_answers_are_not_spliced():
    class Answer:
        chunked, length, fp = False, 10, object()

    assert splice.can_splice(Answer(), tls=False, checksum=False)
    assert not splice.can_splice(Answer(), tls=True, checksum=False)
    assert not splice.can_splice(Answer(), tls=False, checksum=True)
    Answer.chunked = True
    assert not splice.can_splice(Answer(), tls=False, checksum=False)


def test_a_file_that_takes_no_splice_still_gets_the_bytes_the_pipe_holds(tmp_path):
    r, w = os.pipe()
    payload = os.urandom(40_000)
    os.write(w, payload)
    path = tmp_path / "appended"
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # Linux refuses a splice into an O_APPEND file
    try:
        splice._to_file(r, out, len(payload))
    finally:
        for fd in (r, w, out):
            os.close(fd)
    assert path.read_bytes() == payload
