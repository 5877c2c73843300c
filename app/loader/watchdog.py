"""Heartbeats of the loader's threads, so a wait in the hand-off ends with the stage named, never silently.

The dispatcher thread beats once per loop (at least every second) and says what it is doing when it
starts something that could block (starting or stopping a worker, reading a worker's stack); a transfer
thread says which batch it is copying. A thread that waits for them — the training loop in ``next()``,
a transfer thread taking a slot — reads the heartbeat when its own wait runs out: past ``stall_timeout``
it raises a ``LoaderError`` that names the stage and what it was doing, and logs that thread's stack.

A heartbeat must also stay stale for ``GRACE`` seconds while it is watched: after the whole process was
stopped (Ctrl-Z then ``fg``, a debugger) every clock looks old, and the thread beats again at once.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

from .errors import LoaderError

log = logging.getLogger("feedline.loader")

GRACE = 2.0  # seconds a stale heartbeat must stay stale while watched (the dispatcher beats every second)
STALL_HINT = ("If that stage is only slow here (a heavy import or a busy node), raise stall_timeout "
              "(FEEDLINE_STALL_TIMEOUT, --stall-timeout); docs/troubleshooting.md says more")


class Heartbeat:
    """One thread's last sign of life and what it has been doing since (plain attributes: a torn read is harmless)."""

    def __init__(self, stage: str):
        self.stage = stage
        self.thread: threading.Thread | None = None
        self.at = time.monotonic()
        self.doing = ""
        self.busy = False  # a transfer thread between taking a batch and handing it over
        self._stale_since: float | None = None  # when a watcher first saw it past the bound

    def beat(self, doing: str = "", busy: bool = False) -> None:
        self.at, self.doing, self.busy = time.monotonic(), doing, busy

    def age(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.at

    def stalled(self, bound: float, now: float | None = None) -> LoaderError | None:
        """The error for this stage if it has not beaten for ``bound`` seconds, and not within ``GRACE`` of being
        seen so (its stack logged), else None."""
        now = time.monotonic() if now is None else now
        age = self.age(now)
        if age <= bound:
            self._stale_since = None
            return None
        if self._stale_since is None or self._stale_since < self.at:
            self._stale_since = now
        if now - self._stale_since < GRACE:
            return None
        doing = f"it is {self.doing}" if self.doing else "it stopped between two steps"
        log.error("%s has not answered for %.0f s; its stack:\n%s", self.stage, age, thread_stack(self.thread))
        return LoaderError(f"{self.stage} has not answered for {age:.0f} s (stall_timeout={bound:g} s): {doing}; "
                           f"its stack is in the log. {STALL_HINT}")


def thread_stack(thread: threading.Thread | None) -> str:
    """The Python stack of another thread of this process, as faulthandler would print it."""
    frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident is not None else None
    if frame is None:
        return "(the thread is gone)"
    return "".join(traceback.format_stack(frame)).rstrip()


class BoundedLock:
    """A lock taken for at most ``bound`` seconds; then ``blame()`` raises for the stage that holds it, or a
    generic ``LoaderError`` is raised. A plain object, not a generator: it is taken once per batch."""

    __slots__ = ("_lock", "_bound", "_blame")

    def __init__(self, lock: threading.Condition, bound: float, blame: Callable[[], None]):
        self._lock = lock
        self._bound = bound
        self._blame = blame

    def __enter__(self) -> None:
        if not self._lock.acquire(timeout=self._bound):
            self.timed_out()

    def timed_out(self) -> None:
        """Raise for a lock not had within the bound: the stage that holds it, or a generic ``LoaderError``."""
        self._blame()
        raise LoaderError(f"the worker pool's lock was held for over {self._bound:g} s (stall_timeout). "
                          f"{STALL_HINT}")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
