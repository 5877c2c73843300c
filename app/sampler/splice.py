"""A plain-HTTP shard body moved from the socket into its file by the kernel (Linux ``splice``), never through Python.

Reading a body the usual way copies it twice: the socket's bytes into a buffer of ours (``recv``), then that
buffer into the file (``write``). On a node whose store is fast and whose cores are few (the server and the sampler
sharing two, in the bench), those copies are the fill's CPU: ``splice`` hands the socket's pages to a pipe and the
pipe's to the file, so the bytes are copied once, inside the kernel. Measured on this project's 2-core machine:
see docs/benchmarks.md's sampler section.

Only where it can be: a plain ``http:`` answer (TLS decrypts in user space) with a ``Content-Length`` (a chunked
body has framing to read), no checksum to compute (that needs the bytes), on Linux. Everything the buffered path
checks is checked here at each move: the stop, the budget, the rate cap, the speed floor, a silent socket.
"""

from __future__ import annotations

import errno
import fcntl
import http.client
import os
import select
import threading
import time
from typing import BinaryIO

from .errors import FetchAborted, FetchError, too_large
from .ratelimit import RateLimiter, SpeedFloor

PIPE_BYTES = 1 << 20  # what one splice moves at most (the pipe's size; Linux's default limit for a user: 1 MiB)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_HEAD = 1 << 16  # what the response's own buffer may hold past the headers is drained with one read this large


def can_splice(resp: http.client.HTTPResponse, tls: bool, checksum: bool) -> bool:
    """Whether ``resp``'s body can go straight from its socket into a file."""
    return hasattr(os, "splice") and not (tls or checksum or resp.chunked or resp.length is None or resp.fp is None)


def splice_body(resp: http.client.HTTPResponse, f: BinaryIO, stop: threading.Event, max_bytes: int,
                limiter: RateLimiter, floor: SpeedFloor, timeout: float) -> int:
    """The body of ``resp`` (``can_splice``) into ``f`` at its position; its size."""
    assert resp.length is not None and resp.fp is not None
    out = f.fileno()
    n = 0
    # what http.client's buffered reader already took from the socket with the headers: one read of it, no more
    head = bytearray(min(_HEAD, resp.length))
    if head:
        k = resp.fp.readinto1(head)
        if k == 0:
            raise http.client.IncompleteRead(b"", resp.length)
        n = _moved(n, k, max_bytes, limiter, stop)
        f.write(memoryview(head)[:k])
        f.flush()
        resp.length -= k
    sock = resp.fp.fileno()
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        try:
            size = fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            size = 1 << 16  # the default pipe
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        while resp.length:
            if stop.is_set():
                raise FetchAborted()
            try:
                k = os.splice(sock, w, min(size, resp.length), flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                if not poll.poll(timeout * 1000):
                    raise TimeoutError(f"the store sent nothing for {timeout:.0f} s") from None
                continue
            if k == 0:
                raise http.client.IncompleteRead(b"", resp.length)
            resp.length -= k
            n = _moved(n, k, max_bytes, limiter, stop)
            _to_file(r, out, k)
            slow = floor.moved(k, time.monotonic())
            if slow:
                raise FetchError("timeout", f"too slow: {slow}", retry=True)
    finally:
        os.close(r)
        os.close(w)
    resp.read()  # the body is done: the connection is ready for the next request
    return n


def _to_file(r: int, out: int, k: int) -> None:
    """The ``k`` bytes in the pipe into the file: spliced, or read and written where the file's filesystem takes no
    splice (the socket's side already moved them: they are not lost)."""
    while k:
        try:
            k -= os.splice(r, out, k, flags=os.SPLICE_F_MOVE)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            while k:
                data = os.read(r, k)
                k -= len(data)
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view):]


def _moved(n: int, k: int, max_bytes: int, limiter: RateLimiter, stop: threading.Event) -> int:
    n += k
    if n > max_bytes:
        raise too_large(max_bytes)
    limiter.take(k, stop)
    return n
