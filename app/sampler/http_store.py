"""A static HTTP file server standing in for the remote store (``feedline serve``).

HTTP/1.1 keep-alive, ``Content-Length``, ``sendfile``, ``HEAD``. Tests give it
faults to inject per path: an HTTP status, a connection reset mid-body, a
stall, or a truncated body, so the sampler's error handling meets real sockets.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("feedline.store")


@dataclass
class Fault:
    status: int = 0  # answer with this HTTP status
    reset_after: int = -1  # send this many body bytes, then reset the connection
    stall_after: int = -1  # send this many body bytes, then stall for `stall_seconds`
    stall_seconds: float = 30.0
    truncate_to: int = -1  # send only this many bytes but close cleanly
    times: int = 1_000_000  # how many requests it applies to


class FileStore:
    """Serves ``root`` on ``host:port`` (0: a free port) until ``close()``."""

    def __init__(self, root: str, host: str = "127.0.0.1", port: int = 0):
        self.root = os.path.abspath(root)
        self.faults: dict[str, Fault] = {}
        self.requests: dict[str, int] = {}
        store = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
                path = os.path.realpath(os.path.join(store.root, rel))
                store.requests[rel] = store.requests.get(rel, 0) + 1
                fault = store.faults.get(rel)
                if fault is not None and fault.times > 0 and body:
                    fault.times -= 1
                else:
                    fault = None
                if not path.startswith(store.root + os.sep) or not os.path.isfile(path):
                    return self._status(404)
                if fault is not None and fault.status:
                    return self._status(fault.status)
                size = os.path.getsize(path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-tar")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if not body:
                    return
                with open(path, "rb") as f:
                    if fault is None:
                        self.wfile.flush()
                        offset = 0
                        while offset < size:
                            sent = os.sendfile(self.connection.fileno(), f.fileno(), offset, size - offset)
                            if sent == 0:
                                break
                            offset += sent
                        return
                    cut = max(fault.reset_after, fault.stall_after, fault.truncate_to)
                    self.wfile.write(f.read(cut))
                    self.wfile.flush()
                    if fault.stall_after >= 0:
                        time.sleep(fault.stall_seconds)
                    if fault.reset_after >= 0:
                        # linger on, 0 s: close() sends RST, as a crashed store would
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True

            def _status(self, code: int) -> None:
                msg = f"{code}\n".encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="feedline-store", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "FileStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
