"""Stopping a child process politely (imports nothing of ``app``): the library's face stops the sidecar it
owns this way, and the tools (demo, bench, tests) every server they start."""

from __future__ import annotations

import logging
import signal
import subprocess

log = logging.getLogger("feedline")


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
