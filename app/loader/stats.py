"""The loader's own statistics, named after the metrics they become (DESIGN.md, Metrics).

Updated in the trainer process only (workers send their counters with each
batch); read by ``StagingLoader.stats()``, and pushed to the sink the loader
was given (``feedline.sink.StatsSink``): the per-batch counters and
observations at the dispatcher's tick (4 a second, and at close), as deltas and
the observations made since — a batch pays for no sink call in the training
loop's thread; rare events as they happen.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..sink import NullSink, StatsSink

if TYPE_CHECKING:
    from .cost import CostSnapshot

# Labels of feedline_sample_errors_total{reason}; the order is the wire order.
ERROR_REASONS = ("corrupt", "too_large", "missing_field", "shape_mismatch", "bad_shard", "evicted", "worker_crash",
                 "member_too_large", "too_short")
# Skips that say nothing about the data: a shard the sampler evicted before a worker opened it (DESIGN.md:
# "skips it with a counted warning, never a crash"). Counted, but outside the failure budget.
BUDGET_EXEMPT = frozenset({"evicted"})
# Labels of feedline_worker_restarts_total{reason}: a worker that died, one that made no progress, one over
# its memory ceiling (worker_memory).
RESTART_REASONS = ("crashed", "stalled", "memory")

QUEUES = ("free", "decoded", "device")
BYTE_STAGES = ("read", "decoded", "transferred")
PLACES = ("local", "remote")  # feedline_batches_decoded_total{place}: a worker process, or a Ray actor (remote/)
DIRECTIONS = ("sent", "received")  # feedline_remote_bytes_total{direction}: encoded samples out, slots back
STEPS_QUEUED = 1024  # StatsRecorder.step: steps queued before the loop counts them itself (no reader came)
# Seconds; from a fast local queue hand-off up to a stalled remote store.
TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    """A cumulative-bucket histogram in Prometheus' shape."""

    buckets: tuple[float, ...] = TIME_BUCKETS
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> "Histogram":
        h = Histogram(self.buckets)
        h.counts, h.sum, h.count = list(self.counts), self.sum, self.count
        return h

    def cumulative(self) -> list[tuple[float, int]]:
        out, total = [], 0
        for bound, n in zip(list(self.buckets) + [float("inf")], self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class StarvationWindow:
    """data wait / (data wait + step) over the last ``seconds`` of steps."""

    seconds: float = 30.0
    _steps: deque = field(default_factory=deque)  # (t, wait, step)
    _wait: float = 0.0
    _step: float = 0.0

    def add(self, now: float, wait: float, step: float) -> None:
        self._steps.append((now, wait, step))
        self._wait += wait
        self._step += step
        while self._steps and self._steps[0][0] < now - self.seconds:
            _, w, s = self._steps.popleft()
            self._wait -= w
            self._step -= s

    def ratio(self) -> float:
        total = self._wait + self._step
        return max(0.0, min(1.0, self._wait / total)) if total > 0 else 0.0


@dataclass
class LoaderStats:
    """A snapshot; field names follow the metric names without the ``feedline_`` prefix."""

    data_wait_seconds_total: float = 0.0
    data_wait_seconds: Histogram = field(default_factory=Histogram)
    step_seconds_total: float = 0.0
    gpu_starvation_ratio: float = 0.0
    queue_depth: dict[str, int] = field(default_factory=lambda: dict.fromkeys(QUEUES, 0))
    queue_capacity: dict[str, int] = field(default_factory=lambda: dict.fromkeys(QUEUES, 0))
    workers: dict[str, int] = field(default_factory=lambda: {"busy": 0, "idle": 0})
    samples_total: int = 0
    batches_total: int = 0
    bytes_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BYTE_STAGES, 0))
    h2d_seconds: Histogram = field(default_factory=Histogram)
    h2d_wait_seconds_total: float = 0.0
    sample_errors_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_REASONS, 0))
    worker_restarts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESTART_REASONS, 0))
    decode_seconds_total: float = 0.0
    batches_decoded_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PLACES, 0))
    remote_decode_seconds_total: float = 0.0
    remote_redone_batches_total: int = 0
    remote_bytes_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    worker_places: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PLACES, 0))
    kept_batches_copied_total: int = 0
    epoch: int = -1

    @property
    def worker_restarts_total(self) -> int:
        return sum(self.worker_restarts.values())


