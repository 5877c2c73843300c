"""The scheduler: which worker fills which ring slot next, and which filled batch the loop takes next.

Batches are keyed ``(j, w)``: batch j of worker w. Delivery order is
round-robin over the workers that still have data, and free slots are handed
out in that same order, so the batch the consumer needs next always has a slot
and the ring cannot deadlock. The scheduler is plain bookkeeping: no
processes, no threads, no locks (its one caller, the worker pool, holds one).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from ..stats import BUDGET_EXEMPT
from .messages import DONE, ERROR_REASONS, BatchResult

_BUDGETED = tuple(reason not in BUDGET_EXEMPT for reason in ERROR_REASONS)


class ReadyBatch(NamedTuple):
    """A filled slot, with its place in the epoch's delivery order and where it came from (a tuple: one a
    batch)."""

    epoch: int
    seq: int
    slot: int
    samples: int
    worker: int
    batch: int  # the worker's batch number j
    stream_pos: int  # the worker's stream position after this batch: where a resume starts it


@dataclass(frozen=True)
class EpochEnd:
    """Every batch of ``epoch`` has been taken."""

    epoch: int
    batches: int


@dataclass(frozen=True)
class EpochProgress:
    """Where the epoch is now: batches the consumer took, samples each worker's stream has delivered."""

    epoch: int
    batches_taken: int
    delivered: tuple[int, ...]  # per worker: stream position after its last answered batch
    ended: tuple[bool, ...]  # per worker: its stream is exhausted


