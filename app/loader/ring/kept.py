"""Copy mode without the copy: batches the training loop may keep, served from ring slots until it lets go.

``zero_copy=False`` (the default on a CPU host) promises tensors the loop owns: it may keep them in a
list, hand them to another thread, write into them. Copying each batch out of the ring kept that
promise at the price of the copy: most of a core at 4 GB/s, and memory bandwidth the workers need.
Here a batch's tensors view its ring slot through a mapping of that slot alone (a ``Frame``), and
the slot goes back to the workers only once no tensor references it: storage use counts, which see
views, autograd's saved tensors and ``.numpy()`` arrays too, checked at each ``next()``.

A loop that still holds more than ``spare`` batches at a ``next()`` (it keeps them) has the oldest
moved out of the ring: the frame's pages are replaced, at the same address, by a private copy
(``mremap``), so every tensor and view of that batch keeps its values, and the slot returns at once.
Only kept batches are ever copied; at ``close()`` the batches still held are moved out too, so the
ring's memory goes with the loader and kept batches stay valid.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .batch_ring import BatchRing

log = logging.getLogger("feedline.loader")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_RW = mmap.PROT_READ | mmap.PROT_WRITE
# The alias kept here + the temporary storage object of the check itself: nothing else sees the slot.
_IDLE = 2


def _idle(alias: torch.Tensor) -> bool:
    return torch._C._storage_Use_Count(alias.untyped_storage()._cdata) <= _IDLE


class Frame:
    """One slot's memory, mapped on its own so its pages can be swapped for a private copy in place."""

    def __init__(self, ring: BatchRing, slot: int):
        self.size = ring.layout.slot_bytes
        self._mm = mmap.mmap(ring.memory.fd, self.size, mmap.MAP_SHARED, _RW, offset=slot * self.size)
        base = np.frombuffer(self._mm, np.uint8)
        self.address = base.ctypes.data
        self.views = ring.layout.views(base, 0)

    def make_private(self, spans: list[tuple[int, int]]) -> None:
        """The bytes at ``spans`` ((offset, length)) stay where they are, in private memory from now on."""
        tmp = _libc.mmap(None, self.size, _RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if tmp is None or tmp == _MAP_FAILED:
            raise MemoryError(f"cannot allocate {self.size} bytes to move a kept batch out of the ring")
        try:
            dst = np.frombuffer((ctypes.c_uint8 * self.size).from_address(tmp), np.uint8)
            src = np.frombuffer(self._mm, np.uint8)
            for offset, length in spans:
                np.copyto(dst[offset : offset + length], src[offset : offset + length])
            del dst, src
            moved = _libc.mremap(tmp, self.size, self.size, _MREMAP_MAYMOVE | _MREMAP_FIXED, self.address)
            if moved != self.address:
                err = ctypes.get_errno()
                raise OSError(err, f"mremap of a kept batch failed: {os.strerror(err)}")
        except BaseException:
            _libc.munmap(tmp, self.size)
            raise


@dataclass
class _Held:
    slot: int
    samples: int
    aliases: list[torch.Tensor]  # one per field, sharing the storage of the tensors handed out


class KeptBatches:
    """The ring slots whose batch the loop may still hold; each goes back once nothing references it."""

    def __init__(self, ring: BatchRing, release: Callable[[int], None], spare: int,
                 on_copy: Callable[[], None] = lambda: None):
        self._ring = ring
        self._release = release
        self._on_copy = on_copy
        self.spare = spare  # batches the loop may hold at a next() before the oldest is moved out
        self._frames: list[Frame | None] = [None] * ring.slots
        self._held: deque[_Held] = deque()
        self._lock = threading.Lock()  # _held: the loop's thread holds and collects, the dispatcher gives back
        layout = ring.layout
        self._rows = [(e.offset, int(np.prod(e.shape[1:], dtype=np.int64)) * np.dtype(e.dtype).itemsize)
                      for e in layout.entries if e.name in layout.tensor_names]
        self.moved_out = 0  # batches copied out of the ring because the loop kept them

    def views(self, slot: int) -> dict[str, np.ndarray]:
        """The numpy views of ``slot``'s frame (mapped on first use, and again after a move-out)."""
        frame = self._frames[slot]
        if frame is None:
            frame = self._frames[slot] = Frame(self._ring, slot)
        return frame.views

    def hold(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """The loop received these tensors of ``slot``: the slot stays out until they are let go."""
        aliases = [t.detach() for t in tensors.values()]
        with self._lock:
            self._held.append(_Held(slot, int(aliases[0].shape[0]) if aliases else 0, aliases))

    def collect(self) -> None:
        """At each ``next()``: give back the slots nothing references; move out the oldest held batches past
        ``spare`` (here, in the loop's thread, where no step of its own can be writing into them)."""
        self.give_back_idle()
        while True:
            with self._lock:
                if len(self._held) <= self.spare:
                    return
                h = self._held.popleft()
            self._move_out(h)
            self._release(h.slot)

    def give_back_idle(self) -> None:
        """Give back the slots nothing references (also from the dispatcher's tick: a slot let go during a long
        step returns before the next ``next()``)."""
        with self._lock:
            idle = [h for h in self._held if all(_idle(a) for a in h.aliases)]
            for h in idle:
                self._held.remove(h)
        for h in idle:
            self._release(h.slot)

    def _move_out(self, h: _Held) -> None:
        frame = self._frames[h.slot]
        assert frame is not None
        frame.make_private([(offset, h.samples * row) for offset, row in self._rows])
        self._frames[h.slot] = None  # the batch's tensors keep that frame; the slot gets a new one
        self.moved_out += 1
        self._on_copy()
        if self.moved_out == 1:
            log.info("the training loop keeps batches past next(): past the %d it may hold, each kept batch is "
                     "copied out of the ring once, so the workers get its slot back", self.spare)

    def close(self) -> None:
        """Move out the batches the loop still holds (they stay valid); drop every frame (the ring can go)."""
        with self._lock:
            held, self._held = self._held, deque()
        for h in held:
            if not all(_idle(a) for a in h.aliases):
                try:
                    self._move_out(h)
                except (MemoryError, OSError) as exc:  # it keeps the ring's memory instead; still valid
                    log.warning("a kept batch could not be moved out of the ring at close: %s", exc)
        self._frames = [None] * len(self._frames)
