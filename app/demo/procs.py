"""Processes and ports of the demo, the benchmark and the tests: stop one politely (``feedline.procs``), find a
free port."""

from __future__ import annotations

import socket

from ..procs import stop_process

__all__ = ["free_port", "stop_process"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


