"""What feedline spends inside the training process: the cost the starvation figure cannot show.

On a GPU the loop that launches kernels is often the bottleneck itself, so every wake-up of one of
feedline's threads (it must take the GIL), every CUDA call on the loop's thread and every CPU
microsecond feedline spends there slows the step even when no batch is late (DESIGN.md, "The
training process's share"). The budget a batch: at most 0.25 ms of CPU in all of feedline's threads
together, at most 2 cross-thread wake-ups, no CUDA object created or destroyed, no host-device
synchronisation, at most 3 CUDA calls on the loop's thread. These counters measure each of them;
the tests assert them, the bench reports them, and the CPU seconds become
``feedline_trainer_cpu_seconds_total{thread}``.

Counts are kept per thread (each thread adds to its own entry: no lock, no lost update) and summed
when read. A thread's CPU is read from its own clock (``pthread_getcpuclockid``); the loop's thread is
the user's, so only its time inside ``next()`` counts.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

# Labels of feedline_trainer_cpu_seconds_total{thread}: the loop's next(), the dispatcher, transfer threads,
# the rest (the memory watcher, the metrics server of StagingLoader(metrics_port=)).
THREAD_ROLES = ("loop", "dispatcher", "transfer", "other")


@dataclass(frozen=True)
class CostSnapshot:
    """Totals since the loader started; ``per_batch`` divides them by the batches handed to the loop."""

    batches: int = 0
    cpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(THREAD_ROLES, 0.0))
    wakeups: int = 0
    device_calls_loop: int = 0  # device (CUDA) calls made on the loop's thread, inside next()
    device_calls: int = 0  # by every thread
    device_objects: int = 0  # streams, events and buffers made after start-up
    host_syncs: int = 0  # blocking waits of a host thread on the device
    standin_seconds: float = 0.0  # the stand-in device's copies: a GPU's copy engine's work, not in cpu_seconds

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu_seconds.values())

    def per_batch(self) -> dict[str, float]:
        """Each figure a batch (CPU in seconds); zeros before the first batch."""
        n = max(1, self.batches)
        return {"cpu_seconds": self.cpu_total / n, "wakeups": self.wakeups / n, "standin_seconds": self.standin_seconds / n,
                "device_calls_loop": self.device_calls_loop / n, "device_calls": self.device_calls / n,
                "device_objects": self.device_objects / n, "host_syncs": self.host_syncs / n,
                **{f"cpu_{role}": s / n for role, s in self.cpu_seconds.items()}}

    def since(self, before: "CostSnapshot") -> "CostSnapshot":
        """What happened between ``before`` and this snapshot (a warm loader's steady state)."""
        return CostSnapshot(
            self.batches - before.batches,
            {r: self.cpu_seconds[r] - before.cpu_seconds.get(r, 0.0) for r in self.cpu_seconds},
            self.wakeups - before.wakeups, self.device_calls_loop - before.device_calls_loop,
            self.device_calls - before.device_calls, self.device_objects - before.device_objects,
            self.host_syncs - before.host_syncs, self.standin_seconds - before.standin_seconds)


def thread_clock(tid: int) -> int:
    """The CPU clock of thread ``tid`` of this process (what ``pthread_getcpuclockid`` computes, from the
    kernel's thread id: no pthread handle that may be gone)."""
    return ((~tid) << 3) | 6  # CPUCLOCK_PERTHREAD_MASK | CPUCLOCK_SCHED


class TrainerCost:
    """The counters; any of the loader's threads adds to them, ``snapshot()`` reads them."""

    def __init__(self) -> None:
        self._wakeups: defaultdict[int, int] = defaultdict(int)
        self._calls: defaultdict[int, int] = defaultdict(int)
        self._objects: defaultdict[int, int] = defaultdict(int)
        self._syncs: defaultdict[int, int] = defaultdict(int)
        self._standin: defaultdict[int, int] = defaultdict(int)  # ns of the stand-in device's copies, a thread
        self.loop_ns = 0  # CPU of the loop's thread inside next(), added by the iterator
        self.loop_calls = 0  # device calls made inside next(), added by the iterator
        self.batches = 0
        self._lock = threading.Lock()
        self._threads: list[tuple[str, threading.Thread]] = []
        self._last: dict[int, float] = {}  # a thread's CPU when last read (kept once it has exited)
        self._started = False  # start-up over: objects made from now on count

    # -- counting (hot paths: one dict update) -------------------------------------------------------

    def woken(self) -> None:
        """A thread of feedline's in this process was resumed by a signal from another (not a timeout)."""
        self._wakeups[threading.get_ident()] += 1

    def device_call(self) -> None:
        self._calls[threading.get_ident()] += 1

    def device_object(self) -> None:
        if self._started:
            self._objects[threading.get_ident()] += 1

    def host_sync(self) -> None:
        self._syncs[threading.get_ident()] += 1

    def standin_copy(self, ns: int) -> None:
        """The stand-in device spent ``ns`` of this thread's CPU copying: on a GPU a copy engine's time, so it is
        kept out of feedline's CPU (and reported apart)."""
        self._standin[threading.get_ident()] += ns

    def standin_here(self) -> int:
        """This thread's stand-in copying so far, ns (the iterator reads it around ``next()``)."""
        return self._standin.get(threading.get_ident(), 0)

    def device_calls_here(self) -> int:
        """This thread's device calls so far (the iterator reads it around ``next()``)."""
        return self._calls.get(threading.get_ident(), 0)

    def started(self) -> None:
        """Start-up is over: device objects made from now on are per-batch costs."""
        self._started = True

    # -- threads -------------------------------------------------------------------------------------

    def thread(self, role: str, thread: threading.Thread) -> None:
        """Count ``thread``'s CPU under ``role`` (one of ``THREAD_ROLES``) from now on."""
        with self._lock:
            self._threads.append((role, thread))

    def _cpu_of(self, thread: threading.Thread) -> float:
        tid = thread.native_id
        if tid is None:
            return 0.0
        if thread.is_alive():  # an exited thread's id may be reused: its last reading stands
            try:
                self._last[tid] = max(time.clock_gettime(thread_clock(tid)), self._last.get(tid, 0.0))
            except OSError:
                pass
        return self._last.get(tid, 0.0)

    def snapshot(self) -> CostSnapshot:
        cpu = dict.fromkeys(THREAD_ROLES, 0.0)
        cpu["loop"] = self.loop_ns / 1e9
        with self._lock:
            for role, t in self._threads:
                cpu[role] += self._cpu_of(t) - self._standin.get(t.ident or -1, 0) / 1e9
        return CostSnapshot(self.batches, cpu, sum(self._wakeups.values()), self.loop_calls,
                            sum(self._calls.values()), sum(self._objects.values()), sum(self._syncs.values()),
                            sum(self._standin.values()) / 1e9)
