"""A stalled worker's Python stacks, asked for by signal and read from the pipe its faulthandler writes to.

The supervisor logs them before it kills the worker, so a stall names the line it hung on (a network
filesystem read, a transform waiting on a lock) instead of only "stalled".
"""

from __future__ import annotations

import os
import signal
import time

from .launch import WorkerProcess
from .messages import STACK_SIGNAL

STACK_WAIT = 1.0  # seconds a stalled worker gets to write its stack before it is killed


def read_stack(process: WorkerProcess, stack_r: int) -> str:
    """Every thread's stack of ``process``, read from ``stack_r`` (non-blocking) until it has been quiet 0.1 s."""
    if not process.is_alive():
        return ""
    try:
        os.kill(process.pid, STACK_SIGNAL)
        os.kill(process.pid, signal.SIGCONT)  # a stopped process handles the signal once continued
    except ProcessLookupError:
        return ""
    chunks: list[bytes] = []
    deadline = time.monotonic() + STACK_WAIT
    quiet_until = None
    while time.monotonic() < deadline:
        try:
            chunk = os.read(stack_r, 65536)
        except BlockingIOError:
            chunk = b""
        if chunk:
            chunks.append(chunk)
            quiet_until = time.monotonic() + 0.1
        elif quiet_until is not None and time.monotonic() > quiet_until:
            break
        else:
            time.sleep(0.01)
    return b"".join(chunks).decode("utf-8", "replace").rstrip()
