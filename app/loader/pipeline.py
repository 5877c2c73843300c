"""The resources of a running loader, in one object its finalizer can close without the loader itself.

Closing order matters: the hand-off first (wakes a blocked put), the
transfer threads (joined, so none releases a slot into a closed pool), the
pool (its dispatcher stops the workers), the batches the loop kept (moved
out of the ring), the launcher's memfd, the shared shard indexes' memfd, the rank coordinator's process
group, the device buffers, the CUDA registration of the ring, the ring, and
last the training process's CPU pins (its threads' masks given back).
"""

from __future__ import annotations

from .cost import TrainerCost
from .cpus.pinning import ProcessPins
from .cpus.placement import Placement
from .device.device_decode import DeviceDecoder
from .device.gpu import Gpu
from .device.handoff import DirectHandOff
from .device.slots import DeviceSlots
from .device.transfer import TransferStage
from .iterator import HandOff
from .plan.coordinate import RankCoordinator
from .ring.batch_ring import BatchRing
from .ring.kept import KeptBatches
from .stats import StatsRecorder
from .workers.index_share import IndexShare
from .workers.launch import Launcher
from .workers.pool import WorkerPool


class Pipeline:
    """Everything a loader started: processes, threads, the ring, the pickled user code, a process group."""

    def __init__(self) -> None:
        self.ring: BatchRing | None = None
        self.pool: WorkerPool | None = None
        self.queue: HandOff | None = None
        self.transfer: TransferStage | None = None
        self.kept: KeptBatches | None = None
        self.launcher: Launcher | None = None
        self.indexes: IndexShare | None = None  # the shard indexes this process and its workers build for each other
        self.coordinator: RankCoordinator | None = None
        self.gpu: Gpu | None = None  # a device: the ring is pinned to it until close
        self.slots: DeviceSlots | None = None  # h2d="slot": the device buffers, one a ring slot
        self.decoder: DeviceDecoder | None = None  # device_decode=: the batch stage's image decoder
        self.pinned = False  # this loader holds the training process's CPU pins (cpus/pinning.py)

    def pin(self, placement: Placement) -> None:
        """The training process's threads on the plan's CPUs until ``close`` (nothing when it is not placed)."""
        self.pinned = ProcessPins.hold(placement)

    def tick(self, stats: StatsRecorder, slots: int, cost: TrainerCost) -> None:
        """The dispatcher's tick (4 a second, once where nobody listens): slots of kept batches let go return
        (zero-copy: the next batches' views are made), the gauges and feedline's CPU in this process go to
        ``stats``."""
        if self.kept is not None:
            self.kept.give_back_idle()
        elif isinstance(self.queue, DirectHandOff):  # zero-copy on a CPU host: next()'s views made ahead
            self.queue.restock()
        if stats.listens:  # (nobody listens: StagingLoader.stats() and cost() compute theirs when asked)
            stats.report_gauges(*self.gauges(slots))
            stats.report_cost(cost.snapshot())

    def gauges(self, slots: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(queue depths, queue capacities, worker states) as they are now."""
        depth = {"free": 0, "decoded": 0, "device": 0}
        workers = {"busy": 0, "idle": 0}
        pool, queue = self.pool, self.queue
        if pool is not None and queue is not None:
            depth.update(pool.depths())
            if queue.capacity:
                depth["device"] = queue.depth()
            else:  # a CPU host's hand-off: what it holds are decoded batches read ahead (DirectHandOff)
                depth["decoded"] += queue.depth()
            workers = pool.worker_states()
        capacity = {"free": slots, "decoded": slots, "device": queue.capacity if queue is not None else 0}
        return depth, capacity, workers

    def close(self) -> None:
        try:
            self._close()
        finally:  # whatever failed: the user's process gets its CPUs back
            if self.pinned:
                self.pinned = False
                ProcessPins.release()

    def _close(self) -> None:
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
        if self.indexes is not None:
            self.indexes.close()
        if self.coordinator is not None:
            self.coordinator.close()
        if self.slots is not None:
            self.slots.close()
        if self.gpu is not None:
            self.gpu.unpin()  # once every copy from the ring has landed
        if self.ring is not None:
            self.ring.close()
        self.ring = self.pool = self.queue = self.transfer = self.kept = self.launcher = self.coordinator = None
        self.indexes = None
        self.gpu = self.slots = None
