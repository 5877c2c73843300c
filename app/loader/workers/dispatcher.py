"""The dispatcher thread's side of the worker pool: starts, deaths, stalls, its tick (``pool.py`` holds the rest).

It wakes for what only it can do — a worker to start or replace, a pipe full of fills to flush, a tick for the
gauges and the stall checks (4 a second where a sink listens, else once a second: ``tick_seconds``) — never for
a batch: the consumers read their batches' results themselves. At each check it reads every pipe once, so a
worker's state is never older than ``worker_timeout`` / 4 (a second at most), and wakes a waiting consumer when
what it watched changed.
"""

from __future__ import annotations

import logging
import time

from ..errors import LoaderError
from .diagnosis import doing, late_start, no_progress
from .messages import encode_fill

log = logging.getLogger("feedline.loader")

TICK = 0.25  # seconds between the gauges pushed to the stats sink
IDLE_TICK = 1.0  # seconds between ticks where nobody listens: the stall checks' and the views' pace, no gauges
ASKING = 2.0  # seconds after its last take() a consumer still counts as waiting for a batch
PAUSED = 5.0  # a gap this long between two dispatcher loops: the process was stopped (Ctrl-Z), or it was stuck


def tick_seconds(listens: bool, stall_timeout: float) -> float:
    """The dispatcher's tick: where no sink listens it only checks and restocks, and each wake-up costs the
    training process 0.1-0.3 ms of CPU (its code cold after a wait), so it wakes a quarter as often; it still
    beats well within ``stall_timeout``, which a consumer reads as the dispatcher being stuck."""
    return TICK if listens else min(IDLE_TICK, max(TICK, stall_timeout / 4))


class Dispatcher:
    """The dispatcher thread's methods of ``WorkerPool`` (a mixin: they share the pool's state and lock)."""

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
                if self._stopping or self._error is not None:
                    return
                self._resend(*self._supervisor.start_new())  # a grown pool: started here, where workers start
                self._feed()
            messages, dead = self._supervisor.wait(min(self._wait, self.tick))
            if messages or dead:
                self.cost.woken()
            with self._cv:
                if self._stopping or self._error is not None:
                    return
                gap = time.monotonic() - self._beat.at  # about a tick, unless the process was stopped meanwhile
                if gap > min(PAUSED, self.stall_timeout / 2):  # deadlines count the time this process ran
                    self._supervisor.shift_clocks(gap)
                    for since_last in self._waiting.values():
                        since_last[0] += gap
                now = time.monotonic()
                check = now - last_check >= self._wait  # not on every wake: it reads every pipe and the status table
                if check or dead:  # the results a consumer has not read yet; a dead worker's last ones
                    messages += self._supervisor.drain(None if check else dead)
                for w, msg in messages:
                    self._handle(w, msg)
                for w in dead:
                    doing = self._doing(w)
                    self._replace(w, "crashed", f": it was {doing}" if doing else "", doing)
                stalled, late, stuck = [], [], False
                if check:
                    last_check = now
                    stalled = self._supervisor.stalled(self._scheduler.busy)
                    for w in stalled:  # the stack read may wake it (SIGCONT): what it sends then is not read
                        self._supervisor.retire(w)
                    late = self._supervisor.late_starts(self.stall_timeout, self._needed())
                    stuck = self._consumer_stuck(now)
                if (dead or messages) and self._waiting:  # what a waiting consumer watched has changed
                    self._waiters.wake()
            if late:
                raise late_start(self._supervisor, self._beat, late[0], self.stall_timeout)
            if stuck:
                raise no_progress(self._supervisor, self._beat, self.stall_timeout, self._doing, self._scheduler.busy)
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
                self._waiters.wake()
            if self._on_tick is not None and now - last_tick >= self.tick:
                last_tick = now
                self._on_tick()

    def _doing(self, w: int) -> str:
        return doing(self._supervisor, self._plan, self._scheduler.epoch, w)

    def _needed(self) -> int:
        """Workers the epoch in progress reads from (a grown pool's started-ahead ones are auto.py's to wait for)."""
        return self._plan.workers if self._plan is not None else self._supervisor.workers

    def _consumer_stuck(self, now: float) -> bool:
        """A consumer has asked for a batch for ``stall_timeout`` seconds and no worker moved all that time."""
        asking = [since for since, last in self._waiting.values() if now - last < ASKING]
        return (bool(asking) and now - min(asking) > self.stall_timeout
                and now - self._supervisor.last_progress > self.stall_timeout)

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
