"""Transfer threads (``transfer_threads >= 1`` on a device): filled slots become batches on their own streams.

Each thread takes filled slots from the pool and moves them to the device on a stream of its own, one of two
ways (``h2d``):

- ``"slot"``: the slot's one copy into its device buffer (``slots.py``), events made once; the loop's side
  (``SlotHandOff``) makes its stream wait for the copy, marks the loop's use of the previous batch, and
  gives a slot back once a query says its copy landed — three device calls a batch on the loop's thread.
- ``"fields"`` (the path before it, kept to be compared on a GPU): a copy a field into new allocations,
  two events made a batch, the thread waiting for the copy to land before giving the slot back, and the
  loop's stream waiting on an event and ``record_stream`` a field (``iterator.py``).

The device queue is bounded by a window of sequence numbers, so it stays ordered and can never deadlock.
Each transfer thread keeps a heartbeat while it holds a batch; the loop's wait on the queue reads them
(``watch``), so a copy or a decode that never completes ends in a ``LoaderError`` naming it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..cost import TrainerCost
from ..errors import LoaderError
from ..layout import side
from ..ring.batch_ring import BatchRing
from ..stats import StatsRecorder
from ..watchdog import Heartbeat
from ..workers.pool import WorkerPool
from ..workers.scheduler import EpochEnd, ReadyBatch
from .device_decode import DeviceDecoder
from .gpu import Gpu
from .handoff import CALLS, DeviceBatch, origin, read_slot
from .slots import DeviceSlots

log = logging.getLogger("feedline.loader")


class DeviceQueue:
    """Batches ready for the training loop, handed out in sequence order (they hold no ring slot)."""

    def __init__(self, capacity: int, in_order: bool, cost: TrainerCost | None = None):
        self.capacity = capacity
        self._in_order = in_order
        self._cost = cost if cost is not None else TrainerCost()
        self._cv = threading.Condition()
        self._items: dict[int, DeviceBatch] = {}
        self._epoch = -1
        self._next = 0
        self._end: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._watch: Callable[[], None] | None = None
        self._putting = 0  # threads waiting in put() for the window: the only ones a get() need wake

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
                self._putting += 1
                try:
                    if self._cv.wait(0.5):
                        self._cost.woken()
                finally:
                    self._putting -= 1
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

    def ready(self) -> bool:
        """The next batch (or the epoch's end) is here: a ``get`` would not wait."""
        with self._cv:
            key = self._next if self._in_order else (min(self._items) if self._items else None)
            return (key is not None and key in self._items) or (self._end is not None and self._next >= self._end)

    def get(self, release: int | None = None) -> DeviceBatch | None:
        """The next batch, or None at the end of the epoch (``release``: unused, no slot is held here)."""
        with self._cv:
            while True:
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise LoaderError("the loader was closed")
                key = self._next if self._in_order else (min(self._items) if self._items else None)
                if key is not None and key in self._items:
                    self._next += 1
                    if self._putting:
                        self._cv.notify_all()
                    return self._items.pop(key)
                if self._end is not None and self._next >= self._end:
                    return None
                if self._cv.wait(0.5):  # bounded, so Ctrl-C is seen promptly
                    self._cost.woken()
                elif self._watch is not None:
                    try:
                        self._watch()
                    except LoaderError as exc:
                        self._error = exc  # every later get() raises it too, without another look
                        raise

    def depth(self) -> int:
        with self._cv:
            return len(self._items)


class SlotHandOff:
    """The loop's side of ``h2d="slot"`` with transfer threads: per ``next()`` its stream waits for the batch's
    copy (on the device), the previous batch's use is marked in its buffer's ``consumed`` event, and one query
    gives back the oldest slot whose copy landed. A slot goes back only after the loop's use of its buffer
    was marked, so a transfer thread never copies into a buffer the loop's stream may still read."""

    def __init__(self, queue: DeviceQueue, slots: DeviceSlots, pool: WorkerPool):
        self.queue = queue
        self.capacity = queue.capacity
        self._slots = slots
        self._gpu = slots.gpu
        self._pool = pool
        self._held: int | None = None  # the device slot of the batch handed out last
        self._pending: deque[int] = deque()  # slots whose batch the loop is done with, copy maybe not landed

    def start_epoch(self, epoch: int) -> None:
        self.queue.start_epoch(epoch)

    def depth(self) -> int:
        return self.queue.depth()

    def get(self, release: int | None = None) -> DeviceBatch | None:
        gpu, stream, pending = self._gpu, self._gpu.current_stream(), self._pending
        if self._held is not None:  # the loop has launched its work on the last batch
            self._slots.mark_consumed(self._held, stream)
            pending.append(self._held)
            self._held = None
        if pending and gpu.query(self._slots.copied[pending[0]]):
            self._pool.release(pending.popleft())
        if pending and not self.queue.ready():  # the loop will wait: give back every slot that can go
            while pending and gpu.query(self._slots.copied[pending[0]]):
                self._pool.release(pending.popleft())
            if pending and self._pool.free_slots() == 0:  # the device is behind: wait for the oldest copy
                gpu.synchronize(self._slots.copied[pending[0]])
                self._pool.release(pending.popleft())
        batch = self.queue.get()
        if batch is None:
            return None
        assert batch.device_slot is not None
        gpu.wait(stream, self._slots.copied[batch.device_slot])
        self._held = batch.device_slot
        return batch

    def close(self) -> None:
        self.queue.close()


class TransferStage:
    """T threads in the trainer process moving batches from the pinned ring to the device."""

    def __init__(self, pool: WorkerPool, ring: BatchRing, queue: DeviceQueue, stats: StatsRecorder,
                 threads: int, gpu: Gpu, cost: TrainerCost, slots: DeviceSlots | None = None,
                 decoder: DeviceDecoder | None = None):
        self._pool = pool
        self._decoder = decoder
        self._ring = ring
        self._queue = queue
        self._stats = stats
        self._gpu = gpu
        self._slots = slots  # h2d="slot"; None: "fields"
        self._stop = threading.Event()
        self._beats = [Heartbeat(f"transfer thread {i}") for i in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(beat,), name=f"feedline-transfer-{i}", daemon=True)
                         for i, beat in enumerate(self._beats)]
        for t, beat in zip(self._threads, self._beats):
            beat.thread = t
            t.start()
            cost.thread("transfer", t)
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
        gpu = self._gpu
        stream = gpu.stream()
        timer = (gpu.event(timing=True), gpu.event(timing=True))  # this thread's sampled copy time
        timing = False
        try:
            while not self._stop.is_set():
                beat.beat()
                if timing and gpu.query(timer[1]):
                    self._stats.h2d(gpu.elapsed(*timer))
                    timing = False
                item = self._pool.take()
                if item is None:
                    continue
                if isinstance(item, EpochEnd):
                    self._queue.finish(item.epoch, item.batches)
                    self._pool.wait_epoch_change(item.epoch)
                    continue
                if self._slots is not None:
                    timed = not timing and self._slots.time_this()
                    self._move_slot(item, stream, beat, timer if timed else None)
                    timing = timing or timed
                else:
                    self._move_fields(item, stream, beat)
        except BaseException as exc:
            if not self._stop.is_set():
                if not isinstance(exc, LoaderError):
                    log.exception("a transfer thread failed")
                self._queue.fail(exc)

    def _move_slot(self, item: ReadyBatch, stream: Any, beat: Heartbeat, timer: tuple[Any, Any] | None) -> None:
        assert self._slots is not None
        what = f"batch {item.seq} of worker {item.worker}"
        beat.beat(f"copying {what} to {self._gpu.device}" + (" (decoding its images)" if self._decoder else ""), True)
        views = self._ring.slot(item.slot)
        extra, side_bytes = side.read(views, item.samples, self._ring.layout.side_fields)
        host = None
        if self._decoder is not None:
            host = {k: torch.from_numpy(views[k][: item.samples]) for k in self._ring.layout.tensor_names}
        with self._gpu.on(stream):
            tensors = self._slots.copy(item.slot, item.samples, stream, *(timer or (None, None)))
            nbytes = sum(t.nbytes for t in tensors.values()) + side_bytes
            if host is not None:
                assert self._decoder is not None
                tensors, extra = self._decoder.apply(tensors, extra, host)
        beat.beat(f"handing {what} to the loop")  # waits as long as the loop keeps the queue full: not a stall
        if not self._queue.put(DeviceBatch(item.epoch, item.seq, tensors, extra, origin(item), nbytes=nbytes,
                                           device_slot=item.slot)):
            self._pool.release(item.slot)  # stale (an abandoned epoch): its copy is harmless, its slot goes back
        beat.beat()

    def _move_fields(self, item: ReadyBatch, stream: Any, beat: Heartbeat) -> None:
        """The path before ``h2d="slot"``: new allocations and two events a batch, a wait for the copy here."""
        gpu = self._gpu
        what = f"batch {item.seq} of worker {item.worker}"
        beat.beat(f"copying {what} to {gpu.device}" + (" (decoding its images)" if self._decoder else ""), True)
        views, extra, nbytes = read_slot(self._ring.slot(item.slot), self._ring.layout, item.samples)
        start, done = gpu.event(timing=True), gpu.event(timing=True)
        with gpu.on(stream):
            gpu.record(start, stream)
            if self._decoder is not None:  # the images decoded on the device, straight from the pinned slot
                views, extra = self._decoder.apply(views, extra)
            tensors = {k: gpu.to_device(v, stream) for k, v in views.items()}
            gpu.record(done, stream)
        beat.beat(f"handing {what} to the loop")  # waits as long as the loop keeps the queue full: not a stall
        self._queue.put(DeviceBatch(item.epoch, item.seq, tensors, extra, origin(item), event=done, nbytes=nbytes))
        beat.beat(f"waiting for the copy of {what} to land", True)
        gpu.synchronize(done)  # blocks this thread only; the slot is reusable once the copy landed
        beat.beat()
        self._pool.release(item.slot)
        self._stats.h2d(gpu.elapsed(start, done))