class Scheduler:
    """Slots and batch order for one epoch at a time, for ``workers`` workers sharing ``slots`` slots."""

    def __init__(self, slots: int, workers: int, in_order: bool = True):
        self.slots = slots
        self.workers = workers
        self.in_order = in_order
        self.epoch = -1
        self.free: deque[int] = deque(range(slots))
        self._ready: dict[tuple[int, int], tuple[int, int, int]] = {}  # (j, w) -> (slot, samples, stream pos)
        self._outstanding: list[deque[tuple[int, int, int]]] = [deque() for _ in range(workers)]  # (epoch, slot, j)
        self._ended_at: list[int | None] = [None] * workers  # first j a worker answered END this epoch
        self._last_end: int | None = None  # max(_ended_at) once every worker ended, else None
        self._delivered: list[int] = [0] * workers
        self._first: list[int] = [0] * workers  # each worker's first batch number this epoch (a resume)
        self._assign_at = (0, 0)
        self._take_at = (0, 0)
        self.taken = 0
        self.samples = 0  # delivered by the workers this epoch
        self.error_counts = [0] * len(ERROR_REASONS)  # samples skipped this epoch, per reason
        self._errors = 0

    # -- epochs ------------------------------------------------------------------------------------

    def start_epoch(self, epoch: int, first: list[int] | None = None, delivered: list[int] | None = None,
                    workers: int | None = None, restart: bool = False) -> None:
        """Begin ``epoch`` (the pool's token for it); filled batches of an abandoned epoch return their slots now,
        outstanding ones on answer.

        A resumed epoch gives, per worker, the batches the loop already had (``first``) and the stream
        position after them (``delivered``); delivery goes on from there in the same order. ``workers``
        changes the worker count from this epoch on (``workers="auto"``, a resume of its state); a worker
        left out keeps its outstanding fills of the abandoned epoch until it answers them. A ``restart`` (the
        rest of the same epoch, split anew) keeps the epoch's sample and error counts: one failure budget.
        """
        for slot, _, _ in self._ready.values():
            self.free.append(slot)
        self._ready.clear()
        if workers is not None:
            self._outstanding += [deque() for _ in range(workers - len(self._outstanding))]
            self.workers = workers
        self.epoch = epoch
        self._first = list(first) if first is not None else [0] * self.workers
        self._delivered = list(delivered) if delivered is not None else [0] * self.workers
        self._assign_at = self._take_at = min((j, w) for w, j in enumerate(self._first))
        self.taken = 0
        if not restart:
            self.samples = 0
            self.error_counts = [0] * len(ERROR_REASONS)
            self._errors = 0
        self._ended_at = [None] * self.workers
        self._last_end = None

    @property
    def errors(self) -> int:
        """Bad samples skipped this epoch: the failure budget's count (evictions are not the data's fault)."""
        return self._errors

    @property
    def finished(self) -> bool:
        """Every worker's stream of this epoch is exhausted."""
        return self._last_end is not None

    def progress(self) -> EpochProgress:
        return EpochProgress(self.epoch, self.taken, tuple(self._delivered),
                             tuple(e is not None for e in self._ended_at))

    # -- hand-out ----------------------------------------------------------------------------------

    def next_fill(self) -> tuple[int, int, int] | None:
        """(worker, slot, j): the next free slot and the batch it is for, or None."""
        if self.epoch < 0 or not self.free:
            return None
        key = self._skip_ended(self._assign_at)
        if key is None:
            return None
        j, w = key
        slot = self.free.popleft()
        self._outstanding[w].append((self.epoch, slot, j))
        self._assign_at = self._advance(key)
        return w, slot, j

    def on_result(self, worker: int, r: BatchResult) -> bool:
        """Account a worker's answer; True when it belongs to the current epoch."""
        out = self._outstanding[worker]
        if out and out[0][1] == r.slot:
            out.popleft()
        if r.epoch != self.epoch:
            self.free.append(r.slot)
            return False
        self._delivered[worker] = r.stream_pos
        self.samples += r.samples
        if any(r.errors):
            self.error_counts = [a + b for a, b in zip(self.error_counts, r.errors)]
            self._errors = sum(n for n, budgeted in zip(self.error_counts, _BUDGETED) if budgeted)
        if r.kind == DONE:
            self._ready[(r.batch, worker)] = (r.slot, r.samples, r.stream_pos)
        else:  # END: the stream is exhausted, the slot comes back unused
            self.free.append(r.slot)
            ended = self._ended_at[worker]
            if ended is None or r.batch < ended:
                self._ended_at[worker] = r.batch
                ends = self._ended_at
                self._last_end = max(ends) if all(e is not None for e in ends) else None  # type: ignore[type-var]
        return True

    def add_errors(self, reason: str, n: int) -> None:
        """Samples found bad after the workers (``device_decode``): they count against the failure budget."""
        self.error_counts[ERROR_REASONS.index(reason)] += n
        self._errors = sum(n for n, budgeted in zip(self.error_counts, _BUDGETED) if budgeted)

    def redo(self, worker: int) -> list[tuple[int, int]]:
        """(slot, j) a replaced worker must fill again; its outstanding slots of older epochs come back."""
        keep = []
        out = self._outstanding[worker]
        for item in list(out):
            epoch, slot, j = item
            if epoch == self.epoch:
                keep.append((slot, j))
            else:
                out.remove(item)
                self.free.append(slot)
        return keep

    def delivered(self, worker: int) -> int:
        return self._delivered[worker]

    def busy(self, worker: int) -> bool:
        """The worker holds a slot to fill (one started ahead of the epoch that names it holds none)."""
        return worker < len(self._outstanding) and bool(self._outstanding[worker])

    # -- the consumer ------------------------------------------------------------------------------

    def take(self) -> ReadyBatch | EpochEnd | None:
        """The next batch in delivery order, EpochEnd once all are taken, or None while it is not ready."""
        if self.epoch < 0:
            return None
        if self.in_order:
            key = self._take_at
            if key not in self._ready:  # (a key that is ready needs no skipping: it was handed out in order)
                key = self._skip_ended(key)
                if key is None:
                    return EpochEnd(self.epoch, self.taken)
                self._take_at = key
        elif self._ready:
            key = min(self._ready)
        elif self.finished:
            return EpochEnd(self.epoch, self.taken)
        else:
            return None
        if key not in self._ready:
            return None
        slot, samples, pos = self._ready.pop(key)
        seq = self.taken
        self.taken += 1
        if self.in_order:
            self._take_at = self._advance(key)
        return ReadyBatch(self.epoch, seq, slot, samples, key[1], key[0], pos)

    def takeable(self) -> bool:
        """``take()`` would return a batch or the EpochEnd now: the only news worth waking the consumer for."""
        if self.epoch < 0:
            return False
        if self.in_order:
            key = self._skip_ended(self._take_at)
            return key is None or key in self._ready
        return bool(self._ready) or self.finished

    def waits_on(self) -> list[int]:
        """The workers whose next result may make ``take()`` return something: in order, the one whose batch
        comes next; out of order, every worker holding a slot."""
        if self.epoch < 0:
            return []
        if self.in_order:
            key = self._skip_ended(self._take_at)
            return [] if key is None else [key[1]]
        return [w for w, out in enumerate(self._outstanding) if out]

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def depths(self) -> dict[str, int]:
        return {"free": len(self.free), "decoded": len(self._ready)}

    # -- ordering ----------------------------------------------------------------------------------

    def _advance(self, key: tuple[int, int]) -> tuple[int, int]:
        j, w = key
        return (j, w + 1) if w + 1 < self.workers else (j + 1, 0)

    def _skip_ended(self, key: tuple[int, int]) -> tuple[int, int] | None:
        """The first key at or after ``key`` whose worker may still have that batch (and did not deliver it
        before a resume)."""
        ends, first, last = self._ended_at, self._first, self._last_end
        while True:
            if last is not None and key[0] >= last:
                return None
            e = ends[key[1]]
            if (e is None or key[0] < e) and key[0] >= first[key[1]]:
                return key
            key = self._advance(key)
