"""The memory ceiling of the decode workers (``worker_memory``), watched from the trainer.

What counts is a worker's private resident memory: ``/proc/<pid>/statm``'s resident
pages less its shared ones, i.e. its anonymous memory (``RssAnon``: the Python heap,
numpy arrays, tensors, malloc arenas). Pages of files (the interpreter's and torch's
libraries, the mmapped shards) and of shared memory (the batch ring, which a worker
touches as it writes batches) are shared pages: they do not count, so the ceiling
holds whatever the ring's or the shards' sizes.

The check runs in the trainer, not in the worker: a transform that allocates in one
C call holding its GIL would starve a watchdog thread inside the worker. A thread
polls every ``POLL`` seconds (the dispatcher's own wait, up to a second, is too
coarse for an allocation running at GB/s) and SIGKILLs a worker above the ceiling;
the dispatcher then sees that death as it sees any crash, and the supervisor asks
``killed()`` whether it was this one's doing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from .launch import WorkerProcess

log = logging.getLogger("feedline.loader")

POLL = 0.05  # seconds between two readings of every worker
_PAGE = os.sysconf("SC_PAGE_SIZE")


def private_resident(pid: int) -> int | None:
    """Bytes of private resident memory of ``pid`` (resident less shared pages), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            fields = f.read().split()
    except OSError:
        return None
    return (int(fields[1]) - int(fields[2])) * _PAGE


def mib(n: int) -> str:
    """Bytes as whole MiB, as ``worker_memory`` is written in the log."""
    return f"{n / (1 << 20):.0f} MiB"


def over_ceiling(ceiling: int, held: int, doing: str) -> tuple[str, str, str]:
    """(what happened, where, the fix) for the supervisor's log line and error about a worker killed here."""
    return (f"passed its memory ceiling worker_memory={mib(ceiling)}",
            f" ({mib(held)} private resident)" + (f" while {doing}" if doing else ""),
            "a worker needs more than that to decode this data: raise worker_memory (0: no ceiling)")


class MemoryWatcher:
    """Kills workers whose private resident memory passes ``ceiling`` bytes; remembers which, and at how much.

    ``workers()`` lists the live worker processes as (index, process); it is called under ``lock``, the
    lock under which the supervisor drops a process before closing it, and a kill happens under that
    lock too, to a process still listed and alive: never to one being closed, nor to a reused pid (the
    kill goes through the process's pidfd where the kernel has them).
    """

    def __init__(self, ceiling: int, workers: Callable[[], list[tuple[int, WorkerProcess]]],
                 lock: threading.Lock, poll: float = POLL):
        self.ceiling = ceiling
        self._workers = workers
        self._lock = lock
        self._poll = poll
        self._killed: dict[WorkerProcess, int] = {}  # under lock: killed here -> the bytes it held then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feedline-memory", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop watching; with ``wait``, once the thread has ended (any thread but the watcher's)."""
        self._stop.set()
        if wait and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def killed(self, proc: WorkerProcess) -> int | None:
        """The bytes ``proc`` held when it was killed here for passing the ceiling, or None if it was not.

        Asked once a process is no longer listed by ``workers()`` (so it cannot be killed any more).
        """
        with self._lock:
            return self._killed.pop(proc, None)

    def _run(self) -> None:
        failed = 0
        while not self._stop.wait(self._poll):
            try:
                self.check()
            except Exception:  # never end silently: the next poll tries again; logged once a minute at most
                failed += 1
                if failed % int(60 / self._poll) == 1:
                    log.exception("the worker memory watcher failed (%d time(s) so far)", failed)

    def check(self) -> None:
        """Read every worker's private resident memory once; kill those above the ceiling."""
        with self._lock:
            workers = self._workers()
        over = []
        for index, proc in workers:  # read without the lock: a sender waits on it
            used = private_resident(proc.pid)
            if used is not None and used > self.ceiling:
                over.append((index, proc, used))
        if not over:
            return
        with self._lock:
            listed = dict(self._workers())
            for index, proc, used in over:
                # alive and unreaped since it was read: the pid was its own all along
                if listed.get(index) is proc and proc.is_alive():
                    self._killed[proc] = used  # before the signal: the dispatcher may see the death at once
                    proc.kill()
                    log.debug("worker %d (pid %d) holds %s private resident, over worker_memory=%s: killed",
                              index, proc.pid, mib(used), mib(self.ceiling))