class FieldsHandOff:
    """The loop's side of ``h2d="fields"``: its stream waits for each batch's event, two timing events made a
    batch around that wait, and ``record_stream`` a tensor (the allocations were the copy stream's)."""

    def __init__(self, queue: DeviceQueue, gpu: Gpu, stats: StatsRecorder):
        self.queue = queue
        self.capacity = queue.capacity
        self._gpu = gpu
        self._stats = stats
        self._pending: list[tuple[Any, Any]] = []

    def start_epoch(self, epoch: int) -> None:
        self.queue.start_epoch(epoch)

    def depth(self) -> int:
        return self.queue.depth()

    def get(self, release: int | None = None) -> DeviceBatch | None:
        batch = self.queue.get()
        if batch is None:
            return None
        gpu = self._gpu
        stream = gpu.current_stream()
        before, after = gpu.event(timing=True), gpu.event(timing=True)
        gpu.record(before, stream)
        gpu.wait(stream, batch.event)
        gpu.record(after, stream)
        for t in batch.tensors.values():
            gpu.record_stream(t, stream)
        self._pending.append((before, after))
        while self._pending and gpu.query(self._pending[0][1]):
            b, a = self._pending.pop(0)
            self._stats.h2d_wait(gpu.elapsed(b, a))
        return batch

    def close(self) -> None:
        self.queue.close()


__all__ = ["CALLS", "DeviceBatch", "DeviceQueue", "FieldsHandOff", "SlotHandOff", "TransferStage"]
