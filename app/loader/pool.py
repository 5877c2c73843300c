"""The worker pool: W processes, the hand-out of free slots, and filled batches in order.

One dispatcher thread owns every pipe: it sends epoch plans and fill commands,
receives results, notices dead workers and replaces them. Batches are ordered
by ``(j, w)`` — batch j of worker w — which is round-robin over the workers
that still have data; slots are handed out in that same order, so the batch
the consumer needs next always has a slot and the ring cannot deadlock.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from .messages import DONE, END, FATAL, STOP, BatchResult, decode_json, encode_epoch, encode_fill
from .ring import BatchRing
from .stats import StatsRecorder
from .worker import WorkerArgs, worker_main

log = logging.getLogger("feedline.loader")

MAX_RESTARTS_WITHOUT_PROGRESS = 3


class LoaderError(RuntimeError):
    """The pipeline cannot go on; raised in the training loop at the next ``next()``."""


@dataclass
class ReadyBatch:
    epoch: int
    seq: int  # position in the epoch's delivery order
    slot: int
    samples: int


@dataclass
class EpochEnd:
    epoch: int
    batches: int


@dataclass
class _WorkerState:
    index: int
    process: Any = None
    conn: Connection | None = None
    outstanding: deque = field(default_factory=deque)  # (epoch, slot, j) sent, not answered
    ended_at: int | None = None  # first j answered END this epoch
    delivered_pos: int = 0  # stream position after the last answered batch
    poison: set = field(default_factory=set)
    last_crash_pos: int = -1
    restarts_without_progress: int = 0
    needs_plan: bool = False


@dataclass
class ErrorBudget:
    """``limit`` >= 1 is a count of bad samples per epoch; below 1 it is a fraction of samples seen."""

    limit: float

    def exceeded(self, errors: int, samples: int, final: bool) -> bool:
        if self.limit >= 1:
            return errors > self.limit
        seen = errors + samples
        return (final or seen >= 100) and seen > 0 and errors / seen > self.limit


class WorkerPool:
    def __init__(
        self,
        ring: BatchRing,
        make_args: Callable[[int, Connection], WorkerArgs],
        workers: int,
        stats: StatsRecorder,
        error_budget: ErrorBudget,
        start_method: str = "spawn",
        in_order: bool = True,
    ):
        import multiprocessing as mp

        self._ctx = mp.get_context(start_method)
        self._ring = ring
        self._make_args = make_args
        self._stats = stats
        self._budget = error_budget
        self._in_order = in_order
        self._cv = threading.Condition()
        self._free: deque[int] = deque(range(ring.slots))
        self._ready: dict[tuple[int, int], tuple[int, int]] = {}  # (j, w) -> (slot, samples)
        self._workers = [_WorkerState(i) for i in range(workers)]
        self._epoch = -1
        self._plans: list[dict[str, Any]] = []
        self._assign_at = (0, 0)
        self._take_at = (0, 0)
        self._taken = 0
        self._epoch_samples = 0
        self._epoch_errors = 0
        self._error: BaseException | None = None
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        try:
            for w in self._workers:
                self._spawn(w)
        except BaseException:
            self._kill_all()
            raise
        self._thread = threading.Thread(target=self._run, name="feedline-dispatcher", daemon=True)
        self._thread.start()

    # -- the consumer side (transfer threads and the training loop) --------------------------

    def start_epoch(self, epoch: int, plans: list[dict[str, Any]]) -> None:
        """Begin ``epoch``; a previous epoch still in flight is abandoned and its slots return."""
        with self._cv:
            self._raise_if_failed()
            for slot, _ in self._ready.values():
                self._free.append(slot)
            self._ready.clear()
            self._epoch = epoch
            self._plans = plans
            self._assign_at = self._take_at = (0, 0)
            self._taken = self._epoch_samples = self._epoch_errors = 0
            for w in self._workers:
                w.ended_at = None
                w.delivered_pos = 0
                w.poison = set()
                w.last_crash_pos = -1
                w.needs_plan = True
            self._cv.notify_all()
        self._wake()

    def take(self, timeout: float = 0.5) -> ReadyBatch | EpochEnd | None:
        """The next filled batch, an EpochEnd once all are taken, or None after ``timeout``."""
        with self._cv:
            self._raise_if_failed()
            if self._stopping:
                raise LoaderError("the loader was closed")
            if self._epoch < 0:
                self._cv.wait(timeout)
                return None
            if self._in_order:
                key = self._skip_ended(self._take_at)
                if key is None:
                    return EpochEnd(self._epoch, self._taken)
                self._take_at = key
            elif self._ready:
                key = min(self._ready)
            elif all(w.ended_at is not None for w in self._workers):
                return EpochEnd(self._epoch, self._taken)
            else:
                key = None
            if key not in self._ready:
                self._cv.wait(timeout)
                return None
            slot, samples = self._ready.pop(key)
            seq = self._taken
            self._taken += 1
            if self._in_order:
                self._take_at = self._advance(key)
            return ReadyBatch(self._epoch, seq, slot, samples)

    def wait_epoch_change(self, epoch: int, timeout: float = 0.5) -> None:
        """Block a transfer thread that finished ``epoch`` until another one starts."""
        with self._cv:
            if self._epoch == epoch and not self._stopping and self._error is None:
                self._cv.wait(timeout)

    def release(self, slot: int) -> None:
        with self._cv:
            self._free.append(slot)
        self._wake()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

    def depths(self) -> dict[str, int]:
        with self._cv:
            return {"free": len(self._free), "decoded": len(self._ready)}

    def worker_states(self) -> dict[str, int]:
        with self._cv:
            busy = sum(1 for w in self._workers if w.outstanding)
            return {"busy": busy, "idle": len(self._workers) - busy}

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        for w in self._workers:
            if w.conn is not None:
                try:
                    w.conn.send_bytes(STOP)
                except OSError:
                    pass
        for w in self._workers:
            if w.process is not None:
                w.process.join(timeout=2.0)
        self._kill_all()
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- ordering --------------------------------------------------------------------------

    def _advance(self, key: tuple[int, int]) -> tuple[int, int]:
        j, w = key
        return (j, w + 1) if w + 1 < len(self._workers) else (j + 1, 0)

    def _skip_ended(self, key: tuple[int, int]) -> tuple[int, int] | None:
        """The first key at or after ``key`` whose worker may still have that batch."""
        ends = [w.ended_at for w in self._workers]
        last = max(ends) if all(e is not None for e in ends) else None  # type: ignore[type-var]
        while True:
            if last is not None and key[0] >= last:
                return None
            e = ends[key[1]]
            if e is None or key[0] < e:
                return key
            key = self._advance(key)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # -- the dispatcher thread ---------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stopping:
                        return
                    self._send_plans()
                    self._assign()
                events = self._selector.select(timeout=1.0)
                with self._cv:
                    dead = []
                    for key, _ in events:
                        kind, w = key.data
                        if kind == "wake":
                            os.read(self._wake_r, 4096)
                        elif kind == "conn":
                            self._receive(w)
                        elif w.process is not None and key.fileobj == w.process.sentinel:
                            dead.append(w)
                    for w in dead:  # after its last results were read
                        if w.process is not None and not w.process.is_alive():
                            self._replace(w)
                    self._cv.notify_all()
        except BaseException as exc:  # never die silently: the training loop must hear of it
            log.exception("the loader's dispatcher failed")
            self.fail(LoaderError(f"the loader's dispatcher failed: {exc}"))

    def _send(self, w: _WorkerState, msg: bytes) -> None:
        if w.conn is None:
            return
        try:
            w.conn.send_bytes(msg)
        except OSError:
            pass  # it died; its sentinel brings us to _replace, which resends

    def _send_plans(self) -> None:
        for w in self._workers:
            if w.needs_plan and w.conn is not None and self._plans:
                plan = dict(self._plans[w.index], resume=w.delivered_pos, poison=sorted(w.poison))
                self._send(w, encode_epoch(plan))
                w.needs_plan = False

    def _assign(self) -> None:
        if self._epoch < 0:
            return
        while self._free:
            key = self._skip_ended(self._assign_at)
            if key is None:
                return
            j, wi = key
            w = self._workers[wi]
            slot = self._free.popleft()
            w.outstanding.append((self._epoch, slot, j))
            self._send(w, encode_fill(self._epoch, slot, j))
            self._assign_at = self._advance(key)

    def _receive(self, w: _WorkerState) -> None:
        conn = w.conn
        assert conn is not None
        try:
            while conn.poll():
                self._handle(w, conn.recv_bytes())
        except (EOFError, OSError):
            if w.process is not None:
                w.process.join(timeout=1.0)
            self._replace(w)

    def _handle(self, w: _WorkerState, msg: bytes) -> None:
        kind = msg[:1]
        if kind == FATAL:
            raise LoaderError(decode_json(msg)["message"])
        r = BatchResult.decode(msg)
        if w.outstanding and w.outstanding[0][1] == r.slot:
            w.outstanding.popleft()
        if r.epoch != self._epoch:
            self._free.append(r.slot)
            return
        w.delivered_pos = r.stream_pos
        self._stats.batch_done(r.samples, r.read_bytes, r.decoded_bytes, r.decode_ns, r.errors)
        self._epoch_samples += r.samples
        self._epoch_errors += sum(r.errors)
        if kind == DONE:
            w.restarts_without_progress = 0
            self._ready[(r.batch, w.index)] = (r.slot, r.samples)
        elif kind == END:
            self._free.append(r.slot)
            if w.ended_at is None or r.batch < w.ended_at:
                w.ended_at = r.batch
        final = all(x.ended_at is not None for x in self._workers)
        if self._budget.exceeded(self._epoch_errors, self._epoch_samples, final):
            totals = self._stats.snapshot({}, {}, {}).sample_errors_total
            detail = ", ".join(f"{k}={v}" for k, v in totals.items() if v)
            raise LoaderError(
                f"too many bad samples in epoch {self._epoch}: {self._epoch_errors} skipped against "
                f"{self._epoch_samples} delivered ({detail}); the failure budget max_sample_errors="
                f"{self._budget.limit} was exceeded. The worker log names each shard and key; "
                f"fix or remove those shards, or raise max_sample_errors"
            )

    # -- processes -----------------------------------------------------------------------------

    def _spawn(self, w: _WorkerState) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        self._ring.status[w.index] = (-1, -1)
        proc = self._ctx.Process(
            target=worker_main, args=(self._make_args(w.index, child),), name=f"feedline-worker-{w.index}",
            daemon=True,
        )
        proc.start()
        child.close()
        w.process, w.conn = proc, parent
        self._selector.register(parent, selectors.EVENT_READ, ("conn", w))
        self._selector.register(proc.sentinel, selectors.EVENT_READ, ("dead", w))

    def _replace(self, w: _WorkerState) -> None:
        """A worker died: start another that resumes after the last batch it delivered."""
        if self._stopping:
            return
        code = w.process.exitcode if w.process is not None else None
        epoch, pos = (int(x) for x in self._ring.status[w.index])
        if epoch == self._epoch and pos >= 0:
            if pos == w.last_crash_pos:
                w.poison.add(pos)  # the same sample killed it twice: skip it next time
            w.last_crash_pos = pos
        w.restarts_without_progress += 1
        self._stats.worker_restarted()
        where = f" while decoding stream position {pos}" if pos >= 0 else ""
        log.warning("worker %d died (exit code %s)%s; replacing it", w.index, code, where)
        if w.restarts_without_progress > MAX_RESTARTS_WITHOUT_PROGRESS:
            raise LoaderError(
                f"worker {w.index} died {w.restarts_without_progress} times without delivering a batch "
                f"(last exit code {code}); see the worker log above"
            )
        self._forget(w)
        self._spawn(w)
        if self._plans:
            w.needs_plan = True
            self._send_plans()
            for epoch, slot, j in list(w.outstanding):
                if epoch == self._epoch:
                    self._send(w, encode_fill(epoch, slot, j))
                else:
                    w.outstanding.remove((epoch, slot, j))
                    self._free.append(slot)

    def _forget(self, w: _WorkerState) -> None:
        """Drop a worker's pipe and process handle (it has exited or been killed)."""
        for obj in (w.conn, w.process.sentinel if w.process is not None else None):
            if obj is not None:
                try:
                    self._selector.unregister(obj)
                except (KeyError, ValueError):
                    pass
        if w.conn is not None:
            w.conn.close()
        if w.process is not None:
            if w.process.is_alive():
                w.process.kill()
            w.process.join(timeout=2.0)
            try:
                w.process.close()
            except ValueError:
                pass
        w.conn = w.process = None

    def _kill_all(self) -> None:
        for w in self._workers:
            p = w.process
            if p is not None and p.is_alive():
                p.kill()
                p.join(timeout=2.0)
            self._forget(w)
