"""The resources of a running loader, in one object its finalizer can close without the loader itself.

Closing order matters: the device queue first (wakes a blocked put), the
transfer threads (joined, so none releases a slot into a closed pool), the
pool (its dispatcher stops the workers), the batches the loop kept (moved
out of the ring), the launcher's memfd, the rank coordinator's process
group, the CUDA registration of the ring, the ring.
"""

from __future__ import annotations

import torch

from .device.device_decode import DeviceDecoder
from .device.transfer import DeviceQueue, DirectHandOff, TransferStage
from .plan.coordinate import RankCoordinator
from .ring.batch_ring import BatchRing
from .ring.kept import KeptBatches
from .stats import StatsRecorder
from .workers.launch import Launcher
from .workers.pool import WorkerPool


class Pipeline:
    """Everything a loader started: processes, threads, the ring, the pickled user code, a process group."""

    def __init__(self) -> None:
        self.ring: BatchRing | None = None
        self.pool: WorkerPool | None = None
        self.queue: DeviceQueue | DirectHandOff | None = None
        self.transfer: TransferStage | None = None
        self.kept: KeptBatches | None = None
        self.launcher: Launcher | None = None
        self.coordinator: RankCoordinator | None = None
        self.pinned_ptr: int | None = None
        self.decoder: DeviceDecoder | None = None  # device_decode=: the batch stage's image decoder

    def tick(self, stats: StatsRecorder, slots: int) -> None:
        """The dispatcher's, 4 times a second: slots of kept batches let go return, the gauges go to ``stats``."""
        if self.kept is not None:
            self.kept.give_back_idle()
        stats.report_gauges(*self.gauges(slots))

    def gauges(self, slots: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(queue depths, queue capacities, worker states) as they are now."""
        depth = {"free": 0, "decoded": 0, "device": 0}
        workers = {"busy": 0, "idle": 0}
        pool, queue = self.pool, self.queue
        if pool is not None and queue is not None:
            depth.update(pool.depths())
            depth["device"] = queue.depth()
            workers = pool.worker_states()
        capacity = {"free": slots, "decoded": slots, "device": queue.capacity if queue is not None else 0}
        return depth, capacity, workers

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
        if self.transfer is not None:
            self.transfer.close()  # before the pool: no thread still releases slots into it
        if self.pool is not None:
            self.pool.close()
        if self.kept is not None:
            self.kept.close()
        if self.launcher is not None:
            self.launcher.close()
        if self.coordinator is not None:
            self.coordinator.close()
        if self.pinned_ptr is not None:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.pinned_ptr)
            self.pinned_ptr = None
        if self.ring is not None:
            self.ring.close()
        self.ring = self.pool = self.queue = self.transfer = self.kept = self.launcher = self.coordinator = None
