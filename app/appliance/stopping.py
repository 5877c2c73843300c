"""How ``feedline train`` takes SIGTERM (Kubernetes' eviction, ``docker stop``): at any moment, exit 0.

Before the loader has started, a SIGTERM ends the start-up at once (``Stopped``:
nothing was trained, nothing needs saving; a loader half built cleans up as on any
exception). Once training runs, it only asks: the loop finishes its step, every rank
stops at the same step, the checkpoint is saved, and the job exits 0. After the run
SIGTERM is ignored, so the interpreter's teardown cannot end it by the signal. The
one moment it cannot help is before Python runs the first line of feedline
(interpreter start-up, a fraction of a second): the process ends by the signal
(exit code 143; -15 as Python's ``subprocess`` reports it), having written nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Stopped(BaseException):
    """A SIGTERM during start-up: a BaseException, so no ``except Exception`` on the way swallows it."""


class StopSignal:
    """Installed first thing; ``event`` is what the training loop polls."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._raising = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.event.set()
        if self._raising:
            self._raising = False
            raise Stopped

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Within the block a SIGTERM (or one already received) raises ``Stopped``."""
        if self.event.is_set():
            raise Stopped
        self._raising = True
        try:
            yield
        finally:
            self._raising = False

    def close(self) -> None:
        """The run is over (saved or failed): SIGTERM is ignored from here to the process's end."""
        self._raising = False
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
