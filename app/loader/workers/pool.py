"""The worker pool: W decode processes feeding the ring, behind one dispatcher thread.

The dispatcher joins the two halves: the ``Scheduler`` decides which worker
fills which slot and which batch the loop takes next; the ``Supervisor`` owns
the processes and says which died or stalled. The dispatcher starts the
workers, sends epoch plans, replaces workers, and closes the supervisor when
it ends. The consumer side (transfer threads, the training loop) takes and
releases slots, and reads the results it waits for from the workers' pipes
itself (``waiters.py``): a batch costs no wake-up of the dispatcher, which
wakes for starts, deaths, full pipes and its tick (4 a second, once a second
where no sink listens), and then reads every pipe once, so a worker's state
is never older than a second.

No wait is unbounded (``stall_timeout``): a consumer's wait for the lock or a
batch reads the dispatcher's heartbeat (``watchdog.py``); the dispatcher ends
a worker's start that takes too long, and a consumer's wait while no worker
moves, with a ``LoaderError`` that names the stage and logs its stack.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ErrorBudget, LoaderError
from ..plan.epoch_plan import EpochPlan
from ..plan.stream import EAGER_OPEN
from ..ring.batch_ring import BatchRing
from ..cost import TrainerCost
from ..stats import StatsRecorder
from ..watchdog import BoundedLock, Heartbeat
from .launch import Launcher
from .messages import (
    DONE,
    ERROR_REASONS,
    FATAL,
    BatchResult,
    decode_json,
    encode_epoch,
    encode_fill,
)
from .scheduler import EpochEnd, EpochProgress, ReadyBatch, Scheduler
from .dispatcher import TICK, Dispatcher
from .supervisor import Supervisor
from .waiters import Waiters

log = logging.getLogger("feedline.loader")

CLOSE_WAIT = 15.0  # seconds close() waits for the dispatcher to finish what it is doing and stop the workers


class WorkerPool(Dispatcher):
    """W worker processes, the slots they fill, and the order the loop receives batches in."""

    def __init__(self, ring: BatchRing, launcher: Launcher, setup: dict[str, Any], workers: int,
                 stats: StatsRecorder, error_budget: ErrorBudget, *, in_order: bool = True,
                 worker_timeout: float = 0.0, stall_timeout: float = 120.0, worker_memory: int = 0,
                 on_tick: Callable[[], None] | None = None, tick: float = TICK, cost: TrainerCost | None = None,
                 cpus_of: Callable[[int], tuple[int, ...]] | None = None):
        self._stats = stats
        self.cost = cost if cost is not None else TrainerCost()
        self._waiters = Waiters(self.cost)
        self.stall_timeout = stall_timeout
        self._budget = error_budget
        self._on_tick = on_tick
        self.tick = tick  # seconds between the dispatcher's ticks (dispatcher.tick_seconds)
        self._cv = threading.Condition()
        self._scheduler = Scheduler(ring.slots, workers, in_order)
        self._beat = Heartbeat("the loader's dispatcher thread")
        self._supervisor = Supervisor(ring, launcher, setup, workers, worker_timeout, stats.worker_restarted,
                                      self._beat, worker_memory, cpus_of)
        self._waiting: dict[int, list[float]] = {}  # consumer thread -> [waiting since, last asked]
        self._dispatcher_stuck = False
        self._locked = BoundedLock(self._cv, stall_timeout, self.check_dispatcher)  # a consumer's: bounded
        self._plan: EpochPlan | None = None
        self._needs_plan = [False] * workers
        self._error: BaseException | None = None
        self._stopping = False
        self._wait = min(1.0, worker_timeout / 4) if worker_timeout > 0 else 1.0
        self._thread = threading.Thread(target=self._run, name="feedline-dispatcher", daemon=True)
        self._beat.thread = self._thread
        self._thread.start()
        self.cost.thread("dispatcher", self._thread)

    # -- the consumer side (transfer threads and the training loop) --------------------------

    def start_epoch(self, plan: EpochPlan, first: list[int] | None = None, delivered: list[int] | None = None,
                    run: int | None = None, restart: bool = False) -> None:
        """Begin ``plan``'s epoch (a resumed one from each worker's ``first`` batch and ``delivered`` stream
        position); a previous epoch still in flight is abandoned and its slots return.

        ``run`` is the token the batches of this start carry (default: the epoch number); an epoch restarted
        with another plan needs a new one, and ``restart`` keeps the epoch's failure budget.
        A plan for more workers than the pool has grows the pool.
        """
        with self._locked:
            self._raise_if_failed()
            if plan.workers > self._supervisor.workers:
                self._supervisor.add(plan.workers)
            self._scheduler.start_epoch(plan.epoch if run is None else run, first, delivered, plan.workers, restart)
            self._supervisor.new_epoch()  # stream positions that crashed a worker name other samples in a new split
            self._supervisor.held.hold([plan.file_of(plan.path_of(e)) for mine in plan.assignment
                                        for e in mine[:EAGER_OPEN]])
            self._plan = plan
            self._needs_plan = [True] * plan.workers
            self._cv.notify_all()
        self._supervisor.wake()
        self._waiters.wake()  # a transfer thread waiting on a pipe for the abandoned epoch

    def grow(self, workers: int) -> None:
        """Start workers up to ``workers`` now, idle until an epoch plan names them (``ready`` says when)."""
        with self._locked:
            self._raise_if_failed()
            self._supervisor.add(workers)
        self._supervisor.wake()

    def ready(self) -> bool:
        """Every worker, the grown ones too, has started."""
        with self._locked:
            self._raise_if_failed()
            return self._supervisor.ready()

    def take(self, timeout: float = 0.5, release: int | None = None, more: list[int] | tuple[int, ...] = (),
             ahead: int = 0, into: list[ReadyBatch | EpochEnd] | None = None) -> ReadyBatch | EpochEnd | None:
        """The next filled batch, an EpochEnd once all are taken, or None after ``timeout``; ``release``: a slot
        given back first, under the same lock (the loop's zero-copy batch: one lock a ``next()``), with ``more``
        (batches read ahead: ``DirectHandOff``), their fills sent in one pass. With ``ahead``, up to that many
        batches after it whose results are in go to ``into``, under the same lock (up to an ``EpochEnd``).

        The results it needs are read here, from the pipe of the worker whose batch comes next, and a
        wait is a wait on that pipe (``waiters.py``). A consumer that keeps getting None counts as waiting:
        the dispatcher bounds that wait while no worker moves, and this call raises once the dispatcher
        itself stops answering.
        """
        cv = self._cv
        if not cv.acquire(timeout=self.stall_timeout):  # the bounded lock, inline: this runs once a batch
            self._locked.timed_out()
        try:
            if release is not None:
                self._scheduler.release(release)
                for slot in more:
                    self._scheduler.release(slot)
                if self._feed():
                    self._supervisor.wake()
            item = self._next()
            if item is not None:
                if ahead and into is not None and type(item) is not EpochEnd:
                    for _ in range(ahead):
                        nxt = self._next()
                        if nxt is None:
                            break
                        into.append(nxt)
                        if type(nxt) is EpochEnd:
                            break
                return item
            now = time.monotonic()
            self._waiting.setdefault(threading.get_ident(), [now, now])[1] = now
            pipes = [self._supervisor.pipe_of(w) for w in self._scheduler.waits_on()]
        finally:
            cv.release()
        self._waiters.wait(pipes, timeout)
        self.check_dispatcher()
        return None

    def poll(self) -> ReadyBatch | EpochEnd | None:
        """``take()`` without a wait: the next batch if its result has arrived (a copy ahead)."""
        with self._locked:
            return self._next()

    def _next(self) -> ReadyBatch | EpochEnd | None:
        """Under the lock: the next batch, its worker's pipe read if its result is not in yet."""
        self._raise_if_failed()
        if self._stopping:
            raise LoaderError("the loader was closed")
        scheduler = self._scheduler
        item = scheduler.take()
        if item is None:
            needed = scheduler.waits_on()
            if needed:
                self._read(self._supervisor.drain(needed))
                item = scheduler.take()
        if item is not None and self._waiting:
            self._waiting.pop(threading.get_ident(), None)
        return item

    def free_slots(self) -> int:
        """Slots no worker is filling and no batch holds (0: the workers wait for one to come back)."""
        with self._cv:
            return len(self._scheduler.free)

    def _read(self, messages: list[tuple[int, bytes]]) -> None:
        """A consumer's: account the results it read (under the lock); a fatal one fails the pool."""
        try:
            for w, msg in messages:
                self._handle(w, msg)
        except LoaderError as exc:
            self.fail(exc)
            raise

    def wait_epoch_change(self, epoch: int, timeout: float = 0.5) -> None:
        """Block a transfer thread that finished ``epoch`` until another one starts."""
        with self._cv:
            if self._scheduler.epoch == epoch and not self._stopping and self._error is None:
                if self._cv.wait(timeout):
                    self.cost.woken()

    def release(self, slot: int) -> None:
        """Give a slot back; its next fill goes out from this thread, without waking the dispatcher."""
        with self._locked:
            self._scheduler.release(slot)
            waiting = self._feed()
        if waiting:
            self._supervisor.wake()

    def samples_dropped(self, n: int) -> None:
        """Samples the batch stage could not decode (``device_decode``): counted, and against the failure budget."""
        self._stats.corrupt_dropped(n)
        with self._locked:
            self._scheduler.add_errors("corrupt", n)
            try:
                self._check_budget()
            except LoaderError as exc:
                self._error = self._error or exc
                self._cv.notify_all()
                self._waiters.wake()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()
        self._waiters.wake()
        self._supervisor.wake()  # the dispatcher stops the workers

    def depths(self) -> dict[str, int]:
        with self._cv:
            return self._scheduler.depths()

    def worker_states(self) -> dict[str, int]:
        with self._cv:
            busy = sum(1 for w in range(self._scheduler.workers) if self._scheduler.busy(w))
            return {"busy": busy, "idle": self._scheduler.workers - busy}

    def worker_pids(self) -> list[int | None]:
        """The worker processes' pids now (None while one is being replaced)."""
        with self._cv:
            return self._supervisor.pids()

    def progress(self) -> EpochProgress:
        with self._cv:
            return self._scheduler.progress()

    def close(self) -> None:
        """Stop the dispatcher, which stops the workers; waits ``CLOSE_WAIT`` at most, then kills them itself."""
        self._stopping = True  # seen by the dispatcher's next loop even if the lock cannot be had
        if self._cv.acquire(timeout=1.0):
            self._cv.notify_all()
            self._cv.release()
        self._supervisor.wake()
        self._waiters.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(1.0 if self._dispatcher_stuck else CLOSE_WAIT)
            if self._thread.is_alive():
                log.warning("the loader's dispatcher did not stop (%s); its workers are killed from here",
                            self._beat.doing or "it is stuck")
                self._supervisor.kill_all()
        self._waiters.close()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def check_dispatcher(self) -> None:
        """Raise if the dispatcher thread has not looped for ``stall_timeout`` (its stack is logged)."""
        if self._error is not None or not self._thread.is_alive():
            return
        exc = self._beat.stalled(self.stall_timeout)
        if exc is not None:
            self._dispatcher_stuck = True
            self._error = exc
            raise exc

    # -- the dispatcher thread ---------------------------------------------------------------

    def _feed(self) -> bool:
        """Send pending epoch plans, then a fill for every free slot (under the lock); True if bytes wait for a
        pipe (the dispatcher sends them)."""
        return self._send_plans() | self._assign()

    def _send_plans(self) -> bool:
        waiting = False
        if self._plan is None or not any(self._needs_plan):
            return waiting
        for w, needed in enumerate(self._needs_plan):
            if needed and w < self._supervisor.workers and self._supervisor.started(w):
                plan = self._plan.for_worker(w, self._scheduler.delivered(w), self._supervisor.poison(w),
                                             self._scheduler.epoch)
                waiting |= self._supervisor.send(w, encode_epoch(plan))
                self._needs_plan[w] = False
        return waiting

    def _assign(self) -> bool:
        """A fill for every free slot; a worker given several gets them in one write (slots given back together:
        ``DirectHandOff``'s batches read ahead)."""
        scheduler = self._scheduler
        fills = []
        while (fill := scheduler.next_fill()) is not None:
            fills.append(fill)
        if len(fills) <= 1:  # the common case: one slot given back
            if not fills:
                return False
            w, slot, j = fills[0]
            return self._supervisor.send(w, encode_fill(scheduler.epoch, slot, j))
        by_worker: dict[int, list[bytes]] = {}
        for w, slot, j in fills:
            by_worker.setdefault(w, []).append(encode_fill(scheduler.epoch, slot, j))
        waiting = False
        for w, msgs in by_worker.items():
            waiting |= self._supervisor.send(w, *msgs)
        return waiting

    def _handle(self, w: int, msg: bytes) -> None:
        if msg[:1] == FATAL:
            raise LoaderError(decode_json(msg)["message"])
        r = BatchResult.decode(msg)
        if not self._scheduler.on_result(w, r):
            return
        self._stats.batch_done(r.samples, r.read_bytes, r.decoded_bytes, r.decode_ns, r.errors, r.remote, r.redone,
                               r.sent, r.received, w)
        if r.kind == DONE:
            self._supervisor.progressed(w)
        if self._scheduler.errors:
            self._check_budget()

    def _check_budget(self) -> None:
        s = self._scheduler
        if s.errors and self._budget.exceeded(s.errors, s.samples, s.finished):
            detail = ", ".join(f"{k}={v}" for k, v in zip(ERROR_REASONS, s.error_counts) if v)
            raise LoaderError(
                f"too many bad samples in epoch {s.epoch}: {s.errors} skipped against {s.samples} delivered "
                f"({detail}); the failure budget max_sample_errors={self._budget.limit} was exceeded. The worker "
                f"log names each shard and key; fix or remove those shards, or raise max_sample_errors"
            )
