"""A large object's download in ranges: spans fetched in parallel, each response body streamed into its
place in the file (the cloud stores', ``cloud.py``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

CHUNK = 128 << 10  # what one read of a response hands over: the most of a part held in memory. Small enough to
# stay in the CPU's cache on its way to the file: 1 MiB chunks (gathered from the socket's reads by a copy) cost
# 0.2-0.3 core-s a GB more, 16 KiB ones more Python a byte (docs/sidecar.md, GCS and Azure)


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
