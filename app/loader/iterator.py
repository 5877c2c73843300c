"""One epoch as the training loop sees it: ``next()`` returns ready tensors and is the only place it waits.

The time blocked inside ``next()`` is the data wait (GPU starvation); the time
between one ``next()`` returning and the next call is the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .cost import TrainerCost
from .device.handoff import DeviceBatch
from .errors import LoaderError
from .plan.epochs import EpochCounter
from .plan.resume import Cursor
from .ring.kept import KeptBatches
from .ring.views import Lease
from .stats import StatsRecorder

log = logging.getLogger("feedline.loader")


class HandOff(Protocol):
    """What hands batches to the iterator (``device/handoff.py``, ``device/transfer.py``)."""

    capacity: int

    def get(self, release: int | None = None) -> DeviceBatch | None: ...

    def start_epoch(self, epoch: int) -> None: ...

    def depth(self) -> int: ...

    def close(self) -> None: ...


class EpochIterator:
    """Yields one epoch's batches; a zero-copy batch's slot is released at the following ``next()``, a copy-mode
    batch's once nothing references it (``kept``)."""

    __slots__ = ("_begin", "_epoch", "_reading", "_on_device", "_start", "_ended", "_tune", "_tune_at", "_kept",
                 "_epochs", "_queue", "_release", "_stats", "_cost", "_cursor", "_limit", "_last", "_padding",
                 "_last_return", "_held_slot", "_held", "_done", "_read_ahead", "__weakref__")

    def __init__(self, begin: Callable[["EpochIterator"], None]):
        self._begin: Callable[[EpochIterator], None] | None = begin  # the loader's: starts the epoch, calls run()
        self._last: dict[str, Any] | None = None
        self._held_slot: int | None = None
        self._held: Lease | None = None  # the held zero-copy batch's views
        self._done = False

    def run(self, epoch: int, start: int, epochs: EpochCounter, queue: HandOff,
            release: Callable[[int], None], stats: StatsRecorder, cost: TrainerCost, cursor: Cursor,
            limit: int | None = None, kept: KeptBatches | None = None,
            tune: Callable[[float], float | None] | None = None,
            ended: Callable[[int], None] = lambda epoch: None, reading: Callable[[], None] | None = None,
            on_device: bool = False) -> None:
        """The epoch started (the loader's ``begin``, at the first ``next()``): what this iterator reads from."""
        self._epoch = epoch
        self._reading = reading  # a batch goes out: a cache's reader lease is renewed (throttled there); None: none
        self._on_device = on_device  # device calls are counted around next() (a CPU host makes none)
        self._start = start  # the loader's count of epoch starts when this one started
        self._ended = ended
        self._tune = tune  # workers="auto": called at a next() once its time comes; returns the next time
        self._tune_at: float | None = 0.0 if tune is not None else None
        self._kept = kept
        self._epochs = epochs  # its ``starts``: another start made this iterator stale (an attribute, not a call)
        self._queue = queue
        self._release = release
        self._stats = stats
        self._cost = cost
        self._cursor = cursor
        self._limit = limit  # batches every rank yields this epoch (equal_batches), or None: as many as there are
        self._padding = False
        self._last_return: float | None = None
        # a batch the hand-off read ahead goes out with no more than that (the light path, below), where nothing
        # else must happen at a next(): no device calls to count, no equal_batches limit, no tuning
        light = getattr(queue, "read_ahead", None)
        self._read_ahead: Callable[[int | None], DeviceBatch | None] | None = (
            light if not on_device and limit is None and tune is None else None)

    def __iter__(self) -> "EpochIterator":
        return self

    def _release_held(self) -> None:
        """The zero-copy batch handed out last gives its slot back (``__del__``; ``next()`` hands it to the pool
        with its take)."""
        slot = self._let_go()
        if slot is not None:
            self._release(slot)

    def _let_go(self) -> int | None:
        """The zero-copy batch handed out last: its tensors detached, its slot (or None)."""
        slot = self._held_slot
        if slot is None:
            return None
        if self._last is not None and self._held is not None:
            # equal_batches may repeat it as padding after its slot is reused: keep a copy
            self._last = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self._last.items()}
        self._drop_views()
        return slot

    def _drop_views(self) -> None:
        """A reference the loop kept to the held zero-copy batch raises on use from now on (views.py)."""
        if self._held is not None:
            self._held.released = True
            self._held = None
        self._held_slot = None

    def loader_closed(self) -> None:
        """The ring is about to be unmapped: a zero-copy batch still held must raise, not read freed memory."""
        self._drop_views()
        self._done = True

    def __next__(self) -> dict[str, Any]:
        called = time.perf_counter()
        if self._begin is not None:  # the first next(): the epoch starts now, so an iter() never read changes nothing
            self._begin(self)
            self._begin = None
        read_ahead = self._read_ahead
        if read_ahead is not None and not self._done and self._start == self._epochs.starts:
            item = read_ahead(self._held_slot)
            if item is not None:  # the light path: nothing to wait for, no lock, no system call
                self._drop_views()
                if self._kept is not None:
                    self._kept.collect()
                batch = self._deliver(item, called, 0.0)
                self._cost.loop_ns += int((self._last_return - called) * 1e9)  # type: ignore[operator]
                return batch
        cpu, cost = time.thread_time_ns(), self._cost
        if not self._on_device:
            try:
                return self._next(called)
            finally:
                cost.loop_ns += time.thread_time_ns() - cpu
        calls, copying = cost.device_calls_here(), cost.standin_here()
        try:
            return self._next(called)
        finally:  # (a stand-in device's copies are its copy engine's time: not the loop's)
            cost.loop_ns += time.thread_time_ns() - cpu - (cost.standin_here() - copying)
            cost.loop_calls += cost.device_calls_here() - calls

    def _next(self, called: float) -> dict[str, Any]:
        release = self._let_go()
        if self._kept is not None:
            self._kept.collect()
        if self._done:
            if release is not None:
                self._release(release)
            raise StopIteration
        if self._start != self._epochs.starts:
            raise LoaderError(f"epoch {self._epoch} was abandoned when another epoch started (an iter() of the "
                              f"loader was read from); take its batches before starting the next")
        if self._limit is not None and self._cursor.batches >= self._limit:
            if release is not None:
                self._release(release)
            self._finish()  # the other ranks have no more batches: stop with them (equal_batches)
        if self._tune_at is not None and called >= self._tune_at:
            assert self._tune is not None
            self._tune_at = self._tune(called)
        item = self._queue.get(release)
        wait = time.perf_counter() - called
        if item is None:
            last = self._last_return
            self._stats.step(wait, called - last if last is not None else None)
            if self._limit is not None and self._cursor.batches < self._limit and self._last is not None:
                return self._pad()
            self._finish()
        assert item is not None
        return self._deliver(item, called, wait)

    def _deliver(self, item: DeviceBatch, called: float, wait: float) -> dict[str, Any]:
        """Hand ``item`` to the loop, ``wait`` seconds after it called: counted, its slot held, the cursor moved."""
        last = self._last_return
        self._stats.step(wait, called - last if last is not None else None, item.nbytes)
        self._cost.batches += 1
        tensors = item.tensors
        if item.slot is not None and self._kept is not None:  # copy mode: the slot's until let go
            self._kept.hold(item.slot, tensors)
        elif item.slot is not None:  # zero-copy: views of the slot (SlotView), valid until the next next()
            self._held_slot = item.slot
            self._held = item.lease
        self._cursor.record(*item.origin)
        if self._reading is not None:
            self._reading()
        self._last_return = time.perf_counter()
        batch = {**tensors, **item.extra}
        if self._limit is not None:
            self._last = batch
        return batch

    def _finish(self) -> None:
        self._done = True
        self._last_return = None
        if not self._cursor.finished:
            self._cursor.finished = True
            self._ended(self._epoch)
        raise StopIteration

    def _pad(self) -> dict[str, Any]:
        """This rank ran out before the others: repeat its last batch (a copy: its slot may be reused)."""
        if not self._padding:
            self._padding = True
            log.warning("epoch %d: this rank ran out of batches before the other ranks (samples were skipped, or "
                        "equal_batches=pad); repeating its last batch to keep the ranks in step", self._epoch)
        assert self._last is not None
        self._cursor.batches += 1
        self._last_return = time.perf_counter()
        return {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in self._last.items()}

    def __del__(self) -> None:
        try:
            self._release_held()
        except Exception:
            pass
