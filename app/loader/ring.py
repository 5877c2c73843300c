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

import numpy as np

from .spec import Field, Spec

_FIELD_ALIGN = 64
_PAGE = mmap.PAGESIZE
STATUS_WORDS = 2  # per worker: [epoch, stream position being decoded or -1]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class FieldSlot:
    name: str
    dtype: str
    shape: tuple[int, ...]  # with the batch dimension first
    offset: int


class RingLayout:
    """Where each field's ``(batch, *shape)`` array sits inside one slot."""

    def __init__(self, spec: Spec, batch_size: int):
        self.spec = spec
        self.batch_size = batch_size
        entries: list[FieldSlot] = []
        offset = 0
        for f in spec.fields:
            entries.append(FieldSlot(f.name, f.dtype, (batch_size,) + f.shape, offset))
            offset = _align(offset + f.nbytes * batch_size, _FIELD_ALIGN)
            if f.variable:
                entries.append(FieldSlot(f.length_name, "<i4", (batch_size,), offset))
                offset = _align(offset + 4 * batch_size, _FIELD_ALIGN)
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
        return self.spec.fields


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
        self.status_offset = slots * layout.slot_bytes
        size = self.status_offset + _align(workers * STATUS_WORDS * 8, _PAGE)
        self.memory = memory or RingMemory.create(size)
        self._slot_views = [layout.views(self.memory.base, s) for s in range(slots)]
        self.status = self.memory.base[self.status_offset : self.status_offset + workers * STATUS_WORDS * 8].view(
            np.int64
        ).reshape(workers, STATUS_WORDS)

    @staticmethod
    def size_for(layout: RingLayout, slots: int, workers: int) -> int:
        return slots * layout.slot_bytes + _align(workers * STATUS_WORDS * 8, _PAGE)

    def slot(self, index: int) -> dict[str, np.ndarray]:
        return self._slot_views[index]

    def close(self) -> None:
        self._slot_views = []
        self.status = np.empty((0, STATUS_WORDS), np.int64)
        self.memory.close()


class RingHandle:
    """What a worker process needs to map the ring: the fd travels via DupFd, never a name."""

    def __init__(self, fd: int, size: int, spec: Spec, batch_size: int, slots: int, workers: int):
        self.fd = fd
        self.size = size
        self.spec = spec
        self.batch_size = batch_size
        self.slots = slots
        self.workers = workers

    @classmethod
    def of(cls, ring: BatchRing) -> "RingHandle":
        return cls(ring.memory.fd, ring.memory.size, ring.layout.spec, ring.layout.batch_size, ring.slots, ring.workers)

    def __reduce__(self):  # type: ignore[override]
        from multiprocessing import reduction

        return (
            _rebuild_handle,
            (reduction.DupFd(self.fd), self.size, self.spec.to_json(), self.batch_size, self.slots, self.workers),
        )

    def attach(self) -> BatchRing:
        layout = RingLayout(self.spec, self.batch_size)
        return BatchRing(layout, self.slots, self.workers, RingMemory(self.fd, self.size))


def _rebuild_handle(dupfd, size, spec_json, batch_size, slots, workers) -> RingHandle:  # type: ignore[no-untyped-def]
    return RingHandle(dupfd.detach(), size, Spec.from_json(spec_json), batch_size, slots, workers)
