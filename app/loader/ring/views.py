"""Zero-copy batch tensors that fail loudly once their ring slot is given back.

With ``zero_copy=True`` a batch's tensors are views of a shared-memory ring slot, valid until the
next ``next()``, which hands the slot back to the workers. A reference the training loop keeps
past that point would silently read whichever batch the slot holds next. ``SlotView`` is an
ordinary tensor (same storage, no copy) until ``release()``; from then on every torch operation
on it raises ``ReleasedBatchError`` naming the fix. The check costs one Python call per operation
on the batch's own tensors; what an operation returns is a plain tensor, unaffected. A batch's views share
one ``Lease``, so ``next()`` releases them all with one write to a plain object.

torch cannot make the memory itself inaccessible (a tensor whose storage is shrunk to nothing
segfaults on use), so a view taken from the batch *before* the next ``next()`` (``b["jpg"][0]``)
still aliases the slot: ``clone()`` what is kept.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import LoaderError


class ReleasedBatchError(LoaderError):
    """A zero-copy tensor was used after its slot went back to the ring."""


class Lease:
    """The views of one batch: released together."""

    __slots__ = ("released",)

    def __init__(self) -> None:
        self.released = False


def _check(values: Any) -> None:
    for v in values:
        if type(v) is SlotView and v._lease.released:
            raise ReleasedBatchError(
                "this zero-copy batch tensor was released when the next batch was taken (its ring slot now holds "
                "another batch): clone() what you keep past the next next(), or use zero_copy=False")
        if isinstance(v, (list, tuple)):
            _check(v)


class SlotView(torch.Tensor):
    """A view of a ring slot; ``release()`` makes any further use raise."""

    _lease = Lease()  # of() gives each view its batch's

    @classmethod
    def of(cls, t: torch.Tensor, lease: Lease | None = None) -> "SlotView":
        v = t.as_subclass(cls)  # the same storage: no copy
        v._lease = lease if lease is not None else Lease()
        return v

    def release(self) -> None:
        self._lease.released = True

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        _check(args)
        if kwargs:
            _check(kwargs.values())
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def views_of(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, SlotView], Lease]:
    """A batch's views of its slot's tensors, and the lease that releases them all."""
    lease = Lease()
    return {k: SlotView.of(v, lease) for k, v in tensors.items()}, lease
