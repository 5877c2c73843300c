"""Each ring slot's twin on the device: its tensor fields copied in one go, handed out as views.

A slot's tensor fields sit back to back at the start of the slot (``RingLayout``), so one copy of that
span moves a whole batch into a device buffer made for that slot at start-up; the batch's fields are
views of it (a slice each, no kernel). Every event is made once: ``copied[s]`` marks the slot's copy,
``consumed[s]`` (with transfer threads, which copy on streams of their own) the loop's last use of the
buffer before it is copied into again. Nothing is recorded per field, no ``record_stream``, no host
wait: the ring slot goes back to the workers once a query says its copy landed.

A buffer is copied into again only once nothing outside this object references it (a storage use
count, as ``ring/kept.py`` counts): a batch the training loop keeps keeps its buffer, and the slot gets
a new one — counted as a kept batch, never a batch overwritten under the loop's feet.

Host-to-device time is sampled, one batch in ``timing_every``: two events timed, read once landed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..cost import TrainerCost
from ..layout.side import SIDE_LEN
from ..ring.batch_ring import BatchRing
from .gpu import Gpu

TIMING_EVERY = 16  # one batch in this many has its copy timed (feedline_h2d_seconds)


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class DeviceSlots:
    """The device buffers, their views and their events, one set per ring slot (made at start-up)."""

    def __init__(self, gpu: Gpu, ring: BatchRing, cost: TrainerCost, on_kept: Callable[[], None],
                 consumed_events: bool, timing_every: int = TIMING_EVERY):
        self.gpu = gpu
        layout = ring.layout
        sides = [e.offset for e in layout.entries if e.name == SIDE_LEN]
        self.span = sides[0] if sides else layout.slot_bytes  # the tensor fields' bytes: one copy a batch
        self._fields = [(e.name, e.offset, torch.from_numpy(np.empty(0, np.dtype(e.dtype))).dtype, e.shape,
                         int(np.prod(e.shape, dtype=np.int64)) * np.dtype(e.dtype).itemsize)
                        for e in layout.entries if e.name in layout.tensor_names]
        ring_bytes = torch.from_numpy(ring.memory.base[: ring.slots * layout.slot_bytes])
        self._host = [ring_bytes[s * layout.slot_bytes : s * layout.slot_bytes + self.span] for s in range(ring.slots)]
        self._cost = cost
        self._on_kept = on_kept
        self._buffers: list[torch.Tensor] = []
        self._views: list[dict[str, torch.Tensor]] = []
        self._idle: list[int] = []  # a buffer's storage use count when nothing outside holds it
        for _ in range(ring.slots):
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
            self._views.append({})
            self._idle.append(0)
        for s in range(ring.slots):
            self._allot(s)
        self.copied = [gpu.event(timing=True) for _ in range(ring.slots)]
        self.consumed = [gpu.event() for _ in range(ring.slots)] if consumed_events else None
        self._recorded = [False] * ring.slots  # consumed[s] marks a use (a stream waiting on it waits for that)
        self.every = timing_every
        self._count = 0

    def _allot(self, slot: int) -> None:
        """A fresh device buffer for ``slot`` and its field views (start-up, or a kept batch kept the old one)."""
        buf = self.gpu.buffer(self.span)
        self._buffers[slot] = buf
        self._views[slot] = {name: buf[off : off + n].view(dtype).view(shape)
                             for name, off, dtype, shape, n in self._fields}
        self._idle[slot] = _use_count(buf)

    def host(self, slot: int) -> torch.Tensor:
        """The slot's tensor span in the (page-locked) ring."""
        return self._host[slot]

    def copy(self, slot: int, samples: int, stream: Any, start: Any = None, end: Any = None
             ) -> dict[str, torch.Tensor]:
        """Issue ``slot``'s copy on ``stream`` (after the loop's last use of its buffer) and record
        ``copied[slot]``; the batch's device tensors, fresh views (what the storage use count sees).
        ``start``: a timing event recorded before the copy; ``end``: one recorded after it (else
        ``copied[slot]`` ends the timed span)."""
        gpu = self.gpu
        if _use_count(self._buffers[slot]) > self._idle[slot]:  # the loop still holds its last batch
            self._allot(slot)
            self._on_kept()
        elif self.consumed is not None and self._recorded[slot]:
            gpu.wait(stream, self.consumed[slot])
        if start is not None:
            gpu.record(start, stream)
        gpu.copy(self._buffers[slot], self._host[slot], stream)
        gpu.record(self.copied[slot], stream)
        if end is not None:
            gpu.record(end, stream)
        return {k: v[:samples] for k, v in self._views[slot].items()}

    def time_this(self) -> bool:
        """One batch in ``timing_every``: the caller times its copy."""
        self._count += 1
        return self._count % self.every == 1 or self.every == 1

    def mark_consumed(self, slot: int, stream: Any) -> None:
        """The loop has launched all its work on ``slot``'s batch (its next ``next()``): a later copy into the
        buffer waits for that work on the device."""
        assert self.consumed is not None
        self.gpu.record(self.consumed[slot], stream)
        self._recorded[slot] = True

    def close(self) -> None:
        self._buffers, self._views, self._host = [], [], []
