"""The shared-memory batch ring: ``slots`` preallocated batches in one region.

The region is an anonymous ``memfd``: it has no name in ``/dev/shm``, it is
handed to worker processes as an inherited file descriptor, and the kernel
frees it when the last process holding it exits — so a crash, SIGKILL or
Ctrl-C can never leave a stale segment behind, and Docker's 64 MB ``/dev/shm``
default cannot cause a bus error in the ring. Its pages are still shared
memory and count against the container's memory limit (see preflight).

Only slot numbers cross process boundaries; each process maps the region and
builds the same numpy views over it from the layout.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import SettingError
from ...preflight import fmt_bytes, memory_budget
from ..layout.side import KEY, KEY_ONLY_SIDE_BYTES, SIDE_DATA, SIDE_LEN, SOURCE
from ..layout.spec import Field, Spec

_FIELD_ALIGN = 64
_PAGE = mmap.PAGESIZE
# Per worker: [epoch, what it is doing, shard ordinal, index] and the key of the sample in hand, so the
# trainer knows what a worker was doing when it died or stalled. What it is doing: a stream position
# >= 0 (decoding that sample), IDLE, SKIPPING (to its resume position; index counts), OPENING (a shard).
STATUS_WORDS = 4
STATUS_KEY_BYTES = 96  # the key of the sample in hand, NUL-terminated (longer keys are cut)
IDLE, SKIPPING, OPENING = -1, -2, -3


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class FieldSlot:
    """One array of a slot: a field (or its lengths) for the whole batch."""

    name: str
    dtype: str
    shape: tuple[int, ...]  # with the batch dimension first
    offset: int


class RingLayout:
    """Where each field's ``(batch, *shape)`` array sits inside one slot, and the side region after them."""

    def __init__(self, spec: Spec, batch_size: int, side_bytes: int = KEY_ONLY_SIDE_BYTES, labelled: bool = False):
        self.spec = spec
        self.batch_size = batch_size
        self.side_bytes = side_bytes
        self.labelled = labelled  # a mixture: each sample's source name travels after its key
        self.side_fields = (KEY, SOURCE, *spec.side_fields) if labelled else (KEY, *spec.side_fields)
        entries: list[FieldSlot] = []
        offset = 0

        def add(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
            nonlocal offset
            entries.append(FieldSlot(name, dtype, (batch_size,) + shape, offset))
            offset = _align(offset + nbytes * batch_size, _FIELD_ALIGN)

        for f in spec.tensor_fields:
            add(f.name, f.dtype, f.shape, f.nbytes)
            if f.variable:
                add(f.length_name, "<i4", (), 4)
        self.tensor_names = tuple(e.name for e in entries)
        add(SIDE_LEN, "<i4", (len(self.side_fields),), 4 * len(self.side_fields))
        add(SIDE_DATA, "|u1", (side_bytes,), side_bytes)
        self.entries = tuple(entries)
        self.slot_bytes = _align(max(offset, 1), _PAGE)

    def views(self, base: np.ndarray, slot: int) -> dict[str, np.ndarray]:
        start = slot * self.slot_bytes
        out = {}
        for e in self.entries:
            count = int(np.prod(e.shape, dtype=np.int64))
            dt = np.dtype(e.dtype)
            out[e.name] = base[start + e.offset : start + e.offset + count * dt.itemsize].view(dt).reshape(e.shape)
        return out

    @property
    def fields(self) -> tuple[Field, ...]:
        """The tensor fields (the side fields are ``side_fields``)."""
        return self.spec.tensor_fields


class RingMemory:
    """One mapping of the ring's memfd; the owner creates it, workers attach by fd."""

    def __init__(self, fd: int, size: int):
        self.fd = fd
        self.size = size
        self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = np.frombuffer(self._mm, dtype=np.uint8)

    @classmethod
    def create(cls, size: int) -> "RingMemory":
        fd = os.memfd_create("feedline-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            # Reserve every page now: an out-of-memory ring fails here, with a message,
            # instead of as SIGBUS in a worker later.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            raise MemoryError(f"cannot reserve {size} bytes of shared memory for the batch ring: {exc}") from None
        return cls(fd, size)

    def close(self) -> None:
        if self._mm is None:
            return
        self.base = np.empty(0, np.uint8)
        try:
            self._mm.close()
        except BufferError:
            # A zero-copy batch still references the ring; the mapping goes when it does.
            pass
        self._mm = None
        os.close(self.fd)


class BatchRing:
    """Slots of batch memory plus a small status table the workers keep current."""

    def __init__(self, layout: RingLayout, slots: int, workers: int, memory: RingMemory | None = None):
        self.layout = layout
        self.slots = slots
        self.workers = workers
        self.memory = memory or RingMemory.create(self.size_for(layout, slots, workers))
        self._slot_views = [layout.views(self.memory.base, s) for s in range(slots)]
        start = slots * layout.slot_bytes
        words = workers * STATUS_WORDS * 8
        self.status = self.memory.base[start : start + words].view(np.int64).reshape(workers, STATUS_WORDS)
        self.status_keys = self.memory.base[start + words : start + words + workers * STATUS_KEY_BYTES].reshape(
            workers, STATUS_KEY_BYTES)

    @staticmethod
    def size_for(layout: RingLayout, slots: int, workers: int) -> int:
        return slots * layout.slot_bytes + _align(workers * (STATUS_WORDS * 8 + STATUS_KEY_BYTES), _PAGE)

    def key_in_hand(self, worker: int) -> str:
        raw = self.status_keys[worker].tobytes().split(b"\0", 1)[0]
        return raw.decode("utf-8", "replace")

    def slot(self, index: int) -> dict[str, np.ndarray]:
        return self._slot_views[index]

    def close(self) -> None:
        self._slot_views = []
        self.status = np.empty((0, STATUS_WORDS), np.int64)
        self.status_keys = np.empty((0, STATUS_KEY_BYTES), np.uint8)
        self.memory.close()


class RingHandle:
    """What a worker process needs to map the ring: plain data (JSON), the fd inherited by its number."""

    def __init__(self, fd: int, size: int, spec: Spec, batch_size: int, side_bytes: int, slots: int,
                 workers: int, labelled: bool = False):
        self.fd = fd
        self.size = size
        self.spec = spec
        self.batch_size = batch_size
        self.side_bytes = side_bytes
        self.slots = slots
        self.workers = workers
        self.labelled = labelled

    @classmethod
    def of(cls, ring: BatchRing) -> "RingHandle":
        layout = ring.layout
        return cls(ring.memory.fd, ring.memory.size, layout.spec, layout.batch_size, layout.side_bytes, ring.slots,
                   ring.workers, layout.labelled)

    def to_json(self) -> dict[str, Any]:
        return {"fd": self.fd, "size": self.size, "spec": self.spec.to_json(), "batch_size": self.batch_size,
                "side_bytes": self.side_bytes, "slots": self.slots, "workers": self.workers, "labelled": self.labelled}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RingHandle":
        return cls(d["fd"], d["size"], Spec.from_json(d["spec"]), d["batch_size"], d["side_bytes"], d["slots"],
                   d["workers"], bool(d.get("labelled", False)))

    def attach(self) -> BatchRing:
        layout = RingLayout(self.spec, self.batch_size, self.side_bytes, self.labelled)
        return BatchRing(layout, self.slots, self.workers, RingMemory(self.fd, self.size))


RING_MEMORY_SHARE = 0.8  # refuse a ring larger than this share of the memory left


def check_ring_memory(layout: RingLayout, slots: int, workers: int) -> None:
    """Refuse, naming ``ring_slots`` and what fits, a ring the memory left cannot hold (no SIGBUS later)."""
    need = BatchRing.size_for(layout, slots, workers)
    budget = memory_budget()
    if need > RING_MEMORY_SHARE * budget.available:
        fits = int(RING_MEMORY_SHARE * budget.available // layout.slot_bytes)
        raise SettingError(
            "ring_slots", f"the batch ring needs {fmt_bytes(need)} ({slots} slots x {fmt_bytes(layout.slot_bytes)} "
                          f"per batch of batch_size={layout.batch_size}), but {budget.source} leaves "
                          f"{fmt_bytes(budget.available)}: use ring_slots <= {max(fits, 0)} or a smaller "
                          f"batch_size, or raise the memory limit")
