"""The loader's view of a cache directory: the shards its manifest lists when an epoch starts."""

from __future__ import annotations

import logging
import os
import time

from collections.abc import Callable, Sequence

from .manifest import SHARDS_DIR, Manifest, read_manifest, shard_path, split_name
from .ownership import CacheDirError, check_cache_dir
from .readers import READERS_DIR, TOUCH_EVERY, remove_reader, touch_reader, write_reader

log = logging.getLogger("feedline.cache")


class CacheWaitTimeout(TimeoutError):
    """The cache did not reach ``min_shards`` in time; the message says what to check."""


class CacheWaitAborted(RuntimeError):
    """The wait for the cache ended early: what filled it stopped (the message says why)."""


class CacheSource:
    """A ``ShardSource`` over a cache directory filled by the sampler sidecar.

    It reports each epoch start (``readers/<rank>.json``) so the sampler can
    grow the cache, and can wait for the cache to hold a minimum of shards.
    """

    growing = True

    def __init__(self, cache_dir: str | os.PathLike):
        self.cache_dir = os.fspath(cache_dir)
        self.generation = -1
        self.counts: dict[str, int] = {}  # samples per shard of the last snapshot, from the manifest
        self.complete = False  # the last snapshot holds every shard of the sampler's source
        self._touched = 0.0  # when this process last renewed its reader lease (monotonic)
        self._lease: tuple[int, int, list[str]] | None = None  # (epoch, generation, ids) of the last lease written

    def manifest(self) -> Manifest | None:
        """The published manifest; None before the sampler made the cache. A cache that is not this user's
        (``ownership.py``) is a ``CacheDirError``: its shards are never read, nor its ``readers/`` written."""
        if not check_cache_dir(self.cache_dir, (SHARDS_DIR, READERS_DIR)):
            return None
        try:
            return read_manifest(self.cache_dir)
        except FileNotFoundError:
            return None

    def snapshot(self) -> list[str]:
        manifest = self.manifest()
        if manifest is None:
            return []
        self.generation = manifest.generation
        self.complete = manifest.complete
        self.counts = {shard_path(self.cache_dir, s.id, s.format): s.samples for s in manifest.shards}
        return list(self.counts)

    def epoch_started(self, rank: int, epoch: int, shards: Sequence[str]) -> None:
        """The reader file and its lease: the sampler keeps these shards on disk while the lease is fresh."""
        mine = os.path.realpath(os.path.join(self.cache_dir, SHARDS_DIR))
        folders: dict[str, bool] = {}  # a plan from a checkpoint may spell the cache's path another way

        def in_this_cache(path: str) -> bool:
            d = os.path.dirname(path)
            if d not in folders:
                folders[d] = os.path.realpath(d) == mine
            return folders[d]

        names = [split_name(os.path.basename(p)) for p in shards if in_this_cache(p)]
        ids = [n[0] for n in names if n is not None]
        write_reader(self.cache_dir, rank, epoch, self.generation, ids)
        self._lease = (epoch, self.generation, ids)
        self._touched = time.monotonic()

    def reading(self, rank: int) -> None:
        """Batches go out: the lease is renewed (at most every TOUCH_EVERY seconds) — written again if the sidecar
        removed it as stale meanwhile (a pause longer than ``reader_lease``: an evaluation, a long checkpoint)."""
        if time.monotonic() - self._touched >= TOUCH_EVERY:
            if not touch_reader(self.cache_dir, rank) and self._lease is not None:
                epoch, generation, ids = self._lease
                log.info("the reader lease of rank %d in %s had gone stale and was removed; renewed", rank,
                         self.cache_dir)
                write_reader(self.cache_dir, rank, epoch, generation, ids)
            self._touched = time.monotonic()

    def released(self, rank: int) -> None:
        """The loader closed with its epoch read to its end: its reader files go, so the sampler keeps nothing
        for it. (A loader closed mid-epoch — a preemption that saved a checkpoint — keeps its lease until it goes
        stale: the resumed epoch finds its shards.)"""
        remove_reader(self.cache_dir, rank)

    def wait_for(self, min_shards: int, timeout: float,
                 abort: Callable[[], str | None] | None = None, reason: str = "") -> list[str]:
        """The snapshot once it holds ``min_shards``, or the whole source when that is fewer; a clear error after
        ``timeout`` seconds, or as soon as ``abort()`` gives a reason (the sidecar filling it has exited).
        ``reason``: why that many (the error says it instead of the ``min_shards`` setting)."""
        deadline = time.monotonic() + timeout
        why = ""
        while True:
            stopped = abort() if abort is not None else None
            if stopped:
                raise CacheWaitAborted(stopped)
            try:
                shards = self.snapshot()
            except CacheDirError:
                raise
            except ValueError as exc:  # a corrupt manifest: the sampler rebuilds it (said if it never does)
                shards, why = [], f" (its manifest: {exc})"
            if len(shards) >= min_shards:
                return shards
            if shards and self.complete:
                log.info("cache %s holds the whole source, %d shard(s): fewer than min_shards=%d, and no more "
                         "will come; starting", self.cache_dir, len(shards), min_shards)
                return shards
            if time.monotonic() >= deadline:
                raise CacheWaitTimeout(
                    f"cache {self.cache_dir} holds {len(shards)} shard(s){why} after {timeout:.0f} s, fewer than "
                    + (f"{min_shards}: {reason}" if reason else f"min_shards={min_shards}: is `feedline sample` "
                       f"running and filling it (its /readyz says when)? Raise wait_timeout (FEEDLINE_WAIT_TIMEOUT) or "
                       f"lower min_shards (FEEDLINE_MIN_SHARDS)")
                )
            time.sleep(0.2)

    def describe(self) -> str:
        return f"cache {self.cache_dir}"
