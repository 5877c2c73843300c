"""Fetching one shard into ``shards/.partial/``: streamed, bounded, retried, verified.

The transport is chosen by the URL: HTTP(S) (``http.py``: keep-alive connections per
thread, proxies, an auth header, a speed floor, redirects), an object store (``stores.py``:
S3 through boto3, GCS and Azure, ranged parallel GETs; the Hugging Face Hub, whose files
are HTTPS underneath), a ``pipe:`` command (``pipe.py``) or a local path. A few quick retries with exponential backoff and jitter (or what
``Retry-After`` asks) cover a blip; a shard that still fails goes back to the sidecar,
which tries it again later. A fetch that fails leaves no file behind.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..formats.urls import IndexEntry, is_pipe, is_remote, redact
from .errors import FETCH_ERRORS, FetchAborted, FetchError
from .auth import auth_headers, auth_origins
from .http import CHUNK, DENIED_FIX, MAX_INDEX_BYTES, HttpTransport, space_error
from .ratelimit import RateLimiter
from .stores import StoreContext, StoreError, Stores, resolves, scheme_of
from .settings import SidecarSettings
from .sources import SourceError, SourceShard

log = logging.getLogger("feedline.sampler")

__all__ = ["FETCH_ERRORS", "FetchAborted", "FetchError", "FetchResult", "Fetcher", "RateLimiter"]
MAX_RETRY_AFTER = 120.0  # seconds: a store asking for more gets its shard back in the sidecar's schedule


@dataclass
class FetchResult:
    """A shard fetched whole."""

    bytes: int
    seconds: float
    attempts: int


class Fetcher:
    """Downloads shards with quick retries and a shared rate cap, over HTTP(S), S3 or a local path."""

    def __init__(self, timeout: float, retries: int, stop: threading.Event, limiter: RateLimiter,
                 backoff: float = 0.5, min_rate: float = 0.0, auth: Callable[[], dict[str, str]] | None = None,
                 ca_file: str | None = None, on_error: Callable[[str], None] | None = None, threads: int = 4,
                 auth_origins: frozenset[tuple[str, str, int]] = frozenset(), max_index_bytes: int = MAX_INDEX_BYTES):
        self.on_error = on_error or (lambda reason: None)  # every failed attempt, retried or not
        self.timeout = timeout
        self.max_index_bytes = max_index_bytes
        self.retries = retries
        self.backoff = backoff
        self.stop = stop
        self.limiter = limiter
        self.min_rate = min_rate
        self.http = HttpTransport(timeout, stop, limiter, min_rate, auth, ca_file, auth_origins)
        self.stores = Stores(StoreContext(timeout, retries, threads, self.http, max_index_bytes))

    @classmethod
    def from_settings(cls, s: SidecarSettings, stop: threading.Event,
                      on_error: Callable[[str], None] | None = None) -> "Fetcher":
        """The sidecar's fetcher, every knob from its settings: a new fetch setting needs no change in the sidecar."""
        return cls(s.fetch_timeout, s.retries, stop, RateLimiter(s.max_mbps * 1e6), min_rate=s.fetch_min_mbps * 1e6,
                   auth=auth_headers(s.auth_header, s.auth_header_file), on_error=on_error, threads=s.fetch_threads,
                   auth_origins=auth_origins(s.source, s.auth_extra_hosts), max_index_bytes=s.max_index_bytes)

    def store(self, url: str) -> Any:
        """The object store ``url`` is in (``stores.py``), made at its first use; FetchError if it cannot be."""
        try:
            return self.stores.for_url(url)
        except StoreError as exc:
            raise FetchError(exc.reason, str(exc), exc.retry) from None

    def list(self, url: str) -> list[IndexEntry]:
        """The objects under an object store's prefix, with their sizes; SourceError naming what is wrong."""
        try:
            return [IndexEntry(o.url, "", o.size) for o in self.store(url).list(url)]
        except (FetchError, StoreError) as exc:
            raise SourceError(str(exc)) from None

    def close_thread(self) -> None:
        self.http.close_thread()

    def abort(self) -> None:
        """Unblock every download in progress (the stop event is set first)."""
        self.http.abort()

    # -- small requests ---------------------------------------------------------------------

    def text(self, url: str) -> str:
        """A remote index file, at most ``max_index_bytes`` of it; SourceError naming the URL (redacted)."""
        too_large = (f"index {redact(url)} is larger than max_index_bytes={self.max_index_bytes} bytes: raise "
                     f"max_index_bytes (--max-index-bytes / FEEDLINE_MAX_INDEX_BYTES) if it really is that large")
        credential, asked, resolved = None, url, None
        if scheme_of(url):
            try:
                store = self.store(url)
                if not resolves(store):
                    return store.text(url, self.max_index_bytes)
                url, credential = store.resolve(url)
                resolved = store
            except (FetchError, StoreError) as exc:
                raise SourceError(too_large if exc.reason == "too_large" else f"index {exc}") from None
        try:
            status, reason, _, body = self.http.request("GET", url, max_body=self.max_index_bytes,
                                                        credential=credential)
        except FetchError as exc:
            raise SourceError(too_large if exc.reason == "too_large" else f"index {redact(url)}: {exc}") from None
        if status != 200:
            if resolved is not None:  # the store's own fix (the Hub's: HF_TOKEN)
                raise SourceError(f"index {resolved.status_error(asked, status, reason)}")
            raise SourceError(f"index {redact(url)}: HTTP {status} {reason}" + (
                f": {DENIED_FIX}" if status in (401, 403) else ""))
        return body.decode()

    def size(self, url: str, timeout: float) -> int | None:
        """A remote shard's size (HEAD), or None where the store does not say; FetchError if it cannot be asked."""
        credential, asked, resolved = None, url, None
        if is_pipe(url):
            return None  # known once the command has run
        if scheme_of(url):
            store = self.store(url)
            try:
                if not resolves(store):
                    return store.size(url)
                url, credential = store.resolve(url)
                resolved = store
            except StoreError as exc:
                raise FetchError(exc.reason, str(exc), exc.retry) from None
        shown = redact(url)
        try:
            status, reason, length, _ = self.http.request("HEAD", url, timeout, credential=credential)
        except TimeoutError:
            raise FetchError("timeout", f"{shown}: no answer within {timeout:.0f} s", retry=True) from None
        except OSError as exc:
            raise FetchError("connection", f"{shown} is unreachable ({exc})", retry=True) from None
        if status >= 400 and resolved is not None:
            error = resolved.status_error(asked, status, reason)  # the store's own fix (the Hub's: HF_TOKEN)
            raise FetchError(error.reason, str(error), error.retry)
        if status in (401, 403):
            raise FetchError("denied", f"{shown}: HTTP {status} {reason}: {DENIED_FIX}", retry=False)
        if status in (404, 410):
            raise FetchError("http_status", f"{shown}: HTTP {status} {reason}", retry=False)
        return int(length) if status == 200 and length and length.isdigit() else None

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
                if (not exc.retry or attempt > self.retries or self.stop.is_set()
                        or (exc.retry_after or 0) > MAX_RETRY_AFTER):
                    raise
                delay = max(self.backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5), exc.retry_after or 0)
                log.info("%s: %s; retry %d of %d in %.1f s", shard.shown, exc, attempt, self.retries, delay)
                if self.stop.wait(delay):
                    raise FetchAborted() from None
            except BaseException:
                _unlink(dest)
                raise

    def _once(self, shard: SourceShard, dest: str, max_bytes: int) -> int:
        if is_pipe(shard.url):
            from .pipe import fetch_pipe

            n = fetch_pipe(shard.url, dest, max_bytes, self.stop, self.limiter, self.timeout, self.min_rate)
            self._check_sha(shard, dest)
            return n
        if scheme_of(shard.url):
            store = self.store(shard.url)
            if not resolves(store):
                n = self._signed_get(store, shard, dest, max_bytes)
                return self._store_get(store, shard, dest, max_bytes) if n is None else n
            try:
                url, credential = store.resolve(shard.url)
            except StoreError as exc:
                raise FetchError(exc.reason, str(exc), exc.retry) from None
            try:
                return self.http.get(replace(shard, url=url), dest, max_bytes, credential=credential)
            except FetchError as exc:
                raise self._explained(store, shard.url, exc) from None
        if is_remote(shard.url):
            return self.http.get(shard, dest, max_bytes)
        return self._copy_local(shard, dest, max_bytes)

    @staticmethod
    def _explained(store: Any, url: str, exc: FetchError) -> FetchError:
        """A refusal of a resolved store URL with the store's own fix (the Hub's names HF_TOKEN)."""
        if exc.status is None or exc.status < 400:
            return exc
        error = store.status_error(url, exc.status)
        return FetchError(error.reason, str(error), error.retry, exc.retry_after, exc.status)

    def _signed_get(self, store: Any, shard: SourceShard, dest: str, max_bytes: int) -> int | None:
        """The object through the HTTP transport at a URL its store signed, where it signs one (Azure with a key
        or a SAS: half the client's CPU a byte, ``cloud.py``); None to fetch it through the store's client: where
        it signs none, or where the store refused the signed URL (the client then asks, and its answer names the
        fix in the store's terms). Throttling, 5xx and broken connections are retried as any shard's."""
        presigned = getattr(store, "presigned", None)
        try:
            url = presigned(shard.url) if presigned is not None else None
        except StoreError as exc:
            raise FetchError(exc.reason, str(exc), exc.retry) from None
        if url is None:
            return None
        try:
            return self.http.get(replace(shard, url=url), dest, max_bytes)
        except FetchError as exc:
            if exc.status is None or exc.status == 429 or exc.status >= 500:
                raise
            status = exc.status
        _unlink(dest)
        log.debug("%s: the signed URL was answered %d; through the client", shard.shown, status)
        store.refused(shard.url, status)
        return None

    def _store_get(self, store: Any, shard: SourceShard, dest: str, max_bytes: int) -> int:
        """A shard from an object store's client (S3, GCS, Azure): its size checked against the budget before,
        the budget, the stop and the rate cap at every chunk."""
        if shard.size is not None and shard.size > max_bytes:
            raise FetchError("too_large", f"{shard.size} bytes, larger than the budget {max_bytes}; raise --budget",
                             retry=False)
        got = 0
        lock = threading.Lock()

        def progress(n: int) -> None:  # in the client's threads: raising stops the transfer
            nonlocal got
            with lock:
                got += n
                over = got > max_bytes
            if self.stop.is_set():
                raise FetchAborted()
            if over:
                raise FetchError("too_large", f"over {max_bytes} bytes, larger than the budget; raise --budget",
                                 retry=False)
            self.limiter.take(n, self.stop)

        try:
            n = store.download(shard.url, dest, progress)
        except StoreError as exc:
            raise FetchError(exc.reason, str(exc), exc.retry) from None
        if shard.size is not None and n != shard.size:
            raise FetchError("truncated", f"got {n} bytes, the listing says {shard.size}", retry=True)
        self._check_sha(shard, dest)
        return n

    def _copy_local(self, shard: SourceShard, dest: str, max_bytes: int) -> int:
        try:
            size = os.path.getsize(shard.url)
        except OSError as exc:
            raise FetchError("connection", f"cannot read {shard.shown}: {exc.strerror}", retry=False) from None
        if size > max_bytes:
            raise FetchError("too_large", f"{size} bytes, larger than the budget {max_bytes}; raise --budget",
                             retry=False)
        if self.stop.is_set():
            raise FetchAborted()
        try:
            shutil.copyfile(shard.url, dest)
        except OSError as exc:
            raise space_error(exc, dest) from None
        self.limiter.take(size, self.stop)
        self._check_sha(shard, dest)
        return size

    @staticmethod
    def _check_sha(shard: SourceShard, path: str) -> None:
        if not shard.sha256:
            return
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                h.update(chunk)
        if h.hexdigest() != shard.sha256:
            raise FetchError("checksum", f"sha256 does not match the index's {shard.sha256}", retry=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
