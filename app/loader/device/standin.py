"""A stand-in device: the CUDA path's code run on a CPU host (``device="standin"``), for tests and the bench.

Its "device memory" is host memory; a copy happens when it is issued (its CPU time counted apart from
feedline's: on a GPU a copy engine does it), but the events recorded after it
complete only ``lag`` seconds later, so code that gives a ring slot back before its copy "landed", or
waits on an event never recorded, shows up here as it would on a GPU. Streams keep their order: an
event completes no earlier than one recorded before it on the same stream. Every call is counted on
the loader's ``TrainerCost`` exactly as ``CudaGpu`` counts it, so the budget's figures (calls on the
loop's thread, objects made a batch, host syncs) are measured on any machine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..cost import TrainerCost


class StandInStream:
    """A stream: the time its last recorded work completes."""

    __slots__ = ("name", "busy_until")

    def __init__(self, name: str):
        self.name = name
        self.busy_until = 0.0


class StandInEvent:
    """An event: when it completes (None: never recorded), and what it marked."""

    __slots__ = ("done_at", "timing", "marked")

    def __init__(self, timing: bool):
        self.done_at: float | None = None
        self.timing = timing
        self.marked = 0.0

    def done(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at


class StandInGpu:
    """``Gpu`` on the CPU (see the module's docstring); ``lag``: seconds a copy takes to "land"."""

    def __init__(self, cost: TrainerCost, lag: float = 0.0):
        self.device = torch.device("cpu")
        self.lag = lag
        self._cost = cost
        self._default = StandInStream("default")
        self.copies = 0  # issued so far (tests read it)

    def stream(self) -> StandInStream:
        self._cost.device_object()
        return StandInStream("transfer")

    def current_stream(self) -> StandInStream:
        return self._default

    def event(self, timing: bool = False) -> StandInEvent:
        self._cost.device_object()
        return StandInEvent(timing)

    def buffer(self, nbytes: int) -> torch.Tensor:
        self._cost.device_object()
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: StandInStream) -> None:
        self._cost.device_call()
        t0 = time.thread_time_ns()
        np.copyto(dst.numpy(), src.numpy())  # one thread, as a DMA engine: torch's copy_ would wake its OpenMP pool
        self._cost.standin_copy(time.thread_time_ns() - t0)
        self.copies += 1
        stream.busy_until = max(stream.busy_until, time.monotonic()) + self.lag

    def to_device(self, src: torch.Tensor, stream: StandInStream) -> torch.Tensor:
        self._cost.device_call()
        self._cost.device_object()
        self.copies += 1
        stream.busy_until = max(stream.busy_until, time.monotonic()) + self.lag
        t0 = time.thread_time_ns()
        out = torch.from_numpy(src.numpy().copy())
        self._cost.standin_copy(time.thread_time_ns() - t0)
        return out

    def record_stream(self, t: torch.Tensor, stream: StandInStream) -> None:
        self._cost.device_call()

    def record(self, event: StandInEvent, stream: StandInStream) -> None:
        self._cost.device_call()
        event.marked = time.monotonic()
        event.done_at = max(stream.busy_until, event.marked)

    def wait(self, stream: StandInStream, event: StandInEvent) -> None:
        self._cost.device_call()
        if event.done_at is not None:  # the stream's later work runs after the event
            stream.busy_until = max(stream.busy_until, event.done_at)

    def query(self, event: StandInEvent) -> bool:
        self._cost.device_call()
        return event.done()

    def elapsed(self, start: StandInEvent, end: StandInEvent) -> float:
        self._cost.device_call()
        assert start.done_at is not None and end.done_at is not None, "elapsed() of an event never recorded"
        return max(0.0, end.done_at - max(start.done_at, start.marked))

    def synchronize(self, event: StandInEvent) -> None:
        self._cost.device_call()
        self._cost.host_sync()
        if event.done_at is not None:
            time.sleep(max(0.0, event.done_at - time.monotonic()))

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        yield

    def pin(self, memory: Any) -> None:
        pass

    def unpin(self) -> None:
        pass
