"""The consumers' waits for a batch: on the worker pipes that will carry it, never on the dispatcher.

A consumer (the training loop's ``next()``, a transfer thread) that finds no batch ready blocks in one
``select`` on the pipe of the worker whose batch comes next and on an eventfd of its own; the worker's
result wakes it directly, so a batch costs the training process at most that one wake-up, and none when
the loop arrives after the batch. The dispatcher, which no longer reads results as they come, ends those
waits early (``wake``) only when what they wait on changed: a worker replaced, an epoch started, an
error, a result it read itself, the loader closing.
"""

from __future__ import annotations

import os
import select
import threading

from ..cost import TrainerCost


class Waiters:
    """One eventfd per consumer thread (made at its first wait, closed with the pool) and the waits on them."""

    def __init__(self, cost: TrainerCost):
        self._cost = cost
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # thread ident -> its eventfd
        self._closed = False

    def _mine(self) -> int:
        me = threading.get_ident()
        fd = self._fds.get(me)
        if fd is None:
            with self._lock:
                if self._closed:
                    return -1
                fd = self._fds[me] = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return fd

    def wait(self, pipes: list[int], timeout: float) -> bool:
        """Block until one of ``pipes`` is readable, ``wake()`` is called, or ``timeout``; True if woken."""
        mine = self._mine()
        fds = [fd for fd in pipes if fd >= 0]
        if mine >= 0:
            fds.append(mine)
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except (OSError, ValueError):  # a pipe closed under us (its worker replaced): look again
            return True
        if not ready:
            return False
        self._cost.woken()
        if mine in ready:
            with self._lock:
                if not self._closed:
                    try:
                        os.eventfd_read(mine)
                    except BlockingIOError:
                        pass
        return True

    def wake(self) -> None:
        """End every consumer's wait now (any thread)."""
        with self._lock:
            if self._closed:
                return
            for fd in self._fds.values():
                os.eventfd_write(fd, 1)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)
