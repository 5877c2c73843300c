"""The HTTP endpoint of a feedline process: ``/metrics``, ``/healthz`` (alive), ``/readyz``.

Only the trainer process and the sampler serve metrics (no prometheus_client
multiprocess mode); worker processes report through the trainer.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .catalog import MetricDef
from .httpserve import DEFAULT_MAX_CONNECTIONS, DEFAULT_TIMEOUT, BoundedHandler, BoundedHTTPServer
from .sink import PrometheusSink

log = logging.getLogger("feedline.metrics")


class MetricsPortError(RuntimeError):
    """The metrics port cannot be bound; the message names the port and the setting."""


class MetricsServer:
    """Serves one registry; ``ready()`` returns (ready, reason) for /readyz (settable once the process is up).

    A client has ``timeout`` seconds to send each request; at most ``max_connections`` connections hold a
    thread, idle ones giving way to new ones (``httpserve.py``), so no client can lock Prometheus out."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 ready: Callable[[], tuple[bool, str]] | None = None, setting: str = "--metrics-port", *,
                 timeout: float = DEFAULT_TIMEOUT, max_connections: int = DEFAULT_MAX_CONNECTIONS):
        self.registry = registry
        self.ready: Callable[[], tuple[bool, str]] = ready or (lambda: (True, "ok"))
        self.before_scrape: Callable[[], None] = lambda: None  # a process's parts push what they hold back
        server = self

        class Handler(BoundedHandler):
            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    server.before_scrape()
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

        try:
            self._server = BoundedHTTPServer((host, port), Handler, timeout=timeout,
                                             max_connections=max_connections, name="feedline-metrics")
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortError(f"metrics port {port} on {host} is already in use: pick another with "
                                       f"{setting} (0 picks a free port)") from None
            raise MetricsPortError(f"cannot serve metrics on {host}:{port} ({exc.strerror}); set {setting}") from None
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="feedline-metrics",
                                        daemon=True)  # a close waits at most 0.1 s for the loop to notice
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
                 ready: Callable[[], tuple[bool, str]] | None = None, parts: tuple[str, ...] | None = None,
                 timeout: float = DEFAULT_TIMEOUT, max_connections: int = DEFAULT_MAX_CONNECTIONS):
        self.sink = PrometheusSink(catalog, const_labels, parts=parts)
        self.server = MetricsServer(self.sink.registry, host, port, ready, setting=setting, timeout=timeout,
                                    max_connections=max_connections)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def thread(self) -> threading.Thread:
        """The thread serving the endpoint (the trainer counts its CPU as feedline's)."""
        return self.server._thread

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> "Exporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
