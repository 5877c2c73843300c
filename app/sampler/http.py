"""Shards over HTTP(S): per-thread keep-alive connections, proxies, an auth header, a speed floor.

- Each fetch thread keeps one connection per (scheme, host, proxy); ``HTTP_PROXY``,
  ``HTTPS_PROXY`` and ``NO_PROXY`` are honoured (an HTTPS proxy through a CONNECT tunnel).
- An auth header for private stores, fixed or read from a file at each request (a mounted
  Kubernetes Secret that rotates): ``Name: value``, or a bare token sent as a bearer token.
- A body slower than ``min_rate`` bytes/s over ``timeout`` seconds is abandoned (curl's
  ``--speed-limit``/``--speed-time``); a socket silent for ``timeout`` seconds too.
- ``Retry-After`` on 429/503 tells the retry when to come back.
- Redirects (301, 302, 303, 307, 308) are followed, at most ``MAX_REDIRECTS`` hops, each on its host's own
  connection (and proxy), to ``http:``/``https:`` only and never from ``https:`` down to ``http:``; a 3xx
  answer's body is never read. The auth header goes to a hop whose origin the user configured; a
  ``credential`` a caller gives (a Hub token) to the origin first asked only, never to the host it redirects to.
- ``abort()`` shuts every open socket, so a stop never waits on a stalled read.
- What a store answers is bounded before it is held: an index body by ``max_index_bytes``, a shard by
  the budget; an error answer's body is never read (the connection is closed instead).
"""

from __future__ import annotations

import email.utils
import errno
import hashlib
import http.client
import io
import logging
import os
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, BinaryIO

from ..formats.files import create_new
from ..formats.urls import redact
from .auth import origin
from .errors import FetchAborted, FetchError, too_large
from .ratelimit import RateLimiter, SpeedFloor
from . import splice
from .sources import SourceShard

log = logging.getLogger("feedline.sampler")

CHUNK = 1 << 20
MAX_INDEX_BYTES = 256 << 20  # an index of a million shards with their sha256 and size takes ~150 MB
USER_AGENT = "feedline-sampler"
REDIRECTS = frozenset((301, 302, 303, 307, 308))
MAX_REDIRECTS = 10  # hops followed, as browsers and requests allow 20-30 and curl 50: a store needs one or two
STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)  # a kept-alive connection closed
DENIED_FIX = ("the store refuses us: give the header it expects with auth_header (FEEDLINE_AUTH_HEADER) or "
              "auth_header_file (FEEDLINE_AUTH_HEADER_FILE), or fix the URL's signature")


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (a number, or an HTTP date)."""
    if not value:
        return None
    if value.strip().isdigit():
        return float(value.strip())
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def next_hop(url: str, status: int, reason: str, location: str | None, hops: int) -> str:
    """Where the ``status`` redirect that ``url`` answered leads (``location`` resolved against ``url``), as the
    ``hops``-th redirect; FetchError ``http_status``, not retried, for one not to follow: past ``MAX_REDIRECTS``,
    to a scheme other than ``http:``/``https:`` (``file:``, ``s3:``...), or from ``https:`` down to ``http:``."""
    said = f"HTTP {status} {reason}"
    if not location:
        raise FetchError("http_status", f"{said} names no Location to go to", retry=False)
    # a space or a non-ASCII character quoted, as browsers and requests do: never one http.client refuses mid-chain
    target = urllib.parse.quote(urllib.parse.urljoin(url, location.strip()), safe="!#$%&'()*+,/:;=?@[]~")
    shown = redact(target)
    try:
        u = urllib.parse.urlsplit(target)
        u.port  # noqa: B018 - a ValueError for a port that is not a number
    except ValueError:
        raise FetchError("http_status", f"{said} to {shown}: refused, not a URL", retry=False) from None
    if hops >= MAX_REDIRECTS:
        raise FetchError("http_status", f"{said} to {shown}: stopped after {MAX_REDIRECTS} redirects (a redirect "
                                        f"loop?) from {redact(url)}", retry=False)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise FetchError("http_status", f"{said} to {shown}: refused, a redirect is followed to an http: or "
                                        f"https: URL only", retry=False)
    if u.scheme == "http" and url.lower().startswith("https:"):
        raise FetchError("http_status", f"{said} to {shown}: refused, a redirect from https: down to http: would "
                                        f"send the request in the clear", retry=False)
    log.debug("%s: %s to %s", redact(url), said, shown)  # DEBUG only: a store redirecting every shard is normal
    return target


def space_error(exc: OSError, where: str) -> FetchError:
    """A write that failed: a full filesystem is a space problem, not the store's."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return FetchError("no_space", f"the cache filesystem is full writing {where} ({exc.strerror}); it is "
                                      f"tried again later", retry=False)
    return FetchError("connection", f"cannot write {where}: {exc}", retry=False)


