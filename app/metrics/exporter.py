"""The HTTP endpoint of a feedline process: ``/metrics``, ``/healthz`` (alive), ``/readyz``.

Only the trainer process and the sampler serve metrics (no prometheus_client
multiprocess mode); worker processes report through the trainer.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .catalog import MetricDef
from .sink import PrometheusSink

log = logging.getLogger("feedline.metrics")


class MetricsPortError(RuntimeError):
    """The metrics port cannot be bound; the message names the port and the setting."""


class MetricsServer:
    """Serves one registry; ``ready()`` returns (ready, reason) for /readyz (settable once the process is up)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 ready: Callable[[], tuple[bool, str]] | None = None, setting: str = "--metrics-port"):
        self.registry = registry
        self.ready: Callable[[], tuple[bool, str]] = ready or (lambda: (True, "ok"))
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._send(200, b"ok\n")
                elif path == "/readyz":
                    ok, reason = server.ready()
                    self._send(200 if ok else 503, (reason + "\n").encode())
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortError(f"metrics port {port} on {host} is already in use: pick another with "
                                       f"{setting} (0 picks a free port)") from None
            raise MetricsPortError(f"cannot serve metrics on {host}:{port} ({exc.strerror}); set {setting}") from None
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="feedline-metrics", daemon=True)
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on http://%s:%d", self.host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Exporter:
    """What a trainer or sampler process exposes: a ``PrometheusSink`` served on ``/metrics``."""

    def __init__(self, catalog: tuple[MetricDef, ...], host: str, port: int, *,
                 const_labels: Mapping[str, str] | None = None, setting: str = "--metrics-port",
                 ready: Callable[[], tuple[bool, str]] | None = None, parts: tuple[str, ...] | None = None):
        self.sink = PrometheusSink(catalog, const_labels, parts=parts)
        self.server = MetricsServer(self.sink.registry, host, port, ready, setting=setting)

    @property
    def port(self) -> int:
        return self.server.port

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> "Exporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