class StatsRecorder:
    """The loader's one funnel for statistics: keeps ``LoaderStats`` and pushes them to the sink (``flush``).

    Every update takes one short lock; the sink is called outside it.
    """

    def __init__(self, window_seconds: float = 30.0, sink: StatsSink | None = None):
        self._lock = threading.Lock()
        self._s = LoaderStats()
        self._window = StarvationWindow(window_seconds)
        self._sink: StatsSink = sink if sink is not None else NullSink()
        # a sink that drops everything: what only it would get is not computed (the tick's gauges, the thread CPU
        # times, each wait kept for it), which is most of the training process's CPU a second at a slow step
        self.listens = not isinstance(self._sink, NullSink)
        self._cpu_pushed: dict[str, float] = {}  # trainer_cpu_seconds_total as last pushed, by thread
        self._pushed: dict[str, float] = {}  # the per-batch counters as last pushed (flush)
        self._waits: list[float] = []  # data waits observed since the last flush
        self._cost_window: deque[tuple[float, float, int]] = deque()  # (when, feedline's CPU, batches)
        self._place_of: dict[int, int] = {}  # worker place -> 1 when its last batch was decoded by a Ray actor
        self._steps: deque[tuple[float, float, float | None, int | None]] = deque()  # step()s not counted yet

    @property
    def window_seconds(self) -> float:
        return self._window.seconds

    def step(self, wait: float, step: float | None, nbytes: int | None = None) -> None:
        """A ``next()`` returned after ``wait`` seconds, ``step`` after the last returned; with a batch of
        ``nbytes`` of payload (None: the epoch's end).

        Queued, and counted by the next reader (``_count``): after a step of tens of milliseconds the loop's
        caches are cold, and the lock, histogram and window cost ``next()`` about 30 µs there; an append does not.
        """
        steps = self._steps
        steps.append((time.monotonic(), wait, step, nbytes))
        if len(steps) >= STEPS_QUEUED:  # nobody has read for a while: count them here, a few times a second at most
            with self._lock:
                self._count()

    def _count(self) -> None:
        """Under the lock: count the steps queued since the last reader (deque pops: ``step`` needs no lock)."""
        steps, s, window = self._steps, self._s, self._window
        for _ in range(len(steps)):
            now, wait, step, nbytes = steps.popleft()
            s.data_wait_seconds_total += wait
            s.data_wait_seconds.observe(wait)
            if self.listens:
                self._waits.append(wait)
            if step is not None:
                s.step_seconds_total += step
            window.add(now, wait, step or 0.0)
            if nbytes is not None:
                s.bytes_total["transferred"] += nbytes
                s.batches_total += 1

    def loop_times(self) -> tuple[float, float]:
        """(seconds the loop waited in ``next()``, seconds it spent between calls), since the start."""
        with self._lock:
            self._count()
            return self._s.data_wait_seconds_total, self._s.step_seconds_total

    def batch_done(self, samples: int, read: int, decoded: int, decode_ns: int, errors: tuple[int, ...],
                   remote: int = 0, redone: int = 0, sent: int = 0, received: int = 0, worker: int = 0) -> None:
        with self._lock:
            s = self._s
            if samples:
                self._place_of[worker] = remote  # where the place's last batch was decoded
            s.samples_total += samples
            s.bytes_total["read"] += read
            s.bytes_total["decoded"] += decoded
            s.decode_seconds_total += decode_ns / 1e9
            if samples:
                s.batches_decoded_total[PLACES[remote]] += 1
            s.remote_redone_batches_total += redone  # decoded again after its actor was lost (remote/proxy.py)
            if remote:  # a remote worker place's batch
                s.remote_decode_seconds_total += decode_ns / 1e9
                s.remote_bytes_total["sent"] += sent
                s.remote_bytes_total["received"] += received
            if any(errors):  # almost never: the per-reason work is skipped
                for reason, n in zip(ERROR_REASONS, errors):
                    s.sample_errors_total[reason] += n

    def flush(self) -> None:
        """Push the per-batch counters' growth since the last flush, and the waits observed since (the tick's)."""
        with self._lock:
            self._count()
            s = self._s
            now = {"data_wait_seconds_total": s.data_wait_seconds_total, "step_seconds_total": s.step_seconds_total,
                   "samples_total": float(s.samples_total),
                   "remote_redone_batches_total": float(s.remote_redone_batches_total),
                   "decode_seconds_total:local": s.decode_seconds_total - s.remote_decode_seconds_total,
                   "decode_seconds_total:remote": s.remote_decode_seconds_total,
                   **{f"bytes_total:{k}": float(v) for k, v in s.bytes_total.items()},
                   **{f"batches_decoded_total:{k}": float(v) for k, v in s.batches_decoded_total.items()},
                   **{f"remote_bytes_total:{k}": float(v) for k, v in s.remote_bytes_total.items()},
                   **{f"sample_errors_total:{k}": float(v) for k, v in s.sample_errors_total.items()}}
            pushed, self._pushed = self._pushed, now
            waits, self._waits = self._waits, []
        sink = self._sink
        for key, value in now.items():
            delta = value - pushed.get(key, 0.0)
            if delta > 0:
                name, _, label = key.partition(":")
                if not label:
                    sink.inc(name, delta)
                elif name == "bytes_total":
                    sink.inc(name, delta, stage=label)
                elif name in ("batches_decoded_total", "decode_seconds_total"):
                    sink.inc(name, delta, place=label)
                elif name == "remote_bytes_total":
                    sink.inc(name, delta, direction=label)
                else:
                    sink.inc(name, delta, reason=label)
        for wait in waits:
            sink.observe("data_wait_seconds", wait)

    def corrupt_dropped(self, samples: int) -> None:
        """Rows the batch stage could not decode (``device_decode``): dropped, counted as corrupt samples (pushed
        with the next flush)."""
        with self._lock:
            self._s.sample_errors_total["corrupt"] += samples

    def h2d(self, seconds: float, waited: float = 0.0) -> None:
        """A (sampled) batch's host-to-device copy took ``seconds``; ``waited``: the loop's stream time it stands
        for (copies on that stream: the sample times the batches it samples)."""
        with self._lock:
            self._s.h2d_seconds.observe(seconds)
        self._sink.observe("h2d_seconds", seconds)
        if waited:
            self.h2d_wait(waited)

    def h2d_wait(self, seconds: float) -> None:
        with self._lock:
            self._s.h2d_wait_seconds_total += seconds
        self._sink.inc("h2d_wait_seconds_total", seconds)

    def kept_batch_copied(self) -> None:
        with self._lock:
            self._s.kept_batches_copied_total += 1
        self._sink.inc("kept_batches_copied_total")

    def worker_restarted(self, reason: str) -> None:
        with self._lock:
            self._s.worker_restarts[reason] += 1
        self._sink.inc("worker_restarts_total", reason=reason)

    def report_cost(self, cost: "CostSnapshot") -> None:
        """Feedline's CPU in the training process (``cost.py``) as counters by thread, and a batch's share of it
        over the starvation window (the dispatcher's tick)."""
        now = time.monotonic()
        with self._lock:
            pushed, self._cpu_pushed = self._cpu_pushed, dict(cost.cpu_seconds)
            window = self._cost_window
            window.append((now, cost.cpu_total, cost.batches))
            while len(window) > 2 and window[0][0] < now - self._window.seconds:
                window.popleft()
            t0, cpu0, batches0 = window[0]
        sink = self._sink
        for role, seconds in cost.cpu_seconds.items():
            delta = seconds - pushed.get(role, 0.0)
            if delta > 0:
                sink.inc("trainer_cpu_seconds_total", delta, thread=role)
        if cost.batches > batches0:
            sink.set("trainer_cpu_per_batch_seconds", (cost.cpu_total - cpu0) / (cost.batches - batches0))

    def configured(self, transfer_threads: int, placed: tuple[int, int] = (0, 0)) -> None:
        """What the loader runs with, as set or as ``auto`` chose it (the workers show in their states); ``placed``:
        the CPUs placement gave the training process and the workers."""
        self._sink.set("transfer_threads", transfer_threads)
        self._sink.set("placed_cpus", placed[0], side="trainer")
        self._sink.set("placed_cpus", placed[1], side="workers")

    def set_epoch(self, epoch: int) -> None:
        with self._lock:
            self._s.epoch = epoch
        self._sink.set("loader_epoch", epoch)

    def report_gauges(self, queue_depth: dict[str, int], queue_capacity: dict[str, int],
                      workers: dict[str, int]) -> None:
        """Push the per-batch counters (``flush``), the current queue depths, worker states and starvation ratio
        to the sink."""
        self.flush()
        with self._lock:
            self._count()
            ratio = self._window.ratio()
        sink = self._sink
        sink.set("gpu_starvation_ratio", ratio)
        for q in QUEUES:
            sink.set("queue_depth", queue_depth.get(q, 0), queue=q)
            sink.set("queue_capacity", queue_capacity.get(q, 0), queue=q)
        for state, n in workers.items():
            sink.set("workers", n, state=state)
        with self._lock:
            places = list(self._place_of.values())
        for k, place in enumerate(PLACES):
            sink.set("worker_places", places.count(k), place=place)

    def snapshot(self, queue_depth: dict[str, int], queue_capacity: dict[str, int],
                 workers: dict[str, int]) -> LoaderStats:
        with self._lock:
            self._count()
            s = self._s
            places = list(self._place_of.values())
            return LoaderStats(
                data_wait_seconds_total=s.data_wait_seconds_total,
                data_wait_seconds=s.data_wait_seconds.copy(),
                step_seconds_total=s.step_seconds_total,
                gpu_starvation_ratio=self._window.ratio(),
                queue_depth=dict(queue_depth),
                queue_capacity=dict(queue_capacity),
                workers=dict(workers),
                samples_total=s.samples_total,
                batches_total=s.batches_total,
                bytes_total=dict(s.bytes_total),
                h2d_seconds=s.h2d_seconds.copy(),
                h2d_wait_seconds_total=s.h2d_wait_seconds_total,
                sample_errors_total=dict(s.sample_errors_total),
                worker_restarts=dict(s.worker_restarts),
                decode_seconds_total=s.decode_seconds_total,
                batches_decoded_total=dict(s.batches_decoded_total),
                remote_decode_seconds_total=s.remote_decode_seconds_total,
                remote_redone_batches_total=s.remote_redone_batches_total,
                remote_bytes_total=dict(s.remote_bytes_total),
                worker_places={place: places.count(k) for k, place in enumerate(PLACES)},
                kept_batches_copied_total=s.kept_batches_copied_total,
                epoch=s.epoch,
            )
