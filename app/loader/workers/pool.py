"""The worker pool: W decode processes feeding the ring, behind one dispatcher thread.

The dispatcher joins the two halves: the ``Scheduler`` decides which worker
fills which slot and which batch the loop takes next; the ``Supervisor`` owns
the processes and says which died or stalled. The dispatcher starts the
workers, sends epoch plans and fill commands, receives results, replaces
workers, and closes the supervisor when it ends. The consumer side (transfer
threads, the training loop) only takes and releases slots.

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
from ..ring.batch_ring import OPENING, SKIPPING, BatchRing
from ..stats import StatsRecorder
from ..watchdog import STALL_HINT, BoundedLock, Heartbeat
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
from .supervisor import Supervisor

log = logging.getLogger("feedline.loader")

TICK = 0.25  # seconds between the gauges pushed to the stats sink
CLOSE_WAIT = 15.0  # seconds close() waits for the dispatcher to finish what it is doing and stop the workers
ASKING = 2.0  # seconds after its last take() a consumer still counts as waiting for a batch
PAUSED = 5.0  # a gap this long between two dispatcher loops: the process was stopped (Ctrl-Z), or it was stuck


class WorkerPool:
    """W worker processes, the slots they fill, and the order the loop receives batches in."""

    def __init__(self, ring: BatchRing, launcher: Launcher, setup: dict[str, Any], workers: int,
                 stats: StatsRecorder, error_budget: ErrorBudget, *, in_order: bool = True,
                 worker_timeout: float = 0.0, stall_timeout: float = 120.0, worker_memory: int = 0,
                 on_tick: Callable[[], None] | None = None):
        self._stats = stats
        self.stall_timeout = stall_timeout
        self._budget = error_budget
        self._on_tick = on_tick
        self._cv = threading.Condition()
        self._scheduler = Scheduler(ring.slots, workers, in_order)
        self._beat = Heartbeat("the loader's dispatcher thread")
        self._supervisor = Supervisor(ring, launcher, setup, workers, worker_timeout, stats.worker_restarted,
                                      self._beat, worker_memory)
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
            self._supervisor.held.hold([plan.path_of(e) for mine in plan.assignment for e in mine[:EAGER_OPEN]])
            self._plan = plan
            self._needs_plan = [True] * plan.workers
            self._cv.notify_all()
        self._supervisor.wake()

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

    def take(self, timeout: float = 0.5) -> ReadyBatch | EpochEnd | None:
        """The next filled batch, an EpochEnd once all are taken, or None after ``timeout``.

        A consumer that keeps getting None counts as waiting: the dispatcher bounds that wait while no
        worker moves, and this call raises once the dispatcher itself stops answering.
        """
        me = threading.get_ident()
        with self._locked:
            self._raise_if_failed()
            if self._stopping:
                raise LoaderError("the loader was closed")
            item = self._scheduler.take()
            if item is not None:
                self._waiting.pop(me, None)
                return item
            now = time.monotonic()
            self._waiting.setdefault(me, [now, now])[1] = now
            self._cv.wait(timeout)
            self.check_dispatcher()
            return None

    def wait_epoch_change(self, epoch: int, timeout: float = 0.5) -> None:
        """Block a transfer thread that finished ``epoch`` until another one starts."""
        with self._cv:
            if self._scheduler.epoch == epoch and not self._stopping and self._error is None:
                self._cv.wait(timeout)

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

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

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
        if threading.current_thread() is not self._thread:
            self._thread.join(1.0 if self._dispatcher_stuck else CLOSE_WAIT)
            if self._thread.is_alive():
                log.warning("the loader's dispatcher did not stop (%s); its workers are killed from here",
                            self._beat.doing or "it is stuck")
                self._supervisor.kill_all()

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

    def _run(self) -> None:
        try:
            self._supervisor.start_all()
            self._loop()
        except LoaderError as exc:
            self.fail(exc)
        except BaseException as exc:  # never die silently: the training loop must hear of it
            log.exception("the loader's dispatcher failed")
            self.fail(LoaderError(f"the loader's dispatcher failed: {exc}"))
        finally:
            self._supervisor.close(graceful=self._error is None)

    def _loop(self) -> None:
        last_tick = last_check = 0.0
        while True:
            self._beat.beat()
            with self._cv:
                if self._stopping:
                    return
                self._resend(*self._supervisor.start_new())  # a grown pool: started here, where workers start
                self._feed()
            messages, dead = self._supervisor.wait(self._wait)
            with self._cv:
                if self._stopping:
                    return
                gap = time.monotonic() - self._beat.at  # about self._wait, unless the process was stopped meanwhile
                if gap > min(PAUSED, self.stall_timeout / 2):  # deadlines count the time this process ran
                    self._supervisor.shift_clocks(gap)
                    for since_last in self._waiting.values():
                        since_last[0] += gap
                for w, msg in messages:
                    self._handle(w, msg)
                for w in dead:
                    doing = self._doing(w)
                    self._replace(w, "crashed", f": it was {doing}" if doing else "", doing)
                now = time.monotonic()
                stalled, late, stuck = [], [], False
                if now - last_check >= self._wait:  # not on every message: it reads the status table
                    last_check = now
                    stalled = self._supervisor.stalled(self._scheduler.busy)
                    late = self._supervisor.late_starts(self.stall_timeout, self._needed())
                    stuck = self._consumer_stuck(now)
                if dead or self._scheduler.takeable():  # a consumer woken for nothing costs a thread switch
                    self._cv.notify_all()
            if late:
                raise self._late_start(late[0])
            if stuck:
                raise self._no_progress()
            for w in stalled:  # its stack is read without the lock: the loop keeps taking batches
                if self._stopping:
                    return
                doing = self._doing(w)
                where = f": no progress for {self._supervisor.worker_timeout:g} s" + (f" while {doing}" if doing
                                                                                     else "")
                stack = self._supervisor.stack_of(w)
                with self._cv:
                    self._replace(w, "stalled", where + (f"; its stack:\n{stack}" if stack else ""), doing)
                    self._cv.notify_all()
            if self._on_tick is not None and now - last_tick >= TICK:
                last_tick = now
                self._on_tick()

    def _needed(self) -> int:
        """Workers the epoch in progress reads from (a grown pool's started-ahead ones are auto.py's to wait for)."""
        return self._plan.workers if self._plan is not None else self._supervisor.workers

    def _consumer_stuck(self, now: float) -> bool:
        """A consumer has asked for a batch for ``stall_timeout`` seconds and no worker moved all that time."""
        asking = [since for since, last in self._waiting.values() if now - last < ASKING]
        return (bool(asking) and now - min(asking) > self.stall_timeout
                and now - self._supervisor.last_progress > self.stall_timeout)

    def _late_start(self, w: int) -> LoaderError:
        """A worker that has not finished starting: its stack logged, the error that names it."""
        self._beat.beat(f"reading the stack of worker {w}, late to start")
        stack = self._supervisor.stack_of(w)
        log.error("worker %d has not finished starting; its stack:\n%s", w, stack or "(none written)")
        return LoaderError(
            f"worker {w} has not finished starting for {self.stall_timeout:.0f} s (stall_timeout="
            f"{self.stall_timeout:g}): a new worker imports feedline and torch, then the training script if the "
            f"transform is defined there, then unpickles the transform; its stack in the log shows where it "
            f"waits. {STALL_HINT}")

    def _no_progress(self) -> LoaderError:
        """The loop waited ``stall_timeout`` and no worker moved: what each does, their stacks logged."""
        doing = []
        for w in range(self._supervisor.workers):
            self._beat.beat(f"reading the stack of worker {w}")
            stack = self._supervisor.stack_of(w)
            what = self._doing(w) or ("idle" if not self._scheduler.busy(w) else "holding a batch")
            doing.append(f"worker {w}: {what}")
            log.error("worker %d (%s); its stack:\n%s", w, what, stack or "(none written)")
        return LoaderError(
            f"the training loop has waited {self.stall_timeout:g} s (stall_timeout) for a batch and no worker "
            f"made progress ({'; '.join(doing)}); their stacks are in the log. Set worker_timeout to replace a "
            f"worker that hangs on a sample. {STALL_HINT}")

    def _feed(self) -> bool:
        """Send pending epoch plans, then a fill for every free slot (under the lock); True if bytes wait for a
        pipe (the dispatcher sends them)."""
        return self._send_plans() | self._assign()

    def _send_plans(self) -> bool:
        waiting = False
        if self._plan is None:
            return waiting
        for w, needed in enumerate(self._needs_plan):
            if needed and w < self._supervisor.workers and self._supervisor.started(w):
                plan = self._plan.for_worker(w, self._scheduler.delivered(w), self._supervisor.poison(w),
                                             self._scheduler.epoch)
                waiting |= self._supervisor.send(w, encode_epoch(plan))
                self._needs_plan[w] = False
        return waiting

    def _assign(self) -> bool:
        waiting = False
        while (fill := self._scheduler.next_fill()) is not None:
            w, slot, j = fill
            waiting |= self._supervisor.send(w, encode_fill(self._scheduler.epoch, slot, j))
        return waiting

    def _handle(self, w: int, msg: bytes) -> None:
        if msg[:1] == FATAL:
            raise LoaderError(decode_json(msg)["message"])
        r = BatchResult.decode(msg)
        if not self._scheduler.on_result(w, r):
            return
        self._stats.batch_done(r.samples, r.read_bytes, r.decoded_bytes, r.decode_ns, r.errors)
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

    def _replace(self, w: int, reason: str, where: str, doing: str = "") -> None:
        if self._stopping:
            return
        self._supervisor.replace(w, reason, self._scheduler.epoch, where, doing)
        self._resend(w)

    def _resend(self, *workers: int) -> None:
        """New processes in these worker places: their plans, and the fills they hold, once more."""
        mine = [w for w in workers if self._plan is not None and w < len(self._needs_plan)]
        for w in mine:
            self._needs_plan[w] = True
        if mine:
            self._send_plans()
        for w in mine:
            for slot, j in self._scheduler.redo(w):
                self._supervisor.send(w, encode_fill(self._scheduler.epoch, slot, j))

    def _doing(self, w: int) -> str:
        """What worker ``w`` is doing, from the status table alone (no file is read: it may hang)."""
        hand = self._supervisor.in_hand(w)
        plan = self._plan
        if (plan is None or hand.epoch != self._scheduler.epoch or w >= plan.workers
                or not 0 <= hand.shard < len(plan.assignment[w])):
            return ""
        path = plan.path_of(plan.assignment[w][hand.shard])
        if hand.pos >= 0:
            return f"decoding {path} sample {self._supervisor.key_in_hand(w)!r} (stream position {hand.pos})"
        if hand.pos == OPENING:
            return f"opening {path}"
        if hand.pos == SKIPPING:
            return f"skipping to its resume position in {path} ({hand.index} samples skipped)"
        return ""
