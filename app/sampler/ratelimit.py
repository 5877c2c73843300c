"""A bandwidth cap shared by every fetch thread, so the sidecar does not starve the trainer's network."""

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
