"""``workers="auto"`` in the first epoch: the tuner asked at the loop's ``next()`` calls, its growth carried out.

The decisions are ``tuner.py``'s; this drives them: every quarter second of the loop's time it samples
the decoded queue and hands the tuner the loop's running totals; when the tuner wants more workers they
are started ahead, idle, and once every one is up the loader restarts the rest of the epoch over them
(``regrow``): the loop waits for no process start. Under torch.distributed, where the ranks agreed
on the epoch's batch count (``equal_batches``), the new workers take over at the next epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..workers.pool import WorkerPool
from .tuner import WorkerTuner, decide, slowed

log = logging.getLogger("feedline.loader")

POLL = 0.05  # seconds between looks at workers being started
GROW_WAIT = 120.0  # seconds workers may take to start before the growth is given up
CHECK = 0.25  # seconds between looks at the window


class AutoWorkers:
    """The tuner, the pool it grows, and the loader's ways to measure the loop and to restart the epoch."""

    def __init__(self, tuner: WorkerTuner, pool: WorkerPool, loop_times: Callable[[], tuple[float, float]],
                 batches: Callable[[], int], regrow: Callable[[int], None], in_epoch: bool = True):
        self.tuner = tuner
        self._in_epoch = in_epoch  # False: torch.distributed ranks agreed on the batch count, or in_order=False
        self._pool = pool
        self._loop_times = loop_times
        self._batches = batches
        self._regrow = regrow
        self._grow_by = 0.0  # the time by which started workers must be up
        self.done = False

    def __call__(self, now: float) -> float | None:
        """At a ``next()`` once ``now`` passed the time this returned last; None: no more calls."""
        t = self.tuner
        if self.done:
            return None
        if t.growing_to is not None:  # started ahead: the rest of the epoch goes to them once they are up
            if not self._pool.ready():
                if now < self._grow_by:
                    return now + POLL
                log.warning("workers=auto: the %d workers started did not come up within %.0f s; keeping %d",
                            t.growing_to, GROW_WAIT, t.workers)
                t.growing_to = None
                self.stop(None)
                return None
            workers, t.growing_to = t.growing_to, None
            self._regrow(workers)
            t.workers = workers
            t.restarted()
            if workers >= t.most and t.before is None:
                self.stop("the most auto runs here")
                return None
            return now  # (at the most, one window more: the step is compared with the one before the growth)
        t.sample_depth(self._pool.depths()["decoded"])  # as the loop asks for a batch
        wait, step = self._loop_times()
        window = t.window(now, wait, step, self._batches())
        if window is None:
            return now if t.settling else now + CHECK
        if t.before is not None:  # the first window after a growth: did the loop's own step slow down?
            verdict, t.before = slowed(t.before, t.workers, window), None
            if verdict is not None:
                log.info("workers=auto: %s", verdict.reason)
                if verdict.workers < t.workers:  # the rest of the epoch over the count before (the others idle)
                    self._regrow(verdict.workers)
                    t.workers = verdict.workers
                self.stop(None)
                return None
        d = decide(t.workers, t.most, window, t.local)
        log.info("workers=auto: %s", d.reason)
        if d.workers > t.workers:
            t.before = ((t.workers, window.step_per_batch, (window.wait + window.step) / window.batches)
                        if self._in_epoch and window.batches else None)
            t.growing_to, self._grow_by = d.workers, now + GROW_WAIT
            self._pool.grow(d.workers)
            if not self._in_epoch:  # a new split would change the agreed batch count, or the replay: next epoch
                self.stop("from the next epoch on (this epoch goes on as it was split)")
                return None
            return now + POLL
        if d.final:
            self.stop(None)
            return None
        return now + CHECK

    def adopt(self, workers: int, go_on: bool) -> bool:
        """A loaded state's worker count; the tuner goes on from it if ``go_on`` (the state is of the first
        epoch), else it is done. True while it goes on."""
        self.tuner.workers, self.tuner.growing_to, self.tuner.before = workers, None, None
        self.tuner.restarted()
        self.done = self.done or not go_on
        return not self.done

    def stop(self, message: str | None) -> int:
        """No more adjusting; the worker count from now on (workers started but not yet given the epoch too)."""
        t = self.tuner
        workers = t.growing_to if t.growing_to is not None else t.workers
        if not self.done and message:
            log.info("workers=auto: %d workers from now on: %s", workers, message)
        self.done = True
        return workers
