"""A bandwidth cap shared by every fetch thread, so the sidecar does not starve the trainer's network; and the
speed floor under which one transfer is given up."""

from __future__ import annotations

import threading
import time


class RateLimiter:
    """A token bucket shared by all fetch threads; ``bytes_per_s`` 0 means no cap."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._last = time.monotonic()

    def take(self, n: int, stop: threading.Event) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            debt = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if debt > 0:
            stop.wait(debt)


class SpeedFloor:
    """curl's ``--speed-limit``/``--speed-time`` for one transfer: fewer than ``min_rate`` bytes/s over a window of
    ``window`` seconds is too slow — never while the shared cap (``limiter``) slows it on purpose."""

    def __init__(self, min_rate: float, window: float, limiter: RateLimiter):
        self.min_rate = min_rate
        self.window = window
        self.limiter = limiter
        self._start = time.monotonic()
        self._bytes = 0

    def moved(self, n: int, now: float) -> str | None:
        """``n`` more bytes moved by ``now``; at a window's end, what was too slow about it (else None)."""
        self._bytes += n
        elapsed = now - self._start
        if elapsed < self.window:
            return None
        rate = self._bytes / elapsed
        self._start, self._bytes = now, 0
        if self.min_rate > 0 and rate < self.min_rate and not self.limiter.rate:
            return f"{rate:.0f} B/s over {elapsed:.0f} s, below the floor of {self.min_rate:.0f} B/s (fetch_min_mbps)"
        return None
