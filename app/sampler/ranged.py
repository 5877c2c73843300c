"""A large object's download in ranges: the request slots a store's downloads share, spans fetched in
parallel, and a response body streamed into its place in the file.

Used by the cloud stores (``cloud.py``); the slots keep a node's requests in flight at its fetch threads:
parts in parallel help a lone large object (the end of a list, one huge shard), while on a node whose every
fetch thread already streams an object of its own they only split the same bandwidth more ways, at a higher
cost a byte (docs/benchmarks.md, the Azurite row).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

CHUNK = 128 << 10  # what one read of a response hands over: the most of a part held in memory. Small enough to
# pass the client's socket reads through uncopied and to stay in the CPU's cache on its way to the file: 1 MiB
# chunks (gathered from the socket's reads by a copy) cost 0.2-0.3 core-s a GB more (docs/benchmarks.md)


class RequestSlots:
    """A store's GETs in flight, against a limit (its fetch threads). A download always holds one slot; its
    extra parts take only the slots left over, so they add connections where fetch threads idle and never
    where every thread already streams an object of its own."""

    def __init__(self, limit: int):
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        """The slots held now."""
        with self._lock:
            return self._held

    @contextmanager
    def held(self) -> Iterator[SlotsHeld]:
        """One slot for a download, and whatever it takes besides, all given back when it ends."""
        mine = SlotsHeld(self)
        self._change(1)
        try:
            yield mine
        finally:
            self._change(-1 - mine.extra)

    def _change(self, n: int) -> None:
        with self._lock:
            self._held += n

    def _spare(self, most: int) -> int:
        with self._lock:
            n = max(0, min(most, self.limit - self._held))
            self._held += n
            return n


class SlotsHeld:
    """What one download holds of a ``RequestSlots``."""

    def __init__(self, slots: RequestSlots):
        self._slots, self.extra = slots, 0

    def take(self, most: int) -> int:
        """Up to ``most`` more slots, as many as are free now (none is waited for)."""
        n = self._slots._spare(most)
        self.extra += n
        return n


def in_parallel(part: Callable[[tuple[int, int], threading.Event], int], spans: list[tuple[int, int]],
                workers: int) -> int:
    """``part(span, stop)`` for every span, in this thread or ``workers`` threads; the first failure stops
    the others and is raised. Returns the bytes of all spans."""
    stop = threading.Event()
    if workers <= 1:
        return sum(part(span, stop) for span in spans)
    with ThreadPoolExecutor(workers, thread_name_prefix="feedline-part") as pool:
        futures = [pool.submit(lambda span: 0 if stop.is_set() else part(span, stop), span) for span in spans]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((fu for fu in futures if fu.done() and fu.exception() is not None), None)
        if failed is not None:
            stop.set()
            for fu in futures:
                fu.cancel()
            wait(futures)
            raise failed.exception()  # type: ignore[misc]
        return sum(fu.result() for fu in futures)


def stream_into(result: Any, fd: int, offset: int, progress: Callable[[int], None],
                stop: threading.Event | None = None) -> int:
    """A GET's body written at ``offset`` of ``fd`` chunk by chunk, ``progress(n)`` after each; the bytes."""
    n = 0
    for chunk in result.stream(min_chunk_size=CHUNK):
        if stop is not None and stop.is_set():
            break
        view = memoryview(chunk)
        while view:
            done = os.pwrite(fd, view, offset + n)
            n += done
            view = view[done:]
        progress(len(chunk))
    return n
