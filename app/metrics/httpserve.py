"""An HTTP server that idle, trickling or too many clients cannot tie up (issue 49).

``http.server.ThreadingHTTPServer`` gives every connection a thread that waits for its request for
as long as the client likes: a client that connects and sends nothing, or one header byte a second
(slowloris), holds a thread forever, and a thousand of them hold a thousand threads. Here:

- each request's head (request line and headers) must arrive whole within ``timeout`` seconds of
  the server starting to wait for it (a fresh connection, or a kept-alive one after its last
  answer); one that does not is closed. Each write of an answer is bounded by ``timeout`` too;
- a head is at most ``MAX_HEAD_BYTES`` (past it: ``431``, closed), where ``http.server`` alone takes
  100 header lines of 64 KiB each, 6.4 MB a connection;
- at most ``max_connections`` connections hold a thread. A connection past the cap takes the slot
  of the connection that has waited longest for its request (idle or trickling: it is closed), so
  clients that hold connections open cannot lock Prometheus or a probe out; only when every slot
  is busy answering is the new connection answered ``503`` and closed, without a thread.

The server keeps one small record per live connection (at most ``max_connections``) and nothing
per request. The metrics exporter and the demo store (``feedline serve``) both use it.
"""

from __future__ import annotations

import http.client
import io
import logging
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..errors import SettingError

log = logging.getLogger("feedline.http")

DEFAULT_TIMEOUT = 10.0  # seconds a client has to send each request's head; each write is bounded by it too
DEFAULT_MAX_CONNECTIONS = 64  # connections holding a thread at once
EVICT_WAIT = 1.0  # seconds the accepting thread waits for an evicted connection's thread to end
MAX_HEAD_BYTES = 64 << 10  # bytes read from a connection while its request's head is not whole yet
CLOSE_WAIT = 5.0  # seconds close() waits for the threads still answering
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: 5\r\nRetry-After: 1\r\nConnection: close\r\n\r\nbusy\n")


class _Slot:
    """One live connection: its socket, its thread, and since when it waits for a request (None: answering)."""

    __slots__ = ("sock", "thread", "waiting_since", "evicted")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.thread: threading.Thread | None = None
        self.waiting_since: float | None = time.monotonic()
        self.evicted = False


class HeadTooLarge(http.client.HTTPException):
    """A request head past ``MAX_HEAD_BYTES``: ``http.server`` answers it 431 and closes the connection."""


class _HeadClock(io.RawIOBase):
    """The handler's socket as a raw stream whose every read is bounded by what is left of the deadline of
    the request head being read, so that bytes trickling in cannot stretch it (a per-read timeout alone
    restarts at each byte), and by what is left of ``MAX_HEAD_BYTES``."""

    def __init__(self, sock: socket.socket, handler: "BoundedHandler"):
        self._sock = sock
        self._handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        handler = self._handler
        timeout = handler.server.request_timeout
        if handler.head_deadline is not None:
            left = handler.head_deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole request within {timeout:g} s")
            self._sock.settimeout(left)
            if handler.head_bytes >= MAX_HEAD_BYTES:
                raise HeadTooLarge(f"the request's head is over {MAX_HEAD_BYTES} bytes")
            n = self._sock.recv_into(b)
            handler.head_bytes += n
            return n
        return self._sock.recv_into(b)


