"""The few device operations the loader's CUDA path uses, behind one small interface, each one counted.

``CudaGpu`` is the real thing (torch.cuda); ``StandInGpu`` (``standin.py``) runs the same code on a CPU
host — ``device="standin"`` — so the slot copies, the events and the budget's counters are tested here,
not only on a GPU. Every call that reaches the driver adds to the loader's ``TrainerCost`` (the tests
and the bench read how many a batch makes, and on which thread); streams, events and buffers made
after start-up are counted as per-batch objects, and a host thread blocking on the device as a sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ...preflight import fmt_bytes
from ..cost import TrainerCost
from ..errors import LoaderError


class Gpu(Protocol):
    """A device the ring's slots are copied to; the names follow CUDA's (streams run in order, events mark)."""

    device: torch.device

    def stream(self) -> Any:
        """A new stream (made once per transfer thread)."""

    def current_stream(self) -> Any:
        """The stream the calling thread launches on now (the training loop's)."""

    def event(self, timing: bool = False) -> Any:
        """A new event, reused for every batch (``timing``: one whose times can be compared)."""

    def buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory (uint8), allocated on the current stream."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Copy host ``src`` (page-locked) into device ``dst`` on ``stream``, asynchronously."""

    def to_device(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        """A new device tensor holding host ``src``, copied on ``stream`` (``h2d="fields"``: a copy a field)."""

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """Tell the allocator ``t`` is used on ``stream`` too (``h2d="fields"``)."""

    def record(self, event: Any, stream: Any) -> None:
        """Mark ``stream``'s position: the event completes once all work launched on it so far has."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work launched on ``stream`` from now on waits, on the device, for ``event``."""

    def query(self, event: Any) -> bool:
        """Has ``event`` completed? (never blocks)"""

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds between two completed timing events."""

    def synchronize(self, event: Any) -> None:
        """Block this host thread until ``event`` completes (sleeping, not spinning)."""

    def on(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        """Launch torch operations on ``stream`` inside the block (the batch decoder's)."""

    def pin(self, memory: Any) -> None:
        """Page-lock the ring's memory once, so copies from it are asynchronous."""

    def unpin(self) -> None:
        """Undo ``pin`` once every copy has landed (at close)."""


def cuda_index(device: torch.device, current: Callable[[], int] = torch.cuda.current_device) -> int | None:
    """The CUDA device ``device`` names, plain ``cuda`` being the current one (what its tensors go to); None
    for a device that is not CUDA. Its NUMA node is where CPU placement keeps the training process."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else current()


class CudaGpu:
    """``Gpu`` on a CUDA device through torch.cuda."""

    def __init__(self, device: torch.device, cost: TrainerCost):
        device = torch.device("cuda", cuda_index(device))
        self.device = device
        self._cost = cost
        self._pinned: int | None = None

    def stream(self) -> Any:
        self._cost.device_object()
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def event(self, timing: bool = False) -> Any:
        self._cost.device_object()
        # blocking: a host thread that waits on it sleeps in the driver instead of spinning a core
        return torch.cuda.Event(enable_timing=timing, blocking=True)

    def buffer(self, nbytes: int) -> torch.Tensor:
        self._cost.device_object()
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        self._cost.device_call()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def to_device(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        self._cost.device_call()
        self._cost.device_object()
        with torch.cuda.stream(stream):
            return src.to(self.device, non_blocking=True)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        self._cost.device_call()
        t.record_stream(stream)

    def record(self, event: Any, stream: Any) -> None:
        self._cost.device_call()
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        self._cost.device_call()
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        self._cost.device_call()
        return bool(event.query())

    def elapsed(self, start: Any, end: Any) -> float:
        self._cost.device_call()
        return start.elapsed_time(end) / 1000.0

    def synchronize(self, event: Any) -> None:
        self._cost.device_call()
        self._cost.host_sync()
        event.synchronize()

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def pin(self, memory: Any) -> None:
        ptr = memory.base.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, memory.size, 0)
        if int(getattr(err, "value", err)) != 0:
            raise LoaderError(f"cudaHostRegister of the {fmt_bytes(memory.size)} ring failed: {err}")
        self._pinned = ptr

    def unpin(self) -> None:
        if self._pinned is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self._pinned)
            self._pinned = None
