"""Processes and ports of the demo, the benchmark and the tests: stop one politely, find a free port."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess

log = logging.getLogger("feedline.demo")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, name: str = "process", timeout: float = 10.0,
                 sig: int = signal.SIGTERM) -> int:
    """Send ``sig`` (SIGTERM: what Docker and Kubernetes send), wait, SIGKILL after ``timeout``; the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s of %s; killing it", name, timeout, signal.Signals(sig).name)
            proc.kill()
            proc.wait()
    return proc.returncode
