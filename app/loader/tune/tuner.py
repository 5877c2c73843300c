"""``workers="auto"`` during the first epoch: grow the decode pool while the loop waits and CPUs are idle.

The loader starts ``auto`` at half the workers the host allows (``autotune.choose``) and, every
``INTERVAL`` seconds of the first epoch, looks at what the last window measured: the share of the
loop's time spent waiting in ``next()`` (starvation), the decoded queue (batches ready but not yet
taken), and the CPUs left idle. It grows the pool while the loop waits, the decoded queue is
empty (the workers are late, not the order) and CPUs are idle, by what the wait says is missing;
it stops once the loop no longer waits, the CPUs are busy, or the host's most is reached. After a
growth it compares the loop's own step a batch (the time between ``next()`` calls) with the one
before: a step ``SLOWER`` than before means the new workers took the loop's CPU; the pool goes back
to the count before if batches come no sooner for it, else it keeps the count and grows no further
(``slowed``). Every decision is logged with its figures; the count shows
in ``feedline_workers``.

The tuner only decides; the loader starts the new workers ahead and, once they are up, restarts
the rest of the epoch over them (every remaining sample exactly once, as an elastic resume).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from ..cpus.host import cpu_quota, cpu_usage_file, cpu_used
from ..cpus.pinning import ProcessPins

INTERVAL = 2.0  # seconds of the loop's time a decision looks at
SLOWER = 0.05  # a grown pool that makes the loop's step this much slower a batch goes back to what it was
MIN_BATCHES = 8  # a window with fewer batches says too little: it is extended
WAITING = 0.05  # the loop waits more than this share of its time: the data is late
SETTLE = 2  # next() calls after a start or a restart before a window begins (they wait for new workers)


@dataclass(frozen=True)
class Window:
    """What one window of the loop's time measured."""

    wait: float  # seconds the loop waited in next()
    step: float  # seconds the loop spent between next() calls
    batches: int
    decoded: float  # mean depth of the decoded queue (batches ready, not yet taken)
    idle_cpus: float  # CPUs of this process's share left idle, on average

    @property
    def starvation(self) -> float:
        total = self.wait + self.step
        return self.wait / total if total > 0 else 0.0

    @property
    def step_per_batch(self) -> float:
        return self.step / self.batches if self.batches else 0.0


@dataclass(frozen=True)
class Decision:
    """What a window decided, and the figures it was decided on (logged)."""

    workers: int  # from now on
    final: bool  # no further windows
    reason: str


def decide(workers: int, most: int, w: Window, local: int | None = None) -> Decision:
    """The worker count after window ``w``: grow by what the wait says is missing, capped by the idle CPUs here
    and, past the ``local`` places (``remote=``: the rest decode on a Ray cluster), by the cluster's places."""
    local = most if local is None else local
    starved = w.starvation
    figures = (f"the loop waited {starved:.0%} of its time, {w.decoded:.1f} batches decoded ahead, "
               f"{w.idle_cpus:.1f} CPUs idle")
    if starved < WAITING:
        return Decision(workers, True, f"keeping {workers} workers: {figures}")
    if workers >= most:
        return Decision(workers, True, f"keeping {workers} workers, the most for this host: {figures}")
    if w.decoded >= 1.0:
        return Decision(workers, False, f"keeping {workers} workers for now: {figures} (the wait is for one "
                                        f"worker's turn, not for decoding)")
    here = max(0, min(local - workers, math.floor(w.idle_cpus + 0.5)))  # local first, on CPUs idle here
    # then the cluster's places (its CPUs, not this host's), once every local place is in use: a new worker takes
    # the next place, so the cluster's come only after the local ones
    remote = most - max(workers, local) if workers + here >= local else 0
    if here + remote < 1:
        return Decision(workers, True, f"keeping {workers} workers, the CPUs are busy: {figures}")
    # fed, the loop would take a batch every `step`; it takes one every `wait + step`
    need = math.ceil(workers * (w.wait + w.step) / w.step) if w.step > 0 else most
    target = min(most, workers + here + remote, max(workers + 1, need))
    onto = f" (places {max(workers, local)}..{target - 1} on the Ray cluster)" if target > local else ""
    return Decision(target, target >= most, f"growing to {target} workers{onto}: {figures}")


