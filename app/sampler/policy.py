"""How many shards to fetch, and when (DESIGN.md, Growth policy), and in which order.

``grow``: an initial set; at each new loader epoch, ``grow_shards`` more until
the budget is full; then, per epoch, replacements for a fraction of the oldest
shards (a fetched shard evicts the oldest to fit), so variance keeps arriving.
``fill``: fetch until the budget is full, then replace one shard at a time at
``refresh_per_minute``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from .sources import SourceShard


def shard_plan(shards: list[SourceShard], seed: int) -> Iterator[SourceShard]:
    """Random without replacement, round after round, seeded: the same seed gives the same plan."""
    round_ = 0
    while True:
        order = list(shards)
        random.Random(f"feedline-plan:{seed}:{round_}").shuffle(order)
        yield from order
        round_ += 1


class Policy:
    """How many shards to fetch, asked at start, at each loader epoch and on every turn."""

    def initial(self, cached: int) -> int:
        """Fetches to start with, given the shards already cached."""
        raise NotImplementedError

    def on_epoch(self, epoch: int, cached: int, full: bool) -> int:
        """Fetches to add when a loader starts a new epoch."""
        return 0

    def keep_busy(self, full: bool, now: float, busy: int) -> int:
        """Fetches to add on a turn of the loop, given ``busy`` fetches pending or running."""
        return 0


class GrowPolicy(Policy):
    """Grow the cache epoch by epoch, then replace a fraction of the oldest per epoch."""

    def __init__(self, initial_shards: int, grow_shards: int, replace_fraction: float):
        self.initial_shards = initial_shards
        self.grow_shards = grow_shards
        self.replace_fraction = replace_fraction

    def initial(self, cached: int) -> int:
        return max(0, self.initial_shards - cached)

    def on_epoch(self, epoch: int, cached: int, full: bool) -> int:
        if not full:
            return self.grow_shards
        return math.ceil(self.replace_fraction * cached) if self.replace_fraction > 0 else 0


class FillPolicy(Policy):
    """Fill to the budget as fast as allowed, then replace shards at a steady rate."""

    def __init__(self, fetch_threads: int, refresh_per_minute: float):
        self.fetch_threads = fetch_threads
        self.interval = 60.0 / refresh_per_minute if refresh_per_minute > 0 else math.inf
        self._next_refresh: float | None = None

    def initial(self, cached: int) -> int:
        return 0

    def keep_busy(self, full: bool, now: float, busy: int) -> int:
        if not full:
            self._next_refresh = None
            return max(0, self.fetch_threads - busy)
        if self._next_refresh is None:
            self._next_refresh = now + self.interval
            return 0
        if now >= self._next_refresh:
            self._next_refresh += self.interval
            return 1
        return 0
