"""Hand-offs with no thread between the pool and the loop: what ``next()`` itself does with a filled slot.

- ``DirectHandOff`` (a CPU host): tensors that view the slot (``zero_copy``), given back at the following
  ``next()``, or (copy mode) once nothing references them (``ring/kept.py``). When the ring is ahead of the
  loop, one ``next()`` reads up to ``AHEAD`` filled batches and the next ones only hand them out (below).
- ``DirectCopy`` (a device with ``transfer_threads=0``): ``next()`` issues the slot's one copy itself,
  on the loop's own stream (``slots.py``), and copies up to ``device_queue`` more batches ahead, so the
  loop never waits for a copy and no other thread wakes: per batch one query, one copy, one event
  recorded — the training process's budget (DESIGN.md, "The training process's share").

Each has the interface the iterator reads: ``get(release)`` (the next batch, or None at the epoch's end;
``release``: the zero-copy slot the loop has let go), ``start_epoch``, ``depth``, ``capacity``, ``close``.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, NamedTuple

import numpy as np
import torch

from ..layout import side
from ..ring.batch_ring import BatchRing, RingLayout
from ..ring.kept import KeptBatches
from ..ring.views import Lease, SlotView, views_of
from ..stats import StatsRecorder
from ..workers.pool import WorkerPool
from ..workers.scheduler import EpochEnd, ReadyBatch
from .device_decode import DeviceDecoder
from .slots import DeviceSlots

log = logging.getLogger("feedline.loader")

CALLS = 3  # device calls a next() may make on the loop's thread (the budget), past the epoch's first batches
STOCK = 8  # zero-copy views made ahead a slot at least (DirectHandOff.restock): a second's at ~40 steps/s on 5 slots
MAX_STOCK = 256  # ... and at most: what a slot hands out between two ticks at a step far faster than anyone's
AHEAD = 8  # DirectHandOff: batches one next() reads when that many are filled already (get)
READ_AHEAD_MEMORY = 64 << 20  # ring memory a CPU host's default ring may add for reading that many ahead


class DeviceBatch(NamedTuple):
    """A batch ready for the loop: its tensors, and what to release or wait on when it is taken (a tuple: one
    a batch)."""

    epoch: int
    seq: int
    tensors: dict[str, torch.Tensor]
    extra: dict[str, list[Any]]  # the side fields: keys, text, JSON, bytes
    origin: tuple[int, int, int]  # (worker, its batch number, its stream position after it): the resume cursor
    slot: int | None = None  # a CPU host's: the ring slot the tensors view, given back by the iterator
    event: Any = None  # transfer_threads with h2d="fields": the CUDA event the consumer's stream waits on
    nbytes: int = 0  # payload bytes (tensors and side fields)
    device_slot: int | None = None  # h2d="slot": the slot whose device buffer it views
    lease: Lease | None = None  # zero-copy: what releases the batch's views when its slot goes back


def cpu_ring_slots(slots: int, slot_bytes: int) -> int:
    """A CPU host's default ring: ``slots`` (``default_ring_slots``) grown, within ``READ_AHEAD_MEMORY``, to the
    ``2 * AHEAD + 1`` slots that let one ``next()`` read ``AHEAD`` batches while as many go back to the workers
    (at a take, only the slots not just given back can be filled). Small batches get it all (each read in a row
    costs a fraction of the first, cold); a batch of tens of MB gets a slot or none, and its steps are long
    enough that reading ahead matters less."""
    want = 2 * AHEAD + 1
    if slots >= want:
        return slots
    return slots + min(want - slots, READ_AHEAD_MEMORY // max(1, slot_bytes))


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

    With ``kept`` (copy mode) the tensors view the slot through its own frame, so a batch the loop keeps
    can be moved out of the ring; zero-copy, each slot's tensors are made once and sliced for a partial batch.
    """

    capacity = 0

    def __init__(self, pool: WorkerPool, ring: BatchRing, stats: StatsRecorder, kept: KeptBatches | None = None,
                 decoder: DeviceDecoder | None = None):
        self._pool = pool
        self._ring = ring
        self._stats = stats
        self._decoder = decoder
        self._kept = kept
        self._layout = ring.layout
        self._slots: list[tuple[dict[str, torch.Tensor], side.SideRegion, int] | None] = [None] * ring.slots
        # zero-copy: fresh SlotViews of each slot, made ahead at the dispatcher's tick (restock); each is handed out
        # once, never re-armed, so a reference kept past its batch still raises
        self._stock: list[list[tuple[dict[str, SlotView], Lease]]] = [[] for _ in range(ring.slots)]
        self._handed = [0] * ring.slots  # views each slot handed out since the last restock: its next stock's size
        self._epoch = -1
        self._ahead: deque[DeviceBatch | None] = deque()  # read ahead, in delivery order (None: the epoch's end)
        self._returned: list[int] = []  # slots let go while batches read ahead were handed out: given back together
        # at most half the ring's other slots out of the workers' hands: read ahead, or let go and not given back
        # (a CPU host's default ring has room for AHEAD: cpu_ring_slots)
        self._read_at_most = max(1, min(AHEAD, (ring.slots - 1) // 2)) if decoder is None else 1

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        # batches read ahead for the epoch left: their slots go back with the next take, under the new epoch
        self._returned += [b.slot for b in self._ahead if b is not None and b.slot is not None]
        self._ahead.clear()

    def _read(self, slot: int, samples: int) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]], int]:
        if self._kept is not None:  # copy mode maps a slot anew after a kept batch moved out
            return read_slot(self._kept.views(slot), self._layout, samples)
        cached = self._slots[slot]
        if cached is None:
            views = self._ring.slot(slot)
            tensors = {name: torch.from_numpy(views[name]) for name in self._layout.tensor_names}
            cached = self._slots[slot] = (tensors, side.SideRegion.of(views), sum(t.nbytes for t in tensors.values()))
        tensors, region, nbytes = cached
        if samples != self._layout.batch_size:  # an epoch's last, partial batch
            tensors = {k: v[:samples] for k, v in tensors.items()}
            nbytes = sum(t.nbytes for t in tensors.values())
        extra, side_bytes = side.read(region, samples, self._layout.side_fields)
        return tensors, extra, nbytes + side_bytes

    def read_ahead(self, release: int | None) -> DeviceBatch | None:
        """The next batch if it was read ahead (``release`` then waits in ``_returned``), else None: the iterator's
        light path, which needs nothing else."""
        ahead = self._ahead
        if not ahead or ahead[0] is None:
            return None
        if release is not None:
            self._returned.append(release)
        return ahead.popleft()

    def get(self, release: int | None = None) -> DeviceBatch | None:
        """The next batch. One read ahead is handed out with no call into the pool: the slot let go meanwhile
        waits in ``_returned``, and they all go back with the next take, their fills sent in one pass.

        A take reads ahead the batches after its own while they are filled already, up to ``AHEAD`` in all (fewer
        where the ring is small: at most half its other slots wait read ahead or let go), under the same lock.
        After a step of milliseconds the loop's caches are cold, and the pool's path (lock, scheduler, fill,
        results) is most of a ``next()``'s cost: read in a row, the batches after the first cost a fraction of
        it, and the ``next()`` calls that hand them out call nothing. Only a ring ahead of the loop reads ahead:
        where the workers are behind, the next batch is not filled yet, and the look costs one read of a pipe
        that is empty. A slot let go meanwhile goes back a few batches later, to workers that are ahead."""
        ahead = self._ahead
        if ahead:
            if release is not None:
                self._returned.append(release)
            return ahead.popleft()
        more = self._returned
        if more:
            self._returned = []
            if release is None:
                release = more.pop()
        reads = self._read_at_most - 1
        take = self._pool.take
        while True:
            read: list[ReadyBatch | EpochEnd] = []
            item = take(0.5, release, more, reads, read)
            release, more = None, []
            if item is None:
                continue
            batch = None
            for it in (item, *read):
                if type(it) is EpochEnd:
                    if it.epoch == self._epoch:
                        if batch is None:
                            self._returned += more
                            return None
                        ahead.append(None)
                    continue
                if it.epoch != self._epoch:  # an abandoned epoch's: its slot goes back
                    (more if batch is None else self._returned).append(it.slot)
                elif batch is None:
                    batch = self._batch(it)
                else:
                    ahead.append(self._batch(it))
            if batch is not None:
                return batch
            if more:
                release = more.pop()

    def _batch(self, item: ReadyBatch) -> DeviceBatch:
        tensors, extra, nbytes = self._read(item.slot, item.samples)
        if self._decoder is not None:
            tensors, extra = self._decoder.apply(tensors, extra)
        lease = None
        if self._kept is None:  # zero-copy: views that raise once the slot is given back
            tensors, lease = self._views(item.slot, tensors)
        return DeviceBatch(item.epoch, item.seq, tensors, extra, origin(item), slot=item.slot, nbytes=nbytes,
                           lease=lease)

    def _views(self, slot: int, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Lease]:
        cached = self._slots[slot]
        stock = self._stock[slot]
        if cached is not None and tensors is cached[0]:  # a whole batch of the slot's own tensors
            self._handed[slot] += 1
            if stock:
                return stock.pop()  # type: ignore[return-value]
        return views_of(tensors)  # type: ignore[return-value]

    def restock(self) -> None:
        """The dispatcher's, at its tick: a slot whose views were handed out gets fresh ones, so ``next()`` makes
        no tensor object itself. After a step of a few milliseconds or more torch's code is cold, and a batch's
        views made in ``next()`` then cost 25-45 µs of the loop's CPU here (1.6 µs in a row); made here, in a
        row, they cost that 1.6 µs. Each slot is topped up to what it handed out since the last tick, a quarter
        more (``STOCK`` at least, ``MAX_STOCK`` at most): at 250 steps/s a slot hands out ~50 a second."""
        if self._decoder is not None:
            return
        for slot, (cached, stock) in enumerate(zip(self._slots, self._stock)):
            if cached is None:
                continue
            want = min(MAX_STOCK, max(STOCK, self._handed[slot] + self._handed[slot] // 4))
            self._handed[slot] = 0
            while len(stock) < want:
                stock.append(views_of(cached[0]))

    def depth(self) -> int:
        """Batches read ahead, not handed out yet."""
        return sum(1 for b in self._ahead if b is not None)

    def close(self) -> None:
        pass


class DirectCopy:
    """``transfer_threads=0`` on a device: ``next()`` copies slots itself (see the module's docstring).

    Copies go on the loop's current stream, in its order: a buffer is copied into again only after the
    work the loop launched on its previous batch, with no event between; a slot goes back to the workers
    once the newest copy of a batch already handed out has landed (one query releases every slot copied
    before it). A loop that changes streams between steps gets the new stream made to wait for the old.
    """

    def __init__(self, pool: WorkerPool, ring: BatchRing, stats: StatsRecorder, slots: DeviceSlots, ahead: int,
                 decoder: DeviceDecoder | None = None):
        self._pool = pool
        self._ring = ring
        self._stats = stats
        self._slots = slots
        self._gpu = slots.gpu
        self._decoder = decoder
        self.capacity = ahead
        self._ready: deque[DeviceBatch] = deque()  # copied ahead, in delivery order
        self._pending: deque[list[Any]] = deque()  # [slot, handed out]: copies that may not have landed
        self._ended = False  # the pool said the epoch's batches are all taken
        self._epoch = -1
        self._stream: Any = None  # the loop's stream at the last next()
        self._switch = self._gpu.event()  # marks the old stream when the loop changes streams
        self._start = self._gpu.event(timing=True)
        self._timer: list[Any] | None = None  # [slot, landed]: a copy being timed (start .. copied[slot])
        self._time_next = False  # this next() times its first copy (its query skipped: the call it needs)
        self._calls = 0  # device calls left to this next()

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._ended = False
        for b in self._ready:  # copied for an abandoned epoch: their slots go back once landed
            for entry in self._pending:
                if entry[0] == b.device_slot:
                    entry[1] = True
        self._ready.clear()

    def depth(self) -> int:
        return len(self._ready)

    def get(self, release: int | None = None) -> DeviceBatch | None:
        gpu = self._gpu
        stream = gpu.current_stream()
        if self._stream is not None and stream != self._stream:  # the old stream's work first, on the device
            gpu.record(self._switch, self._stream)
            gpu.wait(stream, self._switch)
        self._stream = stream
        self._calls = CALLS
        self._time_next = self._timer is None and self._slots.time_this()
        if not self._time_next:  # a later query gives back every slot this one would have
            self._land()
        while not self._ready:
            if self._ended:
                return None
            item = self._pool.take()
            if item is None:  # the loop waits: slots whose copy landed go back now, whatever it costs
                self._land_all()
                continue
            if not self._accept(item):
                continue
            self._ready.append(self._copy(item, stream))
        batch = self._ready.popleft()
        for entry in self._pending:
            if entry[0] == batch.device_slot:
                entry[1] = True
                break
        self._ahead(stream)
        return batch

    def _accept(self, item: ReadyBatch | EpochEnd) -> bool:
        """True for a batch of this epoch; an EpochEnd ends it, a stale batch's slot goes back."""
        if type(item) is EpochEnd:
            if item.epoch == self._epoch:
                self._ended = True
            return False
        if item.epoch != self._epoch:  # type: ignore[union-attr]
            self._pool.release(item.slot)  # type: ignore[union-attr]
            return False
        return True

    def _ahead(self, stream: Any) -> None:
        """Copy the batches already filled, up to ``capacity`` ahead, while this next()'s budget allows."""
        while len(self._ready) < self.capacity and not self._ended and self._calls >= 2:
            item = self._pool.poll()
            if item is None:
                return
            if self._accept(item):
                self._ready.append(self._copy(item, stream))

    def _copy(self, item: ReadyBatch, stream: Any) -> DeviceBatch:
        slots, start = self._slots, None
        views = self._ring.slot(item.slot)
        extra, side_bytes = side.read(views, item.samples, self._ring.layout.side_fields)
        host = None
        if self._decoder is not None:  # decoded from the pinned slot before the copy's event is recorded
            host = {k: torch.from_numpy(views[k][: item.samples]) for k in self._ring.layout.tensor_names}
        if self._time_next and self._calls >= 3:
            start, self._timer, self._time_next = self._start, [item.slot, False], False
        tensors = slots.copy(item.slot, item.samples, stream, start)
        self._calls -= 2 + (start is not None)
        self._pending.append([item.slot, False])
        nbytes = sum(t.nbytes for t in tensors.values()) + side_bytes
        if host is not None:
            assert self._decoder is not None
            tensors, extra = self._decoder.apply(tensors, extra, host)
        return DeviceBatch(item.epoch, item.seq, tensors, extra, origin(item), nbytes=nbytes, device_slot=item.slot)

    def _land(self) -> None:
        """One call: a timed copy's time read, or a query of the newest copy of a batch handed out."""
        if self._calls < 1:
            return
        self._calls -= 1
        if self._timer is not None and self._timer[1]:  # its span ended: read it, then its slot goes back
            self._read_timer()
            return
        pending = self._pending
        newest = next((i for i in range(len(pending) - 1, -1, -1) if pending[i][1]), None)
        if newest is None:
            self._calls += 1
            return
        if self._gpu.query(self._slots.copied[pending[newest][0]]):  # one stream: every copy before it landed
            for _ in range(newest + 1):
                self._release(pending.popleft()[0])

    def _read_timer(self) -> None:
        assert self._timer is not None
        slot, self._timer = self._timer[0], None
        seconds = self._gpu.elapsed(self._start, self._slots.copied[slot])
        self._stats.h2d(seconds, waited=seconds * self._slots.every)  # copies run on the loop's stream
        self._pool.release(slot)

    def _land_all(self) -> None:
        """The loop waits for a batch: every slot whose copy landed goes back; if none has and the workers have
        no free slot, wait for the oldest copy (the device is behind: the loop had nothing to launch)."""
        pending, gpu = self._pending, self._gpu
        while pending and gpu.query(self._slots.copied[pending[0][0]]):
            self._release(pending.popleft()[0])
        if pending and self._pool.free_slots() == 0:
            gpu.synchronize(self._slots.copied[pending[0][0]])
            self._release(pending.popleft()[0])
        if self._timer is not None and self._timer[1]:
            self._read_timer()

    def _release(self, slot: int) -> None:
        if self._timer is not None and self._timer[0] == slot:  # its time is read first (at the next call)
            self._timer[1] = True
            return
        self._pool.release(slot)

    def close(self) -> None:
        self._ready.clear()
        self._pending.clear()
