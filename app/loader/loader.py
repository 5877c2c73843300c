"""``StagingLoader``: tar shards -> worker processes -> shared-memory ring -> transfer threads -> the loop.

The object owns every resource of the pipeline (processes, the ring, threads,
pipes) and frees them in ``close()``; it is also a context manager, and a
finalizer closes a loader that was forgotten.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..cache.manifest import CacheSource
from ..formats.decoders import Decoder
from ..formats.shard_index import ShardError, load_index
from ..preflight import fmt_bytes, memory_budget
from .plan import Rank, worker_shards
from .pool import ErrorBudget, LoaderError, WorkerPool
from .ring import BatchRing, RingHandle, RingLayout
from .sources import PathSource, ShardSource
from .spec import SampleRejected, Spec, fill
from .stats import LoaderStats, StatsRecorder
from .transfer import DeviceQueue, DirectHandOff, TransferStage
from .worker import WorkerArgs, load_sample

log = logging.getLogger("feedline.loader")

RING_MEMORY_SHARE = 0.8  # refuse a ring larger than this share of the memory left


def _positive(name: str, value: int, minimum: int = 1) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def default_ring_slots(workers: int, transfer_threads: int, device_queue: int = 2) -> int:
    """Two slots a worker, one a transfer thread, and the batches ready ahead of the loop."""
    return 2 * workers + transfer_threads + device_queue


class _Pipeline:
    """The resources of a running loader, closable without a reference to the loader."""

    def __init__(self) -> None:
        self.ring: BatchRing | None = None
        self.pool: WorkerPool | None = None
        self.queue: DeviceQueue | DirectHandOff | None = None
        self.transfer: TransferStage | None = None
        self.pinned_ptr: int | None = None
        self.metrics: Any = None

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.queue is not None:
            self.queue.close()
        if self.transfer is not None:
            self.transfer._stop.set()
        if self.pool is not None:
            self.pool.close()
        if self.transfer is not None:
            self.transfer.close()
        if self.pinned_ptr is not None:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.pinned_ptr)
            self.pinned_ptr = None
        if self.ring is not None:
            self.ring.close()
        self.ring = self.pool = self.queue = self.transfer = None


class StagingLoader:
    """Iterate over batches (dicts of tensors); each ``for`` loop is one epoch.

    Fields are keyed by their tar extension (``batch["jpg"]``, ``batch["cls"]``)
    unless the spec renames them; images are HWC uint8 unless a transform says
    otherwise. With ``drop_last=False`` each worker's last batch of an epoch may
    be partial.
    """

    def __init__(
        self,
        shards: str | os.PathLike | Sequence[str | os.PathLike] | ShardSource | None = None,
        *,
        cache: str | os.PathLike | None = None,
        batch_size: int = 32,
        workers: int = 2,
        transfer_threads: int = 1,
        ring_slots: int | None = None,
        spec: Spec | Mapping[str, Any] | None = None,
        decode: bool | Mapping[str, Callable[[memoryview], Any]] = True,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        drop_last: bool = False,
        device: str | torch.device = "cpu",
        zero_copy: bool = False,
        in_order: bool = True,
        max_sample_errors: float = 0.05,
        device_queue: int = 2,
        start_method: str = "spawn",
        rank: Rank | None = None,
        starvation_window: float = 30.0,
        min_shards: int = 1,
        wait_timeout: float = 60.0,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
    ):
        self.batch_size = _positive("batch_size", batch_size)
        self.workers = _positive("workers", workers)
        self.transfer_threads = _positive("transfer_threads", transfer_threads)
        self.shuffle_buffer = _positive("shuffle_buffer", shuffle_buffer, 0)
        device_queue = _positive("device_queue", device_queue)
        self.ring_slots = _positive("ring_slots", ring_slots if ring_slots is not None
                                    else default_ring_slots(self.workers, self.transfer_threads, device_queue), 2)
        if self.ring_slots < self.workers:
            raise ValueError(f"ring_slots={self.ring_slots} is fewer than workers={self.workers}: "
                             f"give every worker a slot (ring_slots >= {2 * self.workers} is a good start)")
        if not isinstance(max_sample_errors, (int, float)) or max_sample_errors < 0:
            raise ValueError(f"max_sample_errors must be a count (>= 1) or a fraction in [0, 1), got {max_sample_errors!r}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver' (never fork after CUDA), got {start_method!r}")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {str(device)!r}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available here; use device='cpu'")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {str(device)!r}")
        if (shards is None) == (cache is None):
            raise ValueError("give exactly one of shards= (paths or globs) or cache= (a cache directory)")
        self.source: ShardSource = (
            CacheSource(os.fspath(cache)) if cache is not None
            else shards if hasattr(shards, "snapshot") else PathSource(shards)  # type: ignore[arg-type]
        )
        self.rank = rank or Rank.detect()
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.zero_copy = zero_copy
        self.transform = transform
        self._decoder = Decoder(decode)
        self._epoch = -1
        self._closed = False
        self.epoch_shards: list[str] = []  # the snapshot the current epoch reads

        _positive("min_shards", min_shards)
        if isinstance(self.source, CacheSource):
            first = self.source.wait_for(min_shards, wait_timeout)
        else:
            first = self.source.snapshot()
        if cache is None:
            if not first:
                raise ValueError(f"shards: nothing matches {self.source.describe()}")
            per_rank = len(first) // self.rank.world_size
            if self.workers > per_rank:
                raise ValueError(
                    f"workers={self.workers} but rank {self.rank.rank} of {self.rank.world_size} gets only "
                    f"{per_rank} of the {len(first)} shards: use workers <= {max(1, per_rank)}, "
                    f"or split the data into more shards"
                )
        self.spec = self._check_spec(spec, first)
        layout = RingLayout(self.spec, self.batch_size)
        self._check_memory(layout)

        self._stats = StatsRecorder(starvation_window)
        p = self._pipeline = _Pipeline()
        self._finalizer = weakref.finalize(self, p.close)
        try:
            if metrics_port is not None:
                p.metrics = self._serve_metrics(metrics_addr, metrics_port)
            p.ring = BatchRing(layout, self.ring_slots, self.workers)
            if self.device.type == "cuda":
                p.pinned_ptr = self._pin(p.ring)
            handle = RingHandle.of(p.ring)
            level = logging.getLogger("feedline").getEffectiveLevel()

            def make_args(index: int, conn: Any) -> WorkerArgs:
                return WorkerArgs(index, conn, handle, self._decoder, transform, self.shuffle_buffer if shuffle else 0,
                                  drop_last, level)

            p.pool = WorkerPool(p.ring, make_args, self.workers, self._stats, ErrorBudget(float(max_sample_errors)),
                                start_method, in_order)
            if zero_copy and self.device.type == "cpu":
                p.queue = DirectHandOff(p.pool, p.ring, self._stats)
            else:
                p.queue = DeviceQueue(device_queue, in_order, p.pool.release)
                p.transfer = TransferStage(p.pool, p.ring, p.queue, self._stats, self.transfer_threads,
                                           self.device)
        except BaseException:
            self.close()
            raise

    # -- construction checks ----------------------------------------------------------------

    def _first_sample(self, shards: list[str], wanted: set[str] | None) -> dict[str, Any] | None:
        """Decode and transform the first readable sample, in this process, to learn or check the layout."""
        for path in sorted(shards)[:8]:
            try:
                index = load_index(path)
            except ShardError as exc:
                log.warning("%s", exc)
                continue
            with open(path, "rb") as f:
                data = memoryview(f.read(max(off + size for s in index.samples[:4] for off, size in s.fields.values())))
            for ref in index.samples[:4]:
                try:
                    sample, _ = load_sample(data, path, ref, self._decoder, wanted, self.transform, set())
                    return sample
                except Exception as exc:
                    log.warning("%s sample %r cannot be read (%s); trying the next", path, ref.key, exc)
        return None

    def _check_spec(self, spec: Spec | Mapping[str, Any] | None, shards: list[str]) -> Spec:
        if spec is not None:
            parsed = Spec.parse(spec)
            if not shards:
                return parsed
            sample = self._first_sample(shards, parsed.sources if self.transform is None else None)
            if sample is None:
                return parsed
            for f in parsed.fields:
                if f.source not in sample:
                    have = sorted(k for k in sample if not k.startswith("__"))
                    raise ValueError(f"spec field {f.name!r} reads {f.source!r}, which the data does not have "
                                     f"(a sample has {have}); fix the spec's source or the transform")
                scratch = np.zeros((1,) + f.shape, f.np_dtype)
                lengths = np.zeros(1, np.int32)
                try:
                    fill(f, scratch, sample[f.source], lengths, 0)
                except SampleRejected as exc:
                    raise ValueError(f"spec does not match the data: {exc}") from None
            return parsed
        if not shards:
            raise ValueError("spec: the cache holds no shard yet to infer the batch layout from; pass spec=")
        sample = self._first_sample(shards, None)
        if sample is None:
            raise ValueError(f"spec: no readable sample in the first shards of {self.source.describe()} "
                             f"to infer the batch layout from; pass spec= or check the shards")
        inferred = Spec.infer(sample)
        log.info("inferred batch spec: %s", ", ".join(f"{f.name} {np.dtype(f.dtype).name}{list(f.shape)}"
                                                     f"{' variable' if f.variable else ''}" for f in inferred.fields))
        return inferred

    def _check_memory(self, layout: RingLayout) -> None:
        need = BatchRing.size_for(layout, self.ring_slots, self.workers)
        budget = memory_budget()
        if need > RING_MEMORY_SHARE * budget.available:
            fits = int(RING_MEMORY_SHARE * budget.available // layout.slot_bytes)
            raise ValueError(
                f"the batch ring needs {fmt_bytes(need)} ({self.ring_slots} ring_slots x {fmt_bytes(layout.slot_bytes)} "
                f"per batch of batch_size={self.batch_size}), but {budget.source} leaves {fmt_bytes(budget.available)}: "
                f"use ring_slots <= {max(fits, 0)} or a smaller batch_size, or raise the memory limit"
            )

    def _serve_metrics(self, addr: str, port: int) -> Any:
        """/metrics of this loader, read at scrape time; a port in use is refused here, at start-up."""
        from prometheus_client import CollectorRegistry

        from ..metrics.exporter import MetricsServer
        from ..metrics.loader_metrics import BuildInfo, LoaderCollector, torchrun_rank

        registry = CollectorRegistry()
        registry.register(LoaderCollector(self.stats, torchrun_rank()))
        registry.register(BuildInfo())
        return MetricsServer(registry, addr, port, setting="metrics_port (--metrics-port / FEEDLINE_METRICS_PORT)")

    @staticmethod
    def _pin(ring: BatchRing) -> int:
        """Page-lock the whole ring once so every copy to the GPU can be asynchronous."""
        ptr = ring.memory.base.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, ring.memory.size, 0)
        if int(getattr(err, "value", err)) != 0:
            raise LoaderError(f"cudaHostRegister of the {fmt_bytes(ring.memory.size)} ring failed: {err}")
        return ptr

    # -- iteration ------------------------------------------------------------------------

    def __iter__(self) -> "_EpochIterator":
        if self._closed:
            raise LoaderError("the loader is closed")
        p = self._pipeline
        assert p.pool is not None and p.queue is not None
        shards = self.source.snapshot()
        if not shards:
            raise LoaderError(f"no shards to read in {self.source.describe()}")
        self._epoch += 1
        self.epoch_shards = shards
        if len(shards) // self.rank.world_size < self.workers:
            log.warning("epoch %d: %d shards for %d ranks x %d workers; some workers sit idle",
                        self._epoch, len(shards), self.rank.world_size, self.workers)
        plans = [
            {"epoch": self._epoch, "seed": self.seed, "rank": self.rank.rank, "worker": w,
             "shards": worker_shards(shards, self.seed, self._epoch, self.rank, w, self.workers, self.shuffle)}
            for w in range(self.workers)
        ]
        if isinstance(self.source, CacheSource):
            self.source.epoch_started(self.rank.rank, self._epoch, len(shards))
        self._stats.set_epoch(self._epoch)
        p.queue.start_epoch(self._epoch)
        p.pool.start_epoch(self._epoch, plans)
        return _EpochIterator(self, self._epoch)

    @property
    def epoch(self) -> int:
        return self._epoch

    def stats(self) -> LoaderStats:
        """Counters and queue depths, named after the metrics in DESIGN.md."""
        p = self._pipeline
        depth = {"free": 0, "decoded": 0, "device": 0}
        busy = {"busy": 0, "idle": 0}
        if p.pool is not None and p.queue is not None:
            depth.update(p.pool.depths())
            depth["device"] = p.queue.depth()
            busy = p.pool.worker_states()
        capacity = {"free": self.ring_slots, "decoded": self.ring_slots,
                    "device": p.queue.capacity if p.queue is not None else 0}
        return self._stats.snapshot(depth, capacity, busy)

    def close(self) -> None:
        """Stop the workers and threads and free the ring; safe to call more than once."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "StagingLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _EpochIterator:
    """One epoch; measures the time the loop is blocked in ``next()`` (data wait) and between calls (step)."""

    def __init__(self, loader: StagingLoader, epoch: int):
        self._loader = loader
        self._epoch = epoch
        self._last_return: float | None = None
        self._held_slot: int | None = None
        self._pending_waits: list[tuple[Any, Any]] = []
        self._done = False

    def __iter__(self) -> "_EpochIterator":
        return self

    def _release_held(self) -> None:
        if self._held_slot is not None:
            pool = self._loader._pipeline.pool
            if pool is not None:
                pool.release(self._held_slot)
            self._held_slot = None

    def __next__(self) -> dict[str, torch.Tensor]:
        loader = self._loader
        called = time.perf_counter()
        step = called - self._last_return if self._last_return is not None else None
        self._release_held()
        if self._done:
            raise StopIteration
        if self._epoch != loader._epoch:
            raise LoaderError(f"epoch {self._epoch} was abandoned when epoch {loader._epoch} started")
        queue = loader._pipeline.queue
        if queue is None:
            raise LoaderError("the loader is closed")
        item = queue.get()
        wait = time.perf_counter() - called
        loader._stats.step(wait, step)
        if item is None:
            self._done = True
            self._last_return = None
            raise StopIteration
        if item.event is not None:
            self._hand_over_cuda(item)
        self._held_slot = item.slot
        self._last_return = time.perf_counter()
        return item.tensors

    def _hand_over_cuda(self, item: Any) -> None:
        """The consumer's stream waits for the copy on the GPU, not the host; measured lazily."""
        stream = torch.cuda.current_stream(self._loader.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(item.event)
        after.record(stream)
        for t in item.tensors.values():
            t.record_stream(stream)
        self._pending_waits.append((before, after))
        while self._pending_waits and self._pending_waits[0][1].query():
            b, a = self._pending_waits.pop(0)
            self._loader._stats.h2d_wait(b.elapsed_time(a) / 1000.0)

    def __del__(self) -> None:
        try:
            self._release_held()
        except Exception:
            pass
