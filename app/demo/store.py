"""A static HTTP file server standing in for the remote store (``feedline serve``).

HTTP/1.1 keep-alive, ``Content-Length``, ``sendfile``, ``HEAD``. Tests give it
faults to inject per path (an HTTP status with ``Retry-After``, a connection
reset mid-body, a stall before or during the answer, a body dripped slowly, a
truncated body, a chunked body without a length), a whole-store outage (``down``) and a required auth header, so
the sampler's error handling meets real sockets. Clients of the network cannot tie it up: each request's head
must arrive within ``timeout``, at most ``max_connections`` connections hold a thread (``metrics/httpserve.py``),
and what it counts per path is capped at ``max_paths`` paths.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ..metrics.httpserve import BoundedHandler, BoundedHTTPServer

LOG_REQUESTS = 1000  # requests the store remembers at least (tests read them), and at most twice as many
TIMEOUT = 60.0  # seconds a client has to send each request's head (nginx's client_header_timeout), and idles
MAX_CONNECTIONS = 128  # connections holding a thread: 64 fetch threads of a sidecar and more
MIN_CLIENT_RATE = 64 << 10  # bytes/s a client must read at, over FLOOR_WINDOW, to keep its connection (and slot)
FLOOR_WINDOW = 30.0  # seconds: a slow minute on a real link passes, a client reading a byte a minute does not
OTHER_PATHS = "<other paths>"  # where `requests` counts paths past `max_paths`

log = logging.getLogger("feedline.store")


@dataclass
class Fault:
    """A failure the stand-in store injects for one path (status, reset, stall, truncation)."""

    status: int = 0  # answer with this HTTP status
    reset_after: int = -1  # send this many body bytes, then reset the connection
    stall_after: int = -1  # send this many body bytes, then stall for `stall_seconds`
    stall_seconds: float = 30.0
    truncate_to: int = -1  # send only this many bytes but close cleanly
    stall_before: float = 0.0  # wait this long before answering at all
    drip: float = 0.0  # send the body at this many bytes/s
    retry_after: str = ""  # a Retry-After header with the status
    chunked: bool = False  # send the body with Transfer-Encoding: chunked, no Content-Length
    times: int = 1_000_000  # how many requests it applies to


class FileStore:
    """Serves ``root`` on ``host:port`` (0: a free port) until ``close()``."""

    max_paths = LOG_REQUESTS  # distinct paths `requests` counts one by one; the rest under OTHER_PATHS

    def __init__(self, root: str, host: str = "127.0.0.1", port: int = 0, remember: bool = True, *,
                 timeout: float = TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                 min_client_rate: float = MIN_CLIENT_RATE, floor_window: float = FLOOR_WINDOW):
        self.root = os.path.abspath(root)
        # a client reading a shard slower than this over a window gives its connection back (the sampler's own
        # fetch_min_mbps, the other way round): no reader holds one of max_connections slots as long as it likes
        self.min_client_rate, self.floor_window = min_client_rate, floor_window
        self.too_slow = 0  # connections closed for reading below the floor
        # `feedline serve` runs it as a process of its own, whose log nobody can read: it keeps none
        self.remembers = remember
        self.faults: dict[str, Fault] = {}
        self.requests: dict[str, int] = {}  # requests per path: a client choosing paths cannot grow it past max_paths
        # (monotonic time, method, path, status) of the last LOG_REQUESTS to 2 x LOG_REQUESTS requests: a store
        # serving for weeks must not keep every one. A list (trimmed in halves), not a deque: tests iterate it
        # while handler threads append, which a deque refuses
        self.log: list[tuple[float, str, str, int]] = []
        self.down = 0  # answer every request with this status (an outage) while non-zero
        self.auth: str | None = None  # the Authorization header value every request must carry
        store = self

        class Handler(BoundedHandler):
            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
                path = os.path.realpath(os.path.join(store.root, rel))
                store.count(rel)
                fault = store.faults.get(rel)
                if fault is not None and fault.times > 0 and fault.stall_before:
                    time.sleep(fault.stall_before)  # HEAD too: a store that does not answer at all
                if fault is not None and fault.times > 0 and body:
                    fault.times -= 1
                else:
                    fault = None
                if store.down:
                    return self._status(store.down, rel)
                if store.auth is not None and self.headers.get("Authorization") != store.auth:
                    return self._status(401, rel)
                if not path.startswith(store.root + os.sep) or not os.path.isfile(path):
                    return self._status(404, rel)
                if fault is not None and fault.status:
                    return self._status(fault.status, rel, fault.retry_after)
                size = os.path.getsize(path)
                store.remember((time.monotonic(), self.command, rel, 200))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-tar")
                if fault is not None and fault.chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    return self._chunked(path)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if not body:
                    return
                with open(path, "rb") as f:
                    if fault is None:
                        self.wfile.flush()
                        return self._send(f, rel, size)
                    if fault.drip:
                        return self._drip(f, fault.drip)
                    cut = max(fault.reset_after, fault.stall_after, fault.truncate_to)
                    self.wfile.write(f.read(cut))
                    self.wfile.flush()
                    if fault.stall_after >= 0:
                        time.sleep(fault.stall_seconds)
                    if fault.reset_after >= 0:
                        # linger on, 0 s: close() sends RST, as a crashed store would
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True

            def _send(self, f: Any, rel: str, size: int) -> None:
                """``os.sendfile`` the whole file, waiting on the socket at most to each window's end: at every
                ``floor_window`` seconds, a client that read less than ``min_client_rate`` bytes/s over it has its
                connection closed (its slot given back); one that reads nothing for ``timeout`` too, as before."""
                sock = self.connection
                timeout = sock.gettimeout()
                sent, window_start, window_bytes, last_moved = 0, time.monotonic(), 0, time.monotonic()
                sock.setblocking(False)
                try:
                    while sent < size:
                        now = time.monotonic()
                        if store.min_client_rate and now - window_start >= store.floor_window:
                            rate = window_bytes / (now - window_start)
                            if rate < store.min_client_rate:
                                store.too_slow += 1
                                log.info("%s: a client read at %.0f B/s over %.0f s, below the floor of %.0f B/s: "
                                         "its connection closed", rel, rate, now - window_start, store.min_client_rate)
                                # reset, not a close that would first drain what its buffers hold at that rate
                                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                                self.close_connection = True
                                return
                            window_start, window_bytes = now, 0
                        if timeout is not None and now - last_moved > timeout:
                            raise TimeoutError(f"the client read nothing for {timeout:g} s")
                        wait = window_start + store.floor_window - now if store.min_client_rate else timeout
                        if not select.select([], [sock], [], max(0.01, min(wait or 1.0, timeout or 1.0)))[1]:
                            continue
                        try:
                            moved = os.sendfile(sock.fileno(), f.fileno(), sent, min(size - sent, 1 << 22))
                        except BlockingIOError:
                            continue
                        if moved == 0:
                            return  # the file got shorter under us: the client sees a short body
                        sent, window_bytes, last_moved = sent + moved, window_bytes + moved, time.monotonic()
                finally:
                    sock.settimeout(timeout)

            def _chunked(self, path: str) -> None:
                with open(path, "rb") as f:
                    while chunk := f.read(50_000):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def _drip(self, f: "object", rate: float) -> None:
                step = max(1, int(rate / 10))
                try:
                    while chunk := f.read(step):  # type: ignore[attr-defined]
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        time.sleep(0.1)
                except OSError:
                    pass
                self.close_connection = True

            def _status(self, code: int, rel: str, retry_after: str = "") -> None:
                store.remember((time.monotonic(), self.command, rel, code))
                msg = f"{code}\n".encode()
                self.send_response(code)
                if retry_after:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)

        self._server = BoundedHTTPServer((host, port), Handler, timeout=timeout, max_connections=max_connections,
                                         name="feedline-store")
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="feedline-store",
                                        daemon=True)  # a close waits at most 0.1 s for the loop to notice
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def count(self, rel: str) -> None:
        """One more request for ``rel``; a path past the first ``max_paths`` counts under ``OTHER_PATHS``."""
        key = rel if rel in self.requests or len(self.requests) < self.max_paths else OTHER_PATHS
        self.requests[key] = self.requests.get(key, 0) + 1

    def remember(self, entry: tuple[float, str, str, int]) -> None:
        if not self.remembers:
            return
        self.log.append(entry)
        if len(self.log) >= 2 * LOG_REQUESTS:
            del self.log[:LOG_REQUESTS]  # a reader iterating meanwhile sees a shorter list, never an error

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "FileStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
