"""Transfer threads: filled slots become batches the training loop can use.

With CUDA, each thread copies from the pinned ring to the device on its own
stream and records an event; the slot is freed once the copy completed. On a
CPU-only host no thread is needed: the loop gets tensors viewing the slot
(DirectHandOff), freed at its next ``next()`` with ``zero_copy``, else once
nothing references them (``kept.py``).
The device queue is bounded by a window of sequence numbers, so it stays
ordered and can never deadlock. Each transfer thread keeps a heartbeat while
it holds a batch; the loop's wait on the queue reads them (``watch``), so a
copy or a decode that never completes ends in a ``LoaderError`` naming it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...preflight import fmt_bytes
from ..errors import LoaderError
from ..layout import side
from ..ring.batch_ring import BatchRing, RingLayout
from ..ring.kept import KeptBatches
from ..stats import StatsRecorder
from ..watchdog import Heartbeat
from ..workers.pool import WorkerPool
from ..workers.scheduler import EpochEnd, ReadyBatch
from .device_decode import DeviceDecoder

log = logging.getLogger("feedline.loader")


@dataclass
class DeviceBatch:
    """A batch ready for the loop: its tensors, and what to release or wait on when it is taken."""

    epoch: int
    seq: int
    tensors: dict[str, torch.Tensor]
    extra: dict[str, list[Any]]  # the side fields: keys, text, JSON, bytes
    origin: tuple[int, int, int]  # (worker, its batch number, its stream position after it): the resume cursor
    slot: int | None = None  # a CPU host's: the ring slot the tensors view, given back by the iterator
    event: Any = None  # CUDA event the consumer's stream waits on


class DeviceQueue:
    """Batches ready for the training loop, handed out in sequence order (they hold no ring slot)."""

    def __init__(self, capacity: int, in_order: bool):
        self.capacity = capacity
        self._in_order = in_order
        self._cv = threading.Condition()
        self._items: dict[int, DeviceBatch] = {}
        self._epoch = -1
        self._next = 0
        self._end: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._watch: Callable[[], None] | None = None

    def watch(self, check: Callable[[], None]) -> None:
        """Called while the loop waits in ``get``; raises when a stage behind the queue stopped answering."""
        self._watch = check

    def start_epoch(self, epoch: int) -> None:
        with self._cv:
            self._items.clear()
            self._epoch, self._next, self._end = epoch, 0, None
            self._cv.notify_all()

    def put(self, item: DeviceBatch) -> bool:
        """Blocks while the window is full; False if the item is stale (dropped)."""
        with self._cv:
            while (item.epoch == self._epoch and not self._closed and self._error is None
                   and item.seq >= self._next + self.capacity):
                self._cv.wait(0.5)
            if item.epoch != self._epoch or self._closed:
                return False
            self._items[item.seq] = item
            self._cv.notify_all()
            return True

    def finish(self, epoch: int, batches: int) -> None:
        with self._cv:
            if epoch == self._epoch:
                self._end = batches
                self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def get(self) -> DeviceBatch | None:
        """The next batch, or None at the end of the epoch."""
        with self._cv:
            while True:
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise LoaderError("the loader was closed")
                key = self._next if self._in_order else (min(self._items) if self._items else None)
                if key is not None and key in self._items:
                    self._next += 1
                    self._cv.notify_all()
                    return self._items.pop(key)
                if self._end is not None and self._next >= self._end:
                    return None
                self._cv.wait(0.5)  # bounded, so Ctrl-C is seen promptly
                if self._watch is not None:
                    try:
                        self._watch()
                    except LoaderError as exc:
                        self._error = exc  # every later get() raises it too, without another look
                        raise

    def depth(self) -> int:
        with self._cv:
            return len(self._items)


def pin_ring(ring: BatchRing) -> int:
    """Page-lock the whole ring once so every copy to the GPU can be asynchronous; the pointer to unregister."""
    ptr = ring.memory.base.ctypes.data
    err = torch.cuda.cudart().cudaHostRegister(ptr, ring.memory.size, 0)
    if int(getattr(err, "value", err)) != 0:
        raise LoaderError(f"cudaHostRegister of the {fmt_bytes(ring.memory.size)} ring failed: {err}")
    return ptr


def origin(item: ReadyBatch) -> tuple[int, int, int]:
    return item.worker, item.batch, item.stream_pos


def read_slot(views: dict[str, np.ndarray], layout: RingLayout,
              samples: int) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]], int]:
    """(tensors viewing the first ``samples`` rows of a slot's ``views`` — no copy —, its side fields as lists,
    bytes)."""
    tensors = {name: torch.from_numpy(views[name][:samples]) for name in layout.tensor_names}
    extra, side_bytes = side.read(views, samples, layout.side_fields)
    return tensors, extra, sum(t.nbytes for t in tensors.values()) + side_bytes


class DirectHandOff:
    """A CPU host: the loop takes filled slots straight from the pool, no thread between.

    Same interface as DeviceQueue; one thread hand-off fewer per batch. With ``kept`` (copy mode) the
    tensors view the slot through its own frame, so a batch the loop keeps can be moved out of the ring.
    """

    capacity = 0

    def __init__(self, pool: WorkerPool, ring: BatchRing, stats: StatsRecorder, kept: KeptBatches | None = None,
                 decoder: DeviceDecoder | None = None):
        self._pool = pool
        self._ring = ring
        self._stats = stats
        self._decoder = decoder
        self._views = kept.views if kept is not None else ring.slot
        self._epoch = -1

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def get(self) -> DeviceBatch | None:
        while True:
            item = self._pool.take()
            if item is None:
                continue
            if isinstance(item, EpochEnd):
                if item.epoch == self._epoch:
                    return None
                continue
            if item.epoch != self._epoch:
                self._pool.release(item.slot)
                continue
            tensors, extra, nbytes = read_slot(self._views(item.slot), self._ring.layout, item.samples)
            if self._decoder is not None:
                tensors, extra = self._decoder.apply(tensors, extra, (item.worker, item.batch))
            self._stats.transferred(nbytes, None)
            return DeviceBatch(item.epoch, item.seq, tensors, extra, origin(item), slot=item.slot)

    def depth(self) -> int:
        return 0

    def close(self) -> None:
        pass


class TransferStage:
    """T threads in the trainer process copying batches from the pinned ring to the GPU."""

    def __init__(self, pool: WorkerPool, ring: BatchRing, queue: DeviceQueue, stats: StatsRecorder,
                 threads: int, device: torch.device, decoder: DeviceDecoder | None = None):
        self._pool = pool
        self._decoder = decoder
        self._ring = ring
        self._queue = queue
        self._stats = stats
        self._device = device
        self._stop = threading.Event()
        self._beats = [Heartbeat(f"transfer thread {i}") for i in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(beat,), name=f"feedline-transfer-{i}", daemon=True)
                         for i, beat in enumerate(self._beats)]
        for t, beat in zip(self._threads, self._beats):
            beat.thread = t
            t.start()
        queue.watch(self.check)  # the loop's wait on the queue reads these threads' heartbeats

    def check(self) -> None:
        """Raise for a thread that has held one batch for ``stall_timeout`` (a copy or a decode that never ends),
        or for a dispatcher that stopped answering (the loop calls this while it waits)."""
        bound = self._pool.stall_timeout
        for beat in self._beats:
            exc = beat.stalled(bound) if beat.busy else None
            if exc is not None:
                raise exc
        self._pool.check_dispatcher()

    def stop(self) -> None:
        """Ask the threads to finish their current batch and exit (``close`` waits for them)."""
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5.0)

    def _run(self, beat: Heartbeat) -> None:
        stream = torch.cuda.Stream(self._device)
        finished = -1
        try:
            while not self._stop.is_set():
                beat.beat()
                item = self._pool.take()
                if item is None:
                    continue
                if isinstance(item, EpochEnd):
                    self._queue.finish(item.epoch, item.batches)
                    finished = item.epoch
                    self._pool.wait_epoch_change(finished)
                    continue
                self._move(item, stream, beat)
        except BaseException as exc:
            if not self._stop.is_set():
                if not isinstance(exc, LoaderError):
                    log.exception("a transfer thread failed")
                self._queue.fail(exc)

    def _move(self, item: ReadyBatch, stream: Any, beat: Heartbeat) -> None:
        what = f"batch {item.seq} of worker {item.worker}"
        beat.beat(f"copying {what} to {self._device}" + (" (decoding its images)" if self._decoder else ""), True)
        views, extra, nbytes = read_slot(self._ring.slot(item.slot), self._ring.layout, item.samples)
        # blocking=True: the thread sleeps in synchronize() instead of spinning a core
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True, blocking=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            if self._decoder is not None:  # the images decoded on the device, straight from the pinned slot
                views, extra = self._decoder.apply(views, extra, (item.worker, item.batch))
            tensors = {k: v.to(self._device, non_blocking=True) for k, v in views.items()}
            done.record(stream)
        beat.beat(f"handing {what} to the loop")  # waits as long as the loop keeps the queue full: not a stall
        self._queue.put(DeviceBatch(item.epoch, item.seq, tensors, extra, origin(item), event=done))
        beat.beat(f"waiting for the copy of {what} to land", True)
        done.synchronize()  # blocks this thread only; the slot is reusable once the copy landed
        beat.beat()
        self._pool.release(item.slot)
        self._stats.transferred(nbytes, start.elapsed_time(done) / 1000.0)
