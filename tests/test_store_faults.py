"""The sidecar outlives a bad store, a full disk and a stop: shards come back, nothing is given up for good."""

import contextlib
import os
import signal
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import N_SHARDS, Sampler, manifest_ids, shard_bytes, wait_for

from feedline.demo.store import Fault

QUICK = ("--retries", "1", "--retry-max-seconds", "2")  # the backoff caps at 2 s so the tests stay short
ALL = [f"ids-{k:04d}" for k in range(N_SHARDS)]


def cached(cache):
    return sorted(manifest_ids(cache))


def test_an_outage_longer_than_the_retries_does_not_empty_the_cache_for_good(remote, cache, samplers, data):
    remote.down = 500
    s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), *QUICK)
    samplers.append(s)
    assert wait_for(lambda: s.metric("feedline_fetch_breaker_open") == 1, 30)
    status, body = s.get("/readyz")
    assert status == 503 and "store failing" in body
    time.sleep(4)  # longer than every quick retry: the old sidecar gave every shard up here
    failing_since = len(remote.log)
    remote.down = 0
    assert wait_for(lambda: cached(cache) == ALL, 30), cached(cache)
    assert len(remote.log) > failing_since
    assert s.metric("feedline_fetch_breaker_open") == 0 and s.metric("feedline_fetch_retry_shards") == 0
    status, body = s.get("/readyz")
    assert status == 200 and "store ok" in body
    assert s.metric("feedline_fetch_errors_total", reason="http_status") >= 3


def test_the_breaker_holds_fetches_back_while_the_store_is_down(remote, cache, samplers, data):
    remote.down = 503
    s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), "--retries", "0",
                "--retry-max-seconds", "4")
    samplers.append(s)
    assert wait_for(lambda: s.metric("feedline_fetch_breaker_open") == 1, 30)
    n = len(remote.log)
    time.sleep(3)
    # open: at most the one half-open probe per cool-down, not every shard every few seconds
    assert len(remote.log) - n <= 2
    remote.down = 0
    assert wait_for(lambda: cached(cache) == ALL, 30)


def test_a_full_filesystem_is_a_space_problem_and_its_shards_come_back(small_tmpfs, samplers, remote, data):
    cache = str(small_tmpfs / "feedline")
    s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), "--max-mbps",
                str(2 * shard_bytes(data) / 1e6), "--fetch-threads", "1", *QUICK)
    samplers.append(s)
    assert wait_for(lambda: len(cached(cache)) >= 1, 30)
    filler = small_tmpfs / "filler"
    with open(filler, "wb", buffering=0) as f:  # the rest of the filesystem, taken by someone else
        for block in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError:
                pass
    assert wait_for(lambda: s.metric("feedline_fetch_errors_total", reason="no_space") >= 1, 30)
    assert s.metric("feedline_fetch_errors_total", reason="connection") == 0
    assert s.proc.poll() is None
    os.unlink(filler)
    assert wait_for(lambda: cached(cache) == ALL, 40), cached(cache)
    assert os.listdir(os.path.join(cache, "shards", ".partial")) == []


def test_a_shard_that_never_answers_does_not_stop_the_start_up(remote, cache, samplers, data):
    remote.faults["ids-0000.tar"] = Fault(stall_before=3, times=2)  # the HEAD and the first tries hang
    s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), "--min-shards", "5",
                "--fetch-timeout", "1", *QUICK)
    samplers.append(s)
    s.wait_ready(30)
    assert wait_for(lambda: cached(cache) == ALL, 40), cached(cache)
    assert s.metric("feedline_fetch_errors_total", reason="timeout") >= 1


class Forwarder:
    """A server on 127.0.0.1 that answers GETs and HEADs by fetching ``upstream`` + the path, and records each path.
    A forward proxy is sent whole URLs: its upstream is "". ``admit(method)`` wraps each upstream request, not
    the writing of the answer."""

    def __init__(self, upstream: str = ""):
        self.forwarded: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802
                self._forward("GET")

            def do_HEAD(self):  # noqa: N802
                self._forward("HEAD")

            def _forward(self, method):
                outer.forwarded.append(self.path)
                # the answer is written after admit() ends: once the client has it, it may ask again at once,
                # and that request must not find this one still counted as in flight
                with outer.admit(method):
                    req = urllib.request.Request(upstream + self.path, method=method)
                    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                    with opener.open(req, timeout=10) as r:
                        status, length, body = r.status, r.headers["Content-Length"], r.read()
                self.send_response(status)
                self.send_header("Content-Length", length)
                self.end_headers()
                if method == "GET":
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @contextlib.contextmanager
    def admit(self, method):
        yield

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class HeadGate(Forwarder):
    """``remote`` behind a server whose HEAD answers wait (up to 2 s) until another HEAD is being answered too:
    a sidecar that asks its start-up sizes one after the other never has two at once."""

    def __init__(self, remote):
        self.in_flight = self.most = 0
        self.changed = threading.Condition()
        super().__init__(remote.url)

    @contextlib.contextmanager
    def admit(self, method):
        if method != "HEAD":
            yield
            return
        with self.changed:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.most >= 2, timeout=2)
        try:
            yield
        finally:
            with self.changed:
                self.in_flight -= 1