def slowed(before: tuple[int, float, float], workers: int, w: Window) -> Decision | None:
    """After a growth, when the loop's own step got ``SLOWER`` a batch with the new workers (they take its thread's
    CPU; on a GPU, the launching thread's, which starvation cannot show): back to the count ``before`` (workers,
    the step a batch, the wait and step a batch, then) if a batch comes no sooner than it did, else keep the
    count and grow no further. None: the step is as it was, the tuning goes on."""
    was, step, total = before
    if step <= 0 or w.batches == 0 or w.step_per_batch <= step * (1 + SLOWER):
        return None
    now = (w.wait + w.step) / w.batches
    figures = (f"the loop's step took {w.step_per_batch * 1e3:.2f} ms a batch with {workers} workers, "
               f"{w.step_per_batch / step - 1:.0%} more than the {step * 1e3:.2f} ms with {was}, and a batch came "
               f"every {now * 1e3:.2f} ms (was {total * 1e3:.2f})")
    if now >= total * (1 - SLOWER):
        return Decision(was, True, f"back to {was} workers: {figures}: their decoding took the loop's CPU")
    return Decision(workers, True, f"keeping {workers} workers, no more: {figures}: fed sooner, but more would "
                                   f"take the loop's CPU")


class CpuMeter:
    """CPUs left idle since the last reading: this process's affinity in ``/proc/stat``, capped by its cgroup's
    quota less the cgroup's use (v2 ``cpu.max`` and ``cpu.stat``, v1 ``cpu.cfs_quota_us`` and ``cpuacct.usage``;
    ``cpus/host.py`` reads them under ``root``)."""

    def __init__(self, stat: str = "/proc/stat", root: str = "/", cpus: set[int] | None = None):
        self._stat = stat
        if cpus is None:
            try:
                cpus = ProcessPins.original()  # the process's CPUs before a loader pinned it
            except AttributeError:  # not Linux
                cpus = set(range(os.cpu_count() or 1))
        self._cpus = cpus
        self._quota = cpu_quota(root)
        self._usage = cpu_usage_file(root) if self._quota is not None else None
        self._last = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        """(wall seconds, idle jiffies, all jiffies of our CPUs, the cgroup's CPU seconds)."""
        idle = total = 0.0
        try:
            with open(self._stat) as f:
                for line in f:
                    name, *values = line.split()
                    if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in self._cpus:
                        continue
                    ticks = [float(v) for v in values[:8]]
                    idle += ticks[3] + ticks[4]  # idle, iowait
                    total += sum(ticks)
        except (OSError, ValueError, IndexError):
            pass
        used = (cpu_used(self._usage) if self._usage is not None else None) or 0.0
        return time.monotonic(), idle, total, used

    def idle_cpus(self) -> float:
        """Idle CPUs, on average, since the previous call (or since the meter was made)."""
        now = self._read()
        (t0, idle0, total0, used0), self._last = self._last, now
        t1, idle1, total1, used1 = now
        idle = len(self._cpus) * (idle1 - idle0) / (total1 - total0) if total1 > total0 else 0.0
        if self._quota is not None and t1 > t0:  # (no use file: the quota alone caps it)
            idle = min(idle, self._quota - (used1 - used0) / (t1 - t0))
        return max(0.0, idle)


class WorkerTuner:
    """The first epoch's windows: measures them from the loader's running totals and decides."""

    def __init__(self, workers: int, most: int, meter: CpuMeter | None = None, local: int | None = None):
        self.workers = workers
        self.most = most
        self.local = most if local is None else local  # places below it decode here, the rest remotely
        self.growing_to: int | None = None  # workers started ahead, not yet given the epoch
        self.before: tuple[int, float, float] | None = None  # count, step and wait+step a batch before a growth
        self._meter = meter or CpuMeter()
        self._settle = SETTLE
        self._begun: tuple[float, float, float, int] | None = None  # (time, wait, step, batches) at the start
        self._depths = 0.0
        self._samples = 0

    def sample_depth(self, decoded: int) -> None:
        """The decoded queue's depth as the loop asks for a batch (sampled at the windows' checks)."""
        self._depths += decoded
        self._samples += 1

    @property
    def settling(self) -> bool:
        return self._settle > 0

    def restarted(self) -> None:
        """The epoch goes on over new workers: the next window begins once they deliver."""
        self._settle = SETTLE
        self._begun = None

    def window(self, now: float, wait: float, step: float, batches: int) -> Window | None:
        """The window that ends now, once it is ``INTERVAL`` long with ``MIN_BATCHES``; None while it is not.

        ``wait``, ``step`` and ``batches`` are the loop's running totals.
        """
        if self._settle > 0:
            self._settle -= 1
            return None
        if self._begun is None:
            self._begun = (now, wait, step, batches)
            self._meter.idle_cpus()
            self._depths, self._samples = 0.0, 0
            return None
        t0, wait0, step0, batches0 = self._begun
        if now - t0 < INTERVAL or batches - batches0 < MIN_BATCHES:
            return None
        self._begun = (now, wait, step, batches)
        depth = self._depths / self._samples if self._samples else 0.0
        self._depths, self._samples = 0.0, 0
        return Window(wait - wait0, step - step0, batches - batches0, depth, self._meter.idle_cpus())
