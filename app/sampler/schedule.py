"""When to try a failed shard again, and the store as a whole: nothing is given up while the sidecar runs.

Each shard that failed (after the fetcher's quick retries) waits before its
next try, twice as long each time, up to ``maximum`` seconds (with jitter, so
a recovering store is not hit by every shard at once). Several failures of the
store itself in a row (unreachable, timing out, 5xx) open a circuit breaker:
no fetch at all for a cool-down that also doubles up to ``maximum``; then one
fetch tries the store (half-open), and its success closes the breaker.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

BREAKER_AFTER = 3  # store failures in a row that open the breaker


@dataclass
class _Shard:
    failures: int = 0
    next_try: float = 0.0


class RetrySchedule:
    """Per-shard backoff and the store's circuit breaker; thread-safe (fetch threads report, the loop asks)."""

    def __init__(self, base: float = 1.0, maximum: float = 300.0):
        self.base = base
        self.maximum = maximum
        self._lock = threading.Lock()
        self._shards: dict[str, _Shard] = {}
        self._store_failures = 0
        self._cooldown = 0.0
        self._open_until: float | None = None  # None: closed

    def _delay(self, failures: int) -> float:
        return min(self.maximum, self.base * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)

    def failed(self, shard: str, store_down: bool, now: float, at_least: float = 0.0) -> float:
        """Record a failed shard; the seconds until it may be tried again (``at_least``: what the store asked)."""
        with self._lock:
            s = self._shards.setdefault(shard, _Shard())
            s.failures += 1
            delay = max(self._delay(s.failures), at_least)
            s.next_try = now + delay
            if store_down:
                self._store_failures += 1
                if self._store_failures >= BREAKER_AFTER or self._open_until is not None:
                    self._cooldown = min(self.maximum, max(self.base * 2, self._cooldown * 2))
                    self._open_until = now + self._cooldown
            return delay

    def succeeded(self, shard: str) -> None:
        with self._lock:
            self._shards.pop(shard, None)
            self._store_failures = 0
            self._open_until = None
            self._cooldown = 0.0

    def eligible(self, shard: str, now: float) -> bool:
        with self._lock:
            s = self._shards.get(shard)
            return s is None or s.next_try <= now

    def allow(self, now: float, in_flight: int) -> bool:
        """May a new fetch start? Not while the breaker is open; one at a time while it is half-open."""
        with self._lock:
            if self._open_until is None:
                return True
            return now >= self._open_until and in_flight == 0

    def waiting(self, now: float) -> int:
        """Shards waiting for their next try."""
        with self._lock:
            return sum(1 for s in self._shards.values() if s.next_try > now)

    def breaker_open(self, now: float) -> bool:
        with self._lock:
            return self._open_until is not None and now < self._open_until

    def describe(self, now: float) -> str:
        """The store's state for /readyz and the log."""
        with self._lock:
            waiting = sum(1 for s in self._shards.values() if s.next_try > now)
            if self._open_until is not None:
                state = (f"store failing: breaker open, next try in {self._open_until - now:.0f} s"
                         if now < self._open_until else "store failing: trying it again")
            else:
                state = "store ok"
        return state + (f", {waiting} shard(s) waiting to be tried again" if waiting else "")