def test_the_start_up_probe_asks_the_first_shards_sizes_fetch_threads_at_a_time(remote, cache, samplers, data):
    gate = HeadGate(remote)
    try:
        s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), "--fetch-threads", "3",
                    source=f"{gate.url}/ids-{{0000..{N_SHARDS - 1:04d}}}.tar")
        samplers.append(s)
        assert wait_for(lambda: cached(cache) == ALL, 60), cached(cache)
    finally:
        gate.close()
    assert 2 <= gate.most <= 3


def test_a_store_that_drips_bytes_is_abandoned_and_tried_again(remote, cache, samplers, data):
    remote.faults["ids-0004.tar"] = Fault(drip=500, times=1)  # 500 B/s, far below the floor
    s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), "--fetch-timeout", "1",
                "--fetch-min-mbps", "0.01", *QUICK)
    samplers.append(s)
    assert wait_for(lambda: cached(cache) == ALL, 30), cached(cache)
    assert s.metric("feedline_fetch_errors_total", reason="timeout") >= 1
    out = s.stop()
    assert "too slow" in out and "fetch_min_mbps" in out


def test_sigterm_during_a_dripping_download_stops_within_two_seconds_and_leaves_no_partial(remote, cache, samplers,
                                                                                          data):
    for k in range(N_SHARDS):
        remote.faults[f"ids-{k:04d}.tar"] = Fault(drip=2000)
    s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), "--fetch-min-mbps", "0")
    samplers.append(s)
    partial = os.path.join(cache, "shards", ".partial")
    assert wait_for(lambda: os.path.isdir(partial) and len(os.listdir(partial)) >= 2, 30)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    s.proc.communicate(timeout=10)
    assert time.monotonic() - t0 < 2
    assert s.proc.returncode == 0
    assert os.listdir(partial) == []


def test_a_body_without_a_length_chunked_arrives_whole(remote, cache, samplers, data):
    for k in range(N_SHARDS):
        remote.faults[f"ids-{k:04d}.tar"] = Fault(chunked=True)
    s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), *QUICK)
    samplers.append(s)
    assert wait_for(lambda: cached(cache) == ALL, 30)
    assert s.metric("feedline_fetch_bytes_total") == N_SHARDS * shard_bytes(data)  # each fetched once, whole
    s.stop()
    for k in range(N_SHARDS):
        name = f"ids-{k:04d}.tar"
        assert (data / name).read_bytes() == open(os.path.join(cache, "shards", name), "rb").read()


def test_retry_after_is_waited_for(remote, cache, samplers, data):
    remote.faults["ids-0002.tar"] = Fault(status=503, retry_after="3", times=1)
    s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), *QUICK)
    samplers.append(s)
    assert wait_for(lambda: cached(cache) == ALL, 30)
    tries = [(t, status) for t, method, path, status in remote.log if method == "GET" and path == "ids-0002.tar"]
    assert [status for _, status in tries] == [503, 200]
    assert tries[1][0] - tries[0][0] >= 2.9


def test_an_auth_header_from_a_mounted_file_is_sent_with_every_request(remote, cache, samplers, data, tmp_path):
    remote.auth = "Bearer s3cr3t"
    token = tmp_path / "token"
    token.write_text("s3cr3t\n")  # a bare token, as a Kubernetes Secret holds it
    s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), "--auth-header-file",
                str(token))
    samplers.append(s)
    assert wait_for(lambda: cached(cache) == ALL, 30)
    assert all(status == 200 for *_, status in remote.log)


def test_a_store_that_refuses_us_is_refused_at_start_up_naming_the_auth_settings(remote, cache, samplers, data):
    remote.auth = "Bearer s3cr3t"
    s = Sampler(remote, cache, "--auth-header", "Authorization: Bearer wrong")
    samplers.append(s)
    out = s.exit_output()
    assert s.proc.returncode == 2
    assert "401" in out and "auth_header" in out


@pytest.mark.parametrize("no_proxy, through", [("", True), ("127.0.0.1", False)])
def test_http_proxy_and_no_proxy_are_honoured(remote, cache, samplers, data, no_proxy, through):
    proxy = Forwarder()
    try:
        s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)),
                    env={"HTTP_PROXY": proxy.url, "http_proxy": proxy.url, "NO_PROXY": no_proxy, "no_proxy": no_proxy})
        samplers.append(s)
        assert wait_for(lambda: cached(cache) == ALL, 30)
        s.stop()
    finally:
        proxy.close()
    gets = [u for u in proxy.forwarded if u.endswith(".tar")]
    assert (len(gets) >= N_SHARDS) if through else gets == []


def test_the_store_run_as_its_own_process_keeps_no_request_log(tmp_path):
    # `feedline serve` serves for as long as a soak or a demo runs, and nobody can read its log
    from feedline.demo.store import FileStore

    (tmp_path / "a.tar").write_bytes(b"x" * 1024)
    with FileStore(str(tmp_path), remember=False) as quiet, FileStore(str(tmp_path)) as kept:
        for store in (quiet, kept):
            for _ in range(3):
                with urllib.request.urlopen(f"{store.url}/a.tar") as r:
                    assert r.read() == b"x" * 1024
        assert quiet.log == [] and quiet.requests["a.tar"] == 3
        assert [entry[1:] for entry in kept.log] == [("GET", "a.tar", 200)] * 3
