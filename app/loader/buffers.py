"""Copy mode's output buffers, recycled once nothing references the batch they held.

``zero_copy=False`` on a CPU host gives the training loop batches it may keep: copies of the ring
slot. A fresh tensor per batch costs far more than the copy: a large allocation comes from mmap,
and every page is faulted in and zeroed by the kernel again (8192 faults for a 32 MiB batch),
which made the copy path cost most of a core at 1 GB/s. Here each batch is copied into a
buffer allocated once and reused: a batch's tensors are views of its buffer, so the buffer's
storage is referenced by every tensor made from them (views, autograd's saved tensors, a
``.numpy()`` array). A buffer is taken again only when its storage's use count is back to the
pool's own reference: nothing the user, autograd or torch holds can see it change.
"""

from __future__ import annotations

import threading

import torch

# The pool's base tensor + the temporary storage object of the check itself.
_IDLE = 2


def _idle(base: torch.Tensor) -> bool:
    return torch._C._storage_Use_Count(base.untyped_storage()._cdata) <= _IDLE


class BufferPool:
    """Full-batch buffers per field, handed out as views of their first ``samples`` rows."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], keep: int):
        self._shapes = shapes  # field -> (full batch shape, dtype)
        self._keep = keep  # buffers kept for reuse; past that, batches the user holds get fresh memory
        self._sets: list[dict[str, torch.Tensor]] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffer sets ever allocated (for tests and stats)

    def copy(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``views`` (each ``(samples, ...)``), in a recycled buffer where one is free."""
        claimed = self._take()
        out = {}
        for name, v in views.items():
            dst = claimed[name][: v.shape[0]]
            dst.copy_(v)
            out[name] = dst
        return out

    def _take(self) -> dict[str, torch.Tensor]:
        """A free set, as views made under the lock: they hold it, so no other thread takes it too."""
        with self._lock:
            for bases in self._sets:
                if all(_idle(b) for b in bases.values()):
                    return {k: b[:] for k, b in bases.items()}
            bases = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in self._shapes.items()}
            self.allocated += 1
            if len(self._sets) < self._keep:
                self._sets.append(bases)
                return {k: b[:] for k, b in bases.items()}
            return bases  # not kept: plain fresh memory, as a clone would be