class BoundedHandler(BaseHTTPRequestHandler):
    """The handler base of a ``BoundedHTTPServer``: reads each request's head against its deadline and tells the
    server when a connection waits (may be evicted) and when it answers (may not)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # an answer is a head and a body written apart: no 40 ms delayed-ACK wait
    server: "BoundedHTTPServer"
    head_deadline: float | None = None  # when the head being read must be whole; None: answering
    head_bytes = 0  # bytes read from the socket since that head began

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain reader: unclosed, it would keep the socket open after close()
        self.rfile = io.BufferedReader(_HeadClock(self.connection, self))

    def handle_one_request(self) -> None:
        self.server._waiting(self.connection)
        self.head_deadline = time.monotonic() + self.server.request_timeout
        self.head_bytes = 0
        try:
            super().handle_one_request()
        except HeadTooLarge:  # in the request line (past it, parse_request answers 431 itself)
            self.requestline = self.request_version = self.command = ""
            self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)

    def parse_request(self) -> bool:
        ok = super().parse_request()  # reads the headers: the head is whole (or refused) now
        self.head_deadline = None
        self.connection.settimeout(self.server.request_timeout)  # each write of the answer
        self.server._answering(self.connection)
        return ok

    def log_message(self, format: str, *args: object) -> None:
        pass


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a deadline for each request's head and a cap on connections (the module says
    why). ``connections``, ``evicted`` and ``refused`` say what it holds and what it turned away."""

    daemon_threads = True
    request_queue_size = 128  # the kernel's queue of connections not yet accepted (socketserver's 5 drops a burst)
    block_on_close = False  # close() joins the threads it tracks itself, for a bounded time

    def __init__(self, address: tuple[str, int], handler: type[BoundedHandler], *,
                 timeout: float = DEFAULT_TIMEOUT, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 name: str = "feedline-http"):
        if not timeout > 0:
            raise SettingError("timeout", f"{timeout!r} seconds: a client needs more than 0 s to send a request; "
                                          f"give a positive number such as {DEFAULT_TIMEOUT:g}")
        if not isinstance(max_connections, int) or max_connections < 1:
            raise SettingError("max_connections", f"{max_connections!r}: at least 1 connection must be served; "
                                                  f"give a positive integer such as {DEFAULT_MAX_CONNECTIONS}")
        self.request_timeout = float(timeout)
        self.max_connections = max_connections
        self.name = name
        self.evicted = 0  # connections closed to make room while they waited for their request
        self.refused = 0  # connections answered 503 because every slot was busy answering
        self._slots: dict[socket.socket, _Slot] = {}
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        super().__init__(address, handler)

    @property
    def connections(self) -> int:
        """Connections holding a thread now (at most ``max_connections``)."""
        with self._lock:
            return len(self._slots)

    def process_request(self, request: Any, client_address: Any) -> None:
        """In the accepting thread: a slot and a thread for the connection, or a 503 without a thread."""
        with self._lock:
            if len(self._slots) >= self.max_connections and self._evict_one():
                self._freed.wait_for(lambda: len(self._slots) < self.max_connections, EVICT_WAIT)
            if len(self._slots) >= self.max_connections:
                self.refused += 1
                slot = None
            else:
                slot = self._slots[request] = _Slot(request)
        if slot is None:
            log.debug("%s: %d connections busy answering; %s answered 503", self.name, self.max_connections,
                      client_address)
            return self._refuse(request)
        slot.thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                       name=f"{self.name}-conn", daemon=True)
        try:
            slot.thread.start()
        except RuntimeError:  # no thread to be had (the process's limit): the slot and the socket go at once
            with self._lock:
                self._slots.pop(request, None)
                self._freed.notify_all()
            self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._slots.pop(request, None)
                self._freed.notify_all()

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for its request (lock held); False if all are answering."""
        waiting = [s for s in self._slots.values() if s.waiting_since is not None and not s.evicted]
        if not waiting:
            return False
        victim = min(waiting, key=lambda s: s.waiting_since)  # type: ignore[arg-type, return-value]
        victim.evicted = True
        self.evicted += 1
        try:
            victim.sock.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once; its thread closes it
        except OSError:
            pass
        return True

    def _refuse(self, request: socket.socket) -> None:
        try:
            request.setblocking(False)
            request.send(BUSY)
            request.recv(65536)  # what the client sent already: closing with it unread would reset the 503
        except OSError:
            pass
        self.shutdown_request(request)

    def _waiting(self, sock: socket.socket) -> None:
        with self._lock:
            slot = self._slots.get(sock)
            if slot is not None and not slot.evicted:
                slot.waiting_since = time.monotonic()

    def _answering(self, sock: socket.socket) -> None:
        with self._lock:
            slot = self._slots.get(sock)
            if slot is not None:
                slot.waiting_since = None

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that goes away or stalls is routine for a server facing the network: a debug line, not a
        traceback on stderr."""
        log.debug("%s: connection from %s ended with an error", self.name, client_address, exc_info=True)

    def server_close(self) -> None:
        """Stop listening, close the connections waiting for a request, give those answering ``CLOSE_WAIT`` s."""
        super().server_close()
        with self._lock:
            slots = list(self._slots.values())
            for slot in slots:
                if slot.waiting_since is not None and not slot.evicted:
                    slot.evicted = True
                    try:
                        slot.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        deadline = time.monotonic() + CLOSE_WAIT
        for slot in slots:
            if slot.thread is not None:
                slot.thread.join(max(0.0, deadline - time.monotonic()))