class HttpTransport:
    """GETs of whole shards and small requests (HEAD, index files) for the sidecar's threads."""

    def __init__(self, timeout: float, stop: threading.Event, limiter: RateLimiter, min_rate: float = 0.0,
                 auth: Callable[[], dict[str, str]] | None = None, ca_file: str | None = None,
                 auth_origins: frozenset[tuple[str, str, int]] = frozenset()):
        self.timeout = timeout
        self._auth_origins = auth_origins  # the auth header goes to these (scheme, host, port) only
        self._withheld: set[tuple[str, str, int]] = set()
        self.stop = stop
        self.limiter = limiter
        self.min_rate = min_rate
        self._auth = auth or (lambda: {})
        self._local = threading.local()
        self._open: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()
        self._ca_file = ca_file  # a named CA file is read now (refused at start-up); the system's (~50 ms) lazily
        self._ssl: ssl.SSLContext | None = ssl.create_default_context(cafile=ca_file) if ca_file else None

    def _tls(self) -> ssl.SSLContext:
        with self._lock:
            if self._ssl is None:
                self._ssl = ssl.create_default_context(cafile=self._ca_file)
            return self._ssl

    # -- connections ------------------------------------------------------------------------

    def _route(self, u: urllib.parse.SplitResult) -> tuple[str | None, str]:
        """(proxy URL or None, the request target: a path, or the absolute URL for an HTTP proxy)."""
        path = u.path + (f"?{u.query}" if u.query else "")
        proxy = urllib.request.getproxies().get(u.scheme)
        if proxy and not urllib.request.proxy_bypass(u.hostname or ""):
            bare = u._replace(netloc=u.netloc.rpartition("@")[2])  # a user:password@ is not the proxy's to see
            return proxy, (urllib.parse.urlunsplit(bare) if u.scheme == "http" else path)
        return None, path

    def _connect(self, u: urllib.parse.SplitResult, proxy: str | None, timeout: float) -> http.client.HTTPConnection:
        """A connection to the URL's host and port (or the proxy's): never its netloc, whose ``user:password@``
        http.client would take for a port and quote in its error."""
        if proxy is None:
            if u.scheme == "https":
                return http.client.HTTPSConnection(u.hostname or "", u.port, timeout=timeout, context=self._tls())
            return http.client.HTTPConnection(u.hostname or "", u.port, timeout=timeout)
        p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if u.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(p.hostname or "", p.port, timeout=timeout,
                                                                          context=self._tls())
            conn.set_tunnel(u.hostname or "", u.port or 443)
            return conn
        return http.client.HTTPConnection(p.hostname or "", p.port, timeout=timeout)

    def _conn(self, u: urllib.parse.SplitResult, proxy: str | None) -> http.client.HTTPConnection:
        pool: dict = self._local.__dict__.setdefault("pool", {})
        key = (u.scheme, u.netloc, proxy)
        conn = pool.get(key)
        if conn is None:
            conn = pool[key] = self._connect(u, proxy, self.timeout)
            with self._lock:
                self._open.add(conn)
        return conn

    def _drop(self, u: urllib.parse.SplitResult, proxy: str | None) -> None:
        conn = self._local.__dict__.setdefault("pool", {}).pop((u.scheme, u.netloc, proxy), None)
        if conn is not None:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def close_thread(self) -> None:
        for conn in self._local.__dict__.get("pool", {}).values():
            with self._lock:
                self._open.discard(conn)
            conn.close()
        self._local.__dict__["pool"] = {}

    def abort(self) -> None:
        """Shut every open socket: a read blocked on a stalled store returns at once (the stop is set)."""
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _headers(self, u: urllib.parse.SplitResult, first: tuple[str, str, int] | None = None,
                 credential: dict[str, str] | None = None) -> dict[str, str]:
        """The auth header goes to the origin of the source the user configured, never to a host an index names
        or a redirect leads to; a caller's ``credential`` to ``first`` (the origin first asked) only."""
        where = origin(u)
        extra = credential if credential and where == first else {}
        if where in self._auth_origins:
            return {"User-Agent": USER_AGENT, **self._auth(), **extra}
        if where not in self._withheld and self._auth():
            self._withheld.add(where)
            log.warning("not sending the auth header to %s://%s:%d: not the origin of the source (%s)", *where,
                        ", ".join(f"{s}://{h}:{p}" for s, h, p in sorted(self._auth_origins)) or "none")
        return {"User-Agent": USER_AGENT, **extra}

    # -- a whole shard ----------------------------------------------------------------------

    def get(self, shard: SourceShard, dest: str, max_bytes: int, credential: dict[str, str] | None = None) -> int:
        """One attempt at ``shard`` into ``dest``, through its redirects; its size. Raises FetchError or
        FetchAborted. ``credential``: headers for the origin of ``shard.url`` only (a redirect elsewhere drops them)."""
        url = shard.url
        first = origin(urllib.parse.urlsplit(url))
        for hops in range(MAX_REDIRECTS + 1):
            if self.stop.is_set():
                raise FetchAborted()
            u = urllib.parse.urlsplit(url)
            proxy, target = self._route(u)  # per hop: the next host may be another proxy's, or none's
            resp = self._ask(u, proxy, target, self._headers(u, first, credential))
            if resp.status not in REDIRECTS:
                return self._answer(resp, u, proxy, dest, shard, max_bytes)
            try:
                url = next_hop(url, resp.status, resp.reason, resp.getheader("Location"), hops)
            finally:
                self._drop(u, proxy)  # its body unread: the connection goes (a store may send an endless one)
        raise AssertionError("unreachable: next_hop stops the chain")

    def _ask(self, u: urllib.parse.SplitResult, proxy: str | None, target: str,
             headers: dict[str, str]) -> http.client.HTTPResponse:
        """A GET on this thread's kept-alive connection to the host (or proxy); the answer's head."""
        for fresh in (False, True):
            reused = False
            try:
                conn = self._conn(u, proxy)
                reused = conn.sock is not None  # connected by an earlier request: kept alive since
                conn.request("GET", target, headers=headers)
                return conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                # a kept-alive connection the store closed while it idled (stores time idle ones out): once more on
                # a new one, uncounted; a new connection that fails is the store's failure
                if not fresh and reused and isinstance(exc, STALE) and not self.stop.is_set():
                    self._drop(u, proxy)
                    continue
                raise self._broken(exc, u, proxy, answered=False) from None
        raise AssertionError("unreachable")

    def _answer(self, resp: http.client.HTTPResponse, u: urllib.parse.SplitResult, proxy: str | None, dest: str,
                shard: SourceShard, max_bytes: int) -> int:
        """The final (not a redirect) answer to a shard's GET: its body into ``dest``, checked; its size."""
        try:
            # an error answer's body is never read: the connection is dropped below instead (a store may answer an
            # endless one; S3's SignatureDoesNotMatch body quotes the canonical request, a presigned query in it)
            if resp.status in (401, 403):
                raise FetchError("denied", f"HTTP {resp.status} {resp.reason}: {DENIED_FIX}", retry=False,
                                 status=resp.status)
            if resp.status != 200:
                raise FetchError("http_status", f"HTTP {resp.status} {resp.reason}",
                                 retry=resp.status >= 500 or resp.status == 429,
                                 retry_after=_retry_after(resp.getheader("Retry-After")), status=resp.status)
            expected = resp.getheader("Content-Length")
            expected_n = int(expected) if expected is not None and expected.isdigit() else None
            if expected_n is not None and expected_n > max_bytes:
                raise FetchError("too_large", f"{expected_n} bytes, larger than the budget {max_bytes}; "
                                              f"raise --budget / FEEDLINE_BUDGET", retry=False)
            n = self._stream(resp, dest, shard, max_bytes, None if resp.chunked else expected_n, u.scheme == "https")
            if expected_n is not None and n != expected_n:
                raise FetchError("truncated", f"got {n} of {expected_n} bytes", retry=True)
            if shard.size is not None and n != shard.size:
                raise FetchError("truncated", f"got {n} bytes, the index says {shard.size}", retry=True)
            return n
        except (OSError, http.client.HTTPException) as exc:
            raise self._broken(exc, u, proxy, answered=True) from None
        except BaseException:
            self._drop(u, proxy)
            raise

    def _broken(self, exc: BaseException, u: urllib.parse.SplitResult, proxy: str | None,
                answered: bool) -> Exception:
        """What a socket or protocol failure means; the connection is dropped (never reused half-read)."""
        self._drop(u, proxy)
        if isinstance(exc, socket.timeout):
            return FetchError("timeout", f"stalled: no data for {self.timeout} s" if answered
                              else f"no response within {self.timeout} s", retry=True)
        if isinstance(exc, http.client.IncompleteRead):
            return FetchError("truncated", f"the body ended early ({exc})", retry=True)
        if self.stop.is_set():
            return FetchAborted()
        return FetchError("connection", f"connection broke mid-shard: {exc}" if answered
                          else f"connection failed: {exc}", retry=True)

    def _stream(self, resp: http.client.HTTPResponse, dest: str, shard: SourceShard, max_bytes: int,
                length: int | None, tls: bool) -> int:
        """The body into ``dest`` (by ``splice`` where it can be); its size. A known length is allocated first: a full
        filesystem is known before a byte is fetched, and tmpfs takes the pages in one go (faster, measured)."""
        digest = hashlib.sha256() if shard.sha256 else None
        with create_new(dest) as f:  # never a file that was there, never through a link
            if length:
                try:
                    os.posix_fallocate(f.fileno(), 0, length)
                except OSError as exc:
                    raise space_error(exc, dest) from None
            if splice.can_splice(resp, tls, digest is not None):
                floor = SpeedFloor(self.min_rate, self.timeout, self.limiter)
                n = splice.splice_body(resp, f, self.stop, max_bytes, self.limiter, floor, self.timeout)
            else:
                n = self._pump(resp, memoryview(bytearray(CHUNK)), f, digest, max_bytes)
        if digest is not None and digest.hexdigest() != shard.sha256:
            raise FetchError("checksum", f"sha256 {digest.hexdigest()} does not match the index's {shard.sha256}",
                             retry=True)
        return n

    def _pump(self, resp: http.client.HTTPResponse, buf: memoryview, f: BinaryIO, digest: Any,
              max_bytes: int) -> int:
        """Socket -> ``buf`` -> ``f``, checking the stop, the budget, the rate cap and the speed floor at
        every read of the socket; written a full buffer at a time (fewer, larger writes: tmpfs takes
        them faster)."""
        n = filled = 0
        floor = SpeedFloor(self.min_rate, self.timeout, self.limiter)
        while True:
            if self.stop.is_set():
                raise FetchAborted()
            k = _read_some(resp, buf[filled:])
            if k:
                n += k
                filled += k
                if n > max_bytes:
                    raise too_large(max_bytes)
                self.limiter.take(k, self.stop)
            if filled and (filled == len(buf) or not k):
                try:
                    f.write(buf[:filled])
                except OSError as exc:
                    raise space_error(exc, f.name) from None
                if digest is not None:
                    digest.update(buf[:filled])
                filled = 0
            if not k:
                return n
            slow = floor.moved(k, time.monotonic())
            if slow:
                raise FetchError("timeout", f"too slow: {slow}", retry=True)

    # -- small requests ---------------------------------------------------------------------

    def request(self, method: str, url: str, timeout: float | None = None, max_body: int = 0,
                credential: dict[str, str] | None = None) -> tuple[int, str, str | None, bytes]:
        """One request, through its redirects, each hop on its own connection: the final answer's (status,
        reason, Content-Length, body). ``credential``: headers for the origin of ``url`` only, as ``get``'s.

        The body is read from a 200 answer only, and at most ``max_body`` bytes of it (0: none): one longer,
        announced or streamed, is a FetchError ``too_large``; a slow one meets the speed floor as a shard does.
        An error or redirect answer's body is never read: the connection is closed, so an endless one costs nothing.
        """
        first = origin(urllib.parse.urlsplit(url))
        for hops in range(MAX_REDIRECTS + 1):
            u = urllib.parse.urlsplit(url)
            proxy, target = self._route(u)
            conn = self._connect(u, proxy, timeout or self.timeout)
            try:
                conn.request(method, target, headers=self._headers(u, first, credential))
                resp = conn.getresponse()
                if resp.status in REDIRECTS:
                    url = next_hop(url, resp.status, resp.reason, resp.getheader("Location"), hops)
                    continue
                return self._small(method, resp, max_body)
            finally:
                conn.close()
        raise AssertionError("unreachable: next_hop stops the chain")

    def _small(self, method: str, resp: http.client.HTTPResponse, max_body: int) -> tuple[int, str, str | None, bytes]:
        """The final answer to a small request: its body read from a 200 answer only, at most ``max_body`` bytes."""
        length = resp.getheader("Content-Length")
        if method == "HEAD" or resp.status != 200 or max_body <= 0:
            return resp.status, resp.reason, length, b""
        if length is not None and length.isdigit() and int(length) > max_body:
            raise FetchError("too_large", f"{length} bytes, over {max_body}", retry=False)
        body = io.BytesIO()
        self._pump(resp, memoryview(bytearray(min(CHUNK, max_body + 1))), body, None, max_body)
        return resp.status, resp.reason, length, body.getvalue()


def _read_some(resp: http.client.HTTPResponse, buf: memoryview) -> int:
    """Whatever the socket has now, up to ``len(buf)``, without a copy.

    ``HTTPResponse.readinto`` waits until the buffer is full, so a store dripping a few bytes a second would
    never let the speed floor be checked; ``readinto1`` returns after one read of the socket.
    """
    if resp.chunked or resp.length is None:
        data = resp.read1(len(buf))
        buf[: len(data)] = data
        return len(data)
    want = min(len(buf), resp.length)
    if want == 0:
        resp.read()  # closes the response: the connection is ready for the next request
        return 0
    k = resp.fp.readinto1(buf[:want])
    if k == 0:
        raise http.client.IncompleteRead(b"", resp.length)
    resp.length -= k
    return k
