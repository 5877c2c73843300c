"""Fetching one shard into ``shards/.partial/``: streamed, bounded, retried, verified.

Each fetch thread keeps its own keep-alive HTTP connection per host (the
connection pool); a shared token bucket caps the bandwidth so the sidecar does
not starve the trainer's network. A fetch that fails leaves no file behind.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import random
import shutil
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from .sources import SourceShard

log = logging.getLogger("feedline.sampler")

CHUNK = 1 << 20
# Labels of feedline_fetch_errors_total{reason}.
FETCH_ERRORS = ("http_status", "connection", "timeout", "truncated", "not_tar", "checksum", "too_large")


class FetchError(Exception):
    def __init__(self, reason: str, message: str, retry: bool):
        super().__init__(message)
        self.reason = reason
        self.retry = retry


class FetchAborted(Exception):
    """The sidecar is stopping; the partial file was discarded."""


class RateLimiter:
    """A token bucket shared by all fetch threads; ``bytes_per_s`` 0 means no cap."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._last = time.monotonic()

    def take(self, n: int, stop: threading.Event) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            debt = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if debt > 0:
            stop.wait(debt)


@dataclass
class FetchResult:
    bytes: int
    seconds: float
    attempts: int


class Fetcher:
    def __init__(self, timeout: float, retries: int, stop: threading.Event, limiter: RateLimiter,
                 backoff: float = 0.5, ca_file: str | None = None,
                 on_error: Callable[[str], None] | None = None):
        self.on_error = on_error or (lambda reason: None)  # every failed attempt, retried or not
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.stop = stop
        self.limiter = limiter
        self._local = threading.local()
        self._ssl = ssl.create_default_context(cafile=ca_file)

    # -- connections ------------------------------------------------------------------------

    def _conn(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        pool: dict = self._local.__dict__.setdefault("pool", {})
        conn = pool.get((scheme, netloc))
        if conn is None:
            if scheme == "https":
                conn = http.client.HTTPSConnection(netloc, timeout=self.timeout, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(netloc, timeout=self.timeout)
            pool[(scheme, netloc)] = conn
        return conn

    def _drop(self, scheme: str, netloc: str) -> None:
        pool: dict = self._local.__dict__.setdefault("pool", {})
        conn = pool.pop((scheme, netloc), None)
        if conn is not None:
            conn.close()

    def close_thread(self) -> None:
        for conn in self._local.__dict__.get("pool", {}).values():
            conn.close()
        self._local.__dict__["pool"] = {}

    # -- one shard ------------------------------------------------------------------------

    def fetch(self, shard: SourceShard, dest: str, max_bytes: int) -> FetchResult:
        """Download to ``dest``, retrying transient failures with backoff and jitter."""
        t0 = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                n = self._once(shard, dest, max_bytes)
                return FetchResult(n, time.monotonic() - t0, attempt)
            except FetchError as exc:
                _unlink(dest)
                self.on_error(exc.reason)
                if not exc.retry or attempt > self.retries or self.stop.is_set():
                    raise
                delay = self.backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
                log.info("%s: %s; retry %d of %d in %.1f s", shard.url, exc, attempt, self.retries, delay)
                if self.stop.wait(delay):
                    raise FetchAborted() from None
            except BaseException:
                _unlink(dest)
                raise

    def _once(self, shard: SourceShard, dest: str, max_bytes: int) -> int:
        if not shard.is_http:
            return self._copy_local(shard, dest, max_bytes)
        u = urllib.parse.urlsplit(shard.url)
        path = u.path + (f"?{u.query}" if u.query else "")
        try:
            conn = self._conn(u.scheme, u.netloc)
            conn.request("GET", path, headers={"User-Agent": "feedline-sampler"})
            resp = conn.getresponse()
        except socket.timeout:
            self._drop(u.scheme, u.netloc)
            raise FetchError("timeout", f"no response within {self.timeout} s", retry=True) from None
        except (OSError, http.client.HTTPException) as exc:
            self._drop(u.scheme, u.netloc)
            raise FetchError("connection", f"connection failed: {exc}", retry=True) from None
        try:
            if resp.status != 200:
                resp.read()
                raise FetchError("http_status", f"HTTP {resp.status} {resp.reason}",
                                 retry=resp.status >= 500 or resp.status == 429)
            expected = resp.getheader("Content-Length")
            expected_n = int(expected) if expected is not None and expected.isdigit() else None
            if expected_n is not None and expected_n > max_bytes:
                raise FetchError("too_large", f"{expected_n} bytes, larger than the budget {max_bytes}; "
                                 f"raise --budget / FEEDLINE_BUDGET", retry=False)
            n = self._stream(resp, dest, shard, max_bytes)
            if expected_n is not None and n != expected_n:
                raise FetchError("truncated", f"got {n} of {expected_n} bytes", retry=True)
            if shard.size is not None and n != shard.size:
                raise FetchError("truncated", f"got {n} bytes, the index says {shard.size}", retry=True)
            return n
        except socket.timeout:
            self._drop(u.scheme, u.netloc)
            raise FetchError("timeout", f"stalled: no data for {self.timeout} s", retry=True) from None
        except http.client.IncompleteRead as exc:
            self._drop(u.scheme, u.netloc)
            raise FetchError("truncated", f"the body ended early ({exc})", retry=True) from None
        except (OSError, http.client.HTTPException) as exc:
            self._drop(u.scheme, u.netloc)
            raise FetchError("connection", f"connection broke mid-shard: {exc}", retry=True) from None
        except BaseException:
            self._drop(u.scheme, u.netloc)
            raise

    def _stream(self, resp: http.client.HTTPResponse, dest: str, shard: SourceShard, max_bytes: int) -> int:
        digest = hashlib.sha256() if shard.sha256 else None
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        n = 0
        with open(dest, "wb") as f:
            while True:
                if self.stop.is_set():
                    raise FetchAborted()
                k = resp.readinto(buf)
                if not k:
                    break
                n += k
                if n > max_bytes:
                    raise FetchError("too_large", f"over {max_bytes} bytes, larger than the budget; raise "
                                     f"--budget / FEEDLINE_BUDGET", retry=False)
                f.write(view[:k])
                if digest is not None:
                    digest.update(view[:k])
                self.limiter.take(k, self.stop)
        if digest is not None and digest.hexdigest() != shard.sha256:
            raise FetchError("checksum", f"sha256 {digest.hexdigest()} does not match the index's {shard.sha256}",
                             retry=True)
        return n

    def _copy_local(self, shard: SourceShard, dest: str, max_bytes: int) -> int:
        try:
            size = os.path.getsize(shard.url)
        except OSError as exc:
            raise FetchError("connection", f"cannot read {shard.url}: {exc.strerror}", retry=False) from None
        if size > max_bytes:
            raise FetchError("too_large", f"{size} bytes, larger than the budget {max_bytes}; raise --budget",
                             retry=False)
        if self.stop.is_set():
            raise FetchAborted()
        shutil.copyfile(shard.url, dest)
        self.limiter.take(size, self.stop)
        if shard.sha256:
            h = hashlib.sha256()
            with open(dest, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    h.update(chunk)
            if h.hexdigest() != shard.sha256:
                raise FetchError("checksum", f"sha256 does not match the index's {shard.sha256}", retry=False)
        return size


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
