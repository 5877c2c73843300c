"""A worker's two pipes: commands from the trainer, results back to it.

One pipe each way, not a socket pair: the trainer writes a fill and reads a result on the training
process's own thread (``next()``), often after a step long enough to leave its caches cold, and there a
pipe's ``write``/``read`` cost a fraction of a socket's ``send``/``recv`` (measured: 6–18 µs against
41–51 µs for the first call after a 33 ms sleep; docs/benchmarking.md). The trainer's ends never block;
the worker's are a ``multiprocessing`` ``Connection`` each, framed the same way.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import NamedTuple


class TrainerEnds(NamedTuple):
    """The trainer's ends, both non-blocking: it reads ``results`` and writes ``commands``."""

    results: int
    commands: int


class WorkerEnds(NamedTuple):
    """The worker's ends, inherited at these numbers: it reads ``commands`` and writes ``results``."""

    commands: int
    results: int


def worker_pipes() -> tuple[TrainerEnds, WorkerEnds]:
    """Two new pipes (close-on-exec: a worker inherits only the ends handed to it)."""
    commands_r, commands_w = os.pipe()
    results_r, results_w = os.pipe()
    os.set_blocking(commands_w, False)
    os.set_blocking(results_r, False)
    return TrainerEnds(results_r, commands_w), WorkerEnds(commands_r, results_w)


class Duplex:
    """The worker's ends as one connection: what a ``Connection`` over a socket pair offered it."""

    def __init__(self, ends: WorkerEnds):
        self._rx = Connection(ends.commands, writable=False)
        self._tx = Connection(ends.results, readable=False)

    def send_bytes(self, buf: bytes) -> None:
        self._tx.send_bytes(buf)

    def recv_bytes(self) -> bytes:
        return self._rx.recv_bytes()

    def poll(self, timeout: float = 0.0) -> bool:
        """A command is waiting (or the trainer is gone), within ``timeout`` seconds."""
        return self._rx.poll(timeout)

    def fileno(self) -> int:
        """The commands' end: what ``select`` waits on for the next command."""
        return self._rx.fileno()
