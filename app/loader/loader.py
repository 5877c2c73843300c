"""``StagingLoader``: tar shards -> worker processes -> shared-memory ring -> transfer threads -> the loop.

The loader owns every resource of the pipeline (processes, the ring, threads,
pipes) through one ``Pipeline`` and frees them in ``close()``; it is also a
context manager, and a finalizer closes a loader that was forgotten. It takes
plain settings (``LoaderSettings``) and pushes its statistics to the sink it is
given; it serves nothing itself (``feedline.StagingLoader`` adds ``metrics_port=``).

Why this file is long: the constructor spells out every setting as a keyword (35 lines, so
editors and ``help()`` show them) and wires the parts in the order each needs the last (~150 lines);
the parts live in their own files, the epochs' plans and the resume state in ``loader_epochs.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..cache.mix import part_dir, wait_for_layout
from ..cache.source import CacheSource
from ..errors import SettingError
from ..formats.decoders import Decoder
from ..formats.transforms import generators_of
from ..sink import StatsSink
from .cost import CostSnapshot, TrainerCost
from .cpus.pinning import ProcessPins
from .cpus.placement import for_this_process
from .device.device_decode import DeviceDecoder, compressed_spec, worker_decode
from .device.gpu import CudaGpu, Gpu, cuda_index
from .device.handoff import DirectCopy, DirectHandOff, cpu_ring_slots
from .device.slots import DeviceSlots
from .device.standin import StandInGpu
from .device.transfer import DeviceQueue, FieldsHandOff, SlotHandOff, TransferStage
from .errors import ErrorBudget, LoaderError
from .iterator import EpochIterator
from .layout.sample import FieldSelection
from .layout.spec import Spec
from .loader_epochs import LoaderEpochs
from .pipeline import Pipeline
from .plan.coordinate import RankCoordinator
from .plan.epoch_plan import EpochPlan
from .plan.epochs import EpochCounter, EpochSampler
from .plan.mixture import Source, check_sources
from .plan.rank import Rank
from .plan.resume import Cursor, Resume, plan_resume
from .plan.sources import MixedSource, PathSource, ShardSource, check_counts
from .ring.batch_ring import BatchRing, RingHandle, RingLayout, check_ring_memory
from .remote.cluster import check_cluster, refuse_parquet, remote_capacity, remote_setup
from .remote.settings import RemoteDecode
from .ring.kept import KeptBatches
from .settings import DEFAULT_MAX_MEMBER_BYTES, STANDIN, DeviceDecode, LoaderSettings, unknown_argument
from .stats import LoaderStats, StatsRecorder
from .tune.auto import AutoWorkers
from .tune.autotune import AUTO, choose
from .tune.tuner import CpuMeter, WorkerTuner
from .workers.dispatcher import tick_seconds
from .workers.launch import Launcher
from .workers.index_share import IndexShare
from .workers.pool import WorkerPool
from .workers.probe import PROBE_SHARDS, probe_spec, resolve_side_bytes
from .workers.worker import WorkerCode, WorkerSetup

log = logging.getLogger("feedline.loader")


def _one_source(source: Source, decompress_dir: str | None, member_bound: int | None = None) -> ShardSource:
    """A mixture's source as the loader reads one: its errors name the source."""
    try:
        if source.cache is not None:
            return CacheSource(source.cache)
        return PathSource(source.shards, decompress_dir, member_bound)  # type: ignore[arg-type]
    except SettingError as exc:
        raise SettingError("sources", f"source {source.name!r}: {exc}") from None


class StagingLoader(LoaderEpochs):
    """Iterate over batches (dicts of tensors); each ``for`` loop is one epoch.

    Fields are keyed by their tar extension (``batch["jpg"]``, ``batch["cls"]``)
    unless the spec renames them; images are HWC uint8 unless a transform says
    otherwise. With ``drop_last=False`` each worker's last batch of an epoch may
    be partial. The keyword arguments are ``LoaderSettings``' fields; see
    ``from_settings`` to pass the settings object itself.
    """

    def __init__(
        self,
        shards: str | os.PathLike | Sequence[str | os.PathLike] | ShardSource | None = None,
        *,
        cache: str | os.PathLike | None = None,
        sources: Sequence[Source] | None = None,
        spec: Spec | Mapping[str, Any] | None = None,
        fields: Sequence[str] | Mapping[str, str] | None = None,
        decode: bool | Mapping[str, Callable[[memoryview], Any]] = True,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        sink: StatsSink | None = None,
        batch_size: int = 32,
        workers: int | str = 2,
        max_workers: int | None = None,
        transfer_threads: int | str = 0,
        h2d: str = "slot",
        ring_slots: int | None = None,
        shuffle: bool | str = True,
        shuffle_buffer: int = 1000,
        shuffle_block: int = 256,
        seed: int = 0,
        drop_last: bool = False,
        device: str | torch.device = "cpu",
        zero_copy: bool = False,
        in_order: bool = True,
        max_sample_errors: float = 0.05,
        worker_timeout: float = 60.0,
        stall_timeout: float = 120.0,
        side_bytes: int | None = None,
        decompress_dir: str | None = None,
        equal_batches: str = "drop",
        device_queue: int = 2,
        start_method: str = "spawn",
        rank: Rank | None = None,
        starvation_window: float = 30.0,
        min_shards: int = 1,
        wait_timeout: float = 60.0,
        device_decode: DeviceDecode | Mapping[str, Any] | bool | None = None,
        max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
        worker_memory: int = 0,
        cpu_placement: str = "auto",
        trainer_cores: int | None = None,
        remote: RemoteDecode | str | None = None,
        **unknown: Any,
    ):
        if unknown:
            known = [p for p in inspect.signature(StagingLoader.__init__).parameters if p not in ("self", "unknown")]
            raise TypeError(unknown_argument(next(iter(unknown)), known))
        self.settings = s = LoaderSettings(
            batch_size=batch_size, workers=workers, max_workers=max_workers, transfer_threads=transfer_threads,
            h2d=h2d, ring_slots=ring_slots, device_queue=device_queue, device=str(device), zero_copy=zero_copy,
            in_order=in_order, shuffle=shuffle, shuffle_buffer=shuffle_buffer, shuffle_block=shuffle_block, seed=seed, drop_last=drop_last,
            max_sample_errors=max_sample_errors, worker_timeout=worker_timeout, stall_timeout=stall_timeout,
            side_bytes=side_bytes, decompress_dir=decompress_dir, equal_batches=equal_batches,
            start_method=start_method, rank=rank, starvation_window=starvation_window, min_shards=min_shards,
            wait_timeout=wait_timeout, device_decode=device_decode, max_member_bytes=max_member_bytes,
            worker_memory=worker_memory, cpu_placement=cpu_placement, trainer_cores=trainer_cores, remote=remote)
        self.standin = s.device == STANDIN  # the device path on the CPU, against a stand-in (device/standin.py)
        self.device = torch.device("cpu" if self.standin else s.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise SettingError("device", f"{s.device!r} but CUDA is not available here; use device='cpu'")
        on_device = self.device.type == "cuda" or self.standin
        if s.h2d == "fields" and on_device and s.transfer_threads == 0:
            raise SettingError("h2d", "'fields' copies in transfer threads, but transfer_threads=0: set "
                                      "transfer_threads >= 1, or use h2d='slot' (the default)")
        if sum(x is not None for x in (shards, cache, sources)) != 1:
            raise SettingError("shards", "give exactly one of shards= (paths or globs), cache= (a cache directory) "
                                         "or sources= (a mixture: feedline.Source objects)")
        self.mixture: tuple[Source, ...] | None = None
        waited = time.monotonic()
        if cache is not None:  # a mixing sidecar's cache (``cache/mix.py``): mixed by the weights it was given
            parts = wait_for_layout(os.fspath(cache), s.wait_timeout)
            if parts is not None:
                sources = [Source(p.name, cache=part_dir(os.fspath(cache), p.name), weight=p.weight) for p in parts]
                cache = None
        waited = time.monotonic() - waited
        if sources is not None:
            self.mixture = check_sources(sources)
            self.source: ShardSource = MixedSource([m.name for m in self.mixture],
                                                   [_one_source(m, s.decompress_dir, s.max_member_bytes)
                                                    for m in self.mixture])
        else:
            self.source = (
                CacheSource(cache) if cache is not None
                else shards if hasattr(shards, "snapshot")
                else PathSource(shards, s.decompress_dir, s.max_member_bytes)  # type: ignore
            )
        self.rank = s.rank or Rank.detect()
        self.transform = transform
        try:
            selection = FieldSelection(fields)
        except (TypeError, ValueError) as exc:
            raise SettingError("fields", str(exc).removeprefix("fields: ")) from None
        self._epochs = EpochCounter()  # which epoch the next start reads (epochs.py)
        self._resume: Resume | None = None  # a loaded state, applied by the next iter()
        self._cursor: Cursor | None = None
        self._counts: dict[str, int] = {}  # samples per shard of this epoch, where the source knows them
        self._checked: tuple[EpochPlan, EpochPlan] | None = None  # the last plan made readable, and the result
        self._closed = False
        self.plan: EpochPlan | None = None  # the current epoch's
        self._iterator: weakref.ref[EpochIterator] | None = None  # the current epoch's, to end with the ring
        self._runs = 0  # starts of epochs given to the pool: each start's batches carry its number
        self._auto: AutoWorkers | None = None  # workers="auto" during the first epoch
        self._planned: EpochPlan | None = None  # the next epoch's plan, made by len() before the epoch starts

        first = self._wait_for_shards(s.min_shards, max(0.1, s.wait_timeout - waited))
        self.auto_workers = s.workers == AUTO
        self.placement = for_this_process(s.cpu_placement, s.trainer_cores, on_device,  # cpus/placement.py
                                          cuda_index(self.device))
        threads_per_worker = int(getattr(transform, "threads_per_worker", 1))
        generators_of(transform)  # a transform's class that declares what no worker seeds is refused here
        placed = len(self.placement.worker_cpus) if self.placement.placed else None
        remote_most, grows_onto = 0, False  # workers="auto" with remote=: the cluster's places, after the local ones
        if s.remote is not None and self.auto_workers:
            refuse_parquet(first)
            checked = check_cluster(s.remote)  # refused (naming the address), or fallen back from: None
            if checked is None:
                s = s.replace(remote=None)
            else:
                here = choose("cuda" if on_device else "cpu", device_decode=s.device_decode is not None,
                              threads_per_worker=threads_per_worker, placed_cpus=placed).most
                remote_most, grows_onto = remote_capacity(checked, here), True
        default_ring = s.ring_slots is None  # a CPU host's is sized for reading ahead once the batch's bytes are known
        s, most, local = s.resolve_auto("cuda" if on_device else "cpu", threads_per_worker, placed, remote_most)
        self.settings, self.most_workers = s, most
        meter = CpuMeter(cpus=set(self.placement.worker_cpus)) if self.placement.placed else None  # workers' idle
        tuner = WorkerTuner(int(s.workers), most, meter, local) if self.auto_workers and most > s.workers else None
        if len(first) < self.rank.world_size:  # more workers than shards is fine; a growing cache was waited for
            raise SettingError(
                "shards", f"{len(first)} shard(s){' (the whole source)' if self.source.growing else ''} for "
                          f"{self.rank.world_size} ranks: rank {self.rank.rank} would get none; run at most "
                          f"{len(first)} rank(s), or split the data into more shards")
        self._stats = StatsRecorder(s.starvation_window, sink)
        self._stats.configured(int(s.transfer_threads) if on_device else 0,
                               (len(self.placement.trainer), len(self.placement.worker_cpus)))
        self._cost = TrainerCost()  # what feedline spends in this process (cost.py)
        p = self._pipeline = Pipeline()
        self._finalizer = weakref.finalize(self, p.close)
        try:
            p.indexes = IndexShare.create()  # each shard's index built once for this process and its workers
            if RankCoordinator.wanted(s.equal_batches):  # every rank builds its loaders in the same order
                p.coordinator = RankCoordinator(s.equal_batches)
            if s.device_decode is not None:  # the workers keep those members compressed
                decode, spec = worker_decode(decode, spec, s.device_decode, selection, s.max_member_bytes)
            p.launcher = Launcher(WorkerCode(Decoder(decode, max_member_bytes=s.max_member_bytes), selection,
                                                  transform))  # refused if unpicklable
            probed_shards = sorted(first)[:PROBE_SHARDS]  # (a compressed one: its plain copy, made now)
            files = self._local_files(probed_shards)
            self.spec, probed = probe_spec(spec, [files.get(f, f) for f in probed_shards], self.source.describe(),
                                           p.launcher.code(), s.max_sample_errors, p.indexes)
            check_counts(self._listed(), probed_shards, p.indexes, files)
            if s.device_decode is not None:
                self.spec = compressed_spec(self.spec, s.device_decode)
            layout = RingLayout(self.spec, s.batch_size, resolve_side_bytes(s.side_bytes, self.spec, probed),
                                labelled=self.mixture is not None)
            if default_ring and not on_device and s.device_decode is None:  # (DirectHandOff reads ahead)
                s = self.settings = s.replace(ring_slots=self._ring_for_reading_ahead(layout, s.slots))
            check_ring_memory(layout, s.slots, self.most_workers)
            p.ring = BatchRing(layout, s.slots, self.most_workers)
            if on_device:
                p.gpu = (StandInGpu(self._cost) if self.standin else CudaGpu(self.device, self._cost))
                p.gpu.pin(p.ring.memory)
            remote_json, remote_places = remote_setup(  # refused, or fallen back from, before a worker starts
                s.remote, most, len(self.placement.worker_cpus) if self.placement.placed
                else len(os.sched_getaffinity(0)), first, tuple(range(local, most)) if grows_onto else None)
            setup = WorkerSetup(RingHandle.of(p.ring), s.shuffle_buffer if s.shuffle else 0, s.drop_last,
                                logging.getLogger("feedline").getEffectiveLevel(), s.block, remote_json, remote_places,
                                p.indexes.to_json())
            stats, slots = self._stats, s.slots
            p.pin(self.placement)  # the training process's threads on its cores (its workers' are theirs)
            p.pool = WorkerPool(p.ring, p.launcher, setup.to_json(), s.workers, stats,
                                ErrorBudget(s.max_sample_errors), in_order=s.in_order,
                                worker_timeout=s.worker_timeout, stall_timeout=s.stall_timeout,
                                worker_memory=s.worker_memory, cpus_of=self._worker_cpus,
                                on_tick=lambda: p.tick(stats, slots, self._cost),
                                tick=tick_seconds(stats.listens, s.stall_timeout), cost=self._cost)
            if s.device_decode is not None:  # rows it cannot decode count against the failure budget
                p.decoder = DeviceDecoder(s.device_decode, self.device, s.seed, p.pool.samples_dropped)
            if tuner is not None:
                self._auto = AutoWorkers(tuner, p.pool, stats.loop_times, lambda: self._cursor.batches if
                                         self._cursor else 0, self._regrow,
                                         in_epoch=p.coordinator is None and s.in_order)
            if p.gpu is None:
                if not s.zero_copy:  # batches the loop may keep: the held ones beyond the spare are moved out
                    p.kept = KeptBatches(p.ring, p.pool.release, spare=max(1, slots - 2 * most),
                                         on_copy=stats.kept_batch_copied)
                p.queue = DirectHandOff(p.pool, p.ring, stats, p.kept, p.decoder)
            else:
                self._hand_off(p, p.gpu, s)
            self._cost.started()  # every stream, event and buffer is made: any later one is a per-batch cost
        except BaseException:
            self.close()
            raise

    def _ring_for_reading_ahead(self, layout: RingLayout, slots: int) -> int:
        """A CPU host's default ring: grown for ``next()`` to read batches ahead (``cpu_ring_slots``) where the
        memory left holds it; else the plain default, refused (naming ring_slots) if that does not fit either."""
        grown = cpu_ring_slots(slots, layout.slot_bytes)
        if grown > slots:
            try:
                check_ring_memory(layout, grown, self.most_workers)
            except SettingError:
                return slots
        return grown

    def _hand_off(self, p: Pipeline, gpu: Gpu, s: LoaderSettings) -> None:
        """The device path: ``next()`` copying slots itself, or transfer threads (``h2d`` "slot" or "fields")."""
        assert p.pool is not None and p.ring is not None
        stats, threads = self._stats, int(s.transfer_threads)
        if s.h2d == "slot":
            p.slots = DeviceSlots(gpu, p.ring, self._cost, stats.kept_batch_copied, consumed_events=threads > 0)
        if threads == 0:
            assert p.slots is not None
            p.queue = DirectCopy(p.pool, p.ring, stats, p.slots, s.device_queue, p.decoder)
            return
        queue = DeviceQueue(s.device_queue, s.in_order, self._cost)
        p.queue = SlotHandOff(queue, p.slots, p.pool) if p.slots is not None else FieldsHandOff(queue, gpu, stats)
        p.transfer = TransferStage(p.pool, p.ring, queue, stats, threads, gpu, self._cost, p.slots, p.decoder)

    @classmethod
    def from_settings(cls, settings: LoaderSettings, shards: Any = None, *, cache: str | os.PathLike | None = None,
                      spec: Spec | Mapping[str, Any] | None = None,
                      decode: bool | Mapping[str, Callable[[memoryview], Any]] = True,
                      transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                      sink: StatsSink | None = None, **extra: Any) -> "StagingLoader":
        """A loader from a settings object (what the face's ``Config`` builds); ``extra`` goes to a subclass."""
        values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
        return cls(shards, cache=cache, spec=spec, decode=decode, transform=transform, sink=sink, **values, **extra)

    # -- settings, as attributes users read ------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.settings.batch_size

    @property
    def workers(self) -> int:
        return self.settings.workers

    @property
    def ring_slots(self) -> int:
        return self.settings.slots

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def epoch_shards(self) -> list[str]:
        """The shard snapshot the current epoch reads (every rank's)."""
        return list(self.plan.shards) if self.plan is not None else []

    @property
    def epoch(self) -> int:
        """The epoch being read (-1 before the first batch)."""
        return self._epochs.current

    @property
    def next_epoch(self) -> int:
        """The epoch the next start reads or resumes."""
        return self._resume.plan.epoch if self._resume is not None else self._epochs.next

    @property
    def sampler(self) -> EpochSampler:
        """What trainers built for ``DataLoader`` call ``set_epoch`` on each epoch (Lightning): the loader's own."""
        return EpochSampler(self.set_epoch)

    # -- iteration ------------------------------------------------------------------------

    def __iter__(self) -> EpochIterator:
        """The next epoch (or the rest of a resumed one), started at its first ``next()``: a ``for`` over the
        loader reads one epoch each time, and an ``iter()`` never consumed changes nothing."""
        if self._closed:
            raise LoaderError("the loader is closed")
        return EpochIterator(self._start_epoch)

    def _start_epoch(self, it: EpochIterator) -> None:
        if self._closed:
            raise LoaderError("the loader is closed")
        p = self._pipeline
        assert p.pool is not None and p.queue is not None
        resume = self._resume
        first = delivered = None
        if resume is not None:  # (made readable first: a start refused there keeps the loaded state for the next)
            plan, first, delivered = self._readable(resume.plan), resume.first, resume.delivered
        self._resume = None
        if self._auto is not None and self._epochs.current >= 0:  # auto adjusts during the first epoch only
            self._stop_auto("the first epoch ended: its worker count stays")
        if resume is None:
            plan = self._next_plan()  # len() may have made it (and the ranks agreed on its batch count)
        self._planned = None
        self.plan = plan
        counts = getattr(self.source, "counts", {})
        self._counts = {path: counts[path] for path in plan.shards if path in counts}
        start = self._epochs.start(plan.epoch)
        log.debug("%s", plan.describe())
        limit = None
        if p.coordinator is not None:  # the same number of batches on every rank, or an error if out of step
            limit = self._epochs.agreed(plan.epoch)  # len() may have agreed (a loaded state forgets agreements)
            if limit is None:
                limit = p.coordinator.agree(plan.epoch, self._batches(plan))
                self._epochs.remember(plan.epoch, limit)
        self.source.epoch_started(self.rank.rank, plan.epoch, plan.shards)
        self._stats.set_epoch(plan.epoch)
        if p.decoder is not None:
            p.decoder.epoch = plan.epoch
        self._cursor = Cursor.start(plan.workers, first, delivered)
        self._cursor.expected = limit  # (else worked out from the shard indexes when a state is asked for)
        self._start_run(plan, first, delivered)
        it.run(plan.epoch, start, self._epochs, p.queue, p.pool.release, self._stats,
               self._cost, self._cursor, limit, p.kept, self._auto, self._epochs.ended,
               functools.partial(self.source.reading, self.rank.rank) if self.source.growing else None,
               on_device=p.gpu is not None)
        self._iterator = weakref.ref(it)

    def _start_run(self, plan: EpochPlan, first: list[int] | None = None, delivered: list[int] | None = None,
                   restart: bool = False) -> None:
        """Hand ``plan`` to the pool and the queue under a new run number (batches of earlier runs are dropped)."""
        p = self._pipeline
        assert p.pool is not None and p.queue is not None
        run, self._runs = self._runs, self._runs + 1
        p.queue.start_epoch(run)
        p.pool.start_epoch(plan, first, delivered, run, restart)

    # -- workers="auto" during the first epoch (tuner.py) ----------------------------------------

    def _worker_cpus(self, k: int) -> tuple[int, ...]:
        """Worker ``k``'s CPUs: its place in the plan; unplaced in a pinned process (another loader's plan), the
        process's mask before the pin, not the launching cores it would inherit."""
        return self.placement.worker(k) or ProcessPins.unpinned()

    def _regrow(self, workers: int) -> None:
        """The rest of this epoch over ``workers`` workers (``auto.py``), replanned as an elastic resume replans
        (over the plan's own shard names: a folder listed again may have changed since)."""
        state = self._own_state(names=True)
        self.settings = self.settings.replace(workers=workers)
        if self._cursor is None or self._cursor.finished or state["plan"] is None:
            return
        resume, _ = plan_resume(state, self._state_settings(), self.rank, self.source.snapshot(),
                                self.source.growing, elastic=True, local=self._local_file)
        if resume is not None:
            self.plan = self._readable(resume.plan)
            self._cursor.regrown(workers)
            self._cursor.expected = None  # another plan (no regrow under torch.distributed: no agreed count)
            self._start_run(self.plan, restart=True)

    def _stop_auto(self, message: str | None) -> None:
        """Auto stops adjusting: the first epoch ended, or a state was loaded."""
        auto, self._auto = self._auto, None
        if auto is not None:
            self.settings = self.settings.replace(workers=auto.stop(message))

    def stats(self) -> LoaderStats:
        """Counters and queue depths, named after the metrics in DESIGN.md."""
        return self._stats.snapshot(*self._pipeline.gauges(self.settings.slots))

    def flush_stats(self) -> None:
        """Push the statistics gathered since the dispatcher's last tick to the sink now (before a scrape)."""
        self._stats.flush()

    def count_thread(self, thread: threading.Thread, role: str = "other") -> None:
        """Count ``thread``'s CPU as feedline's in this process (``cost()``, ``trainer_cpu_seconds_total``)."""
        self._cost.thread(role, thread)

    def cost(self) -> CostSnapshot:
        """What feedline has spent in this process so far: its threads' CPU, wake-ups, device calls (on the
        loop's thread and in all), device objects made after start-up, host waits on the device (``cost.py``);
        ``cost().since(before)`` is a stretch of it, ``per_batch()`` its figures a batch."""
        return self._cost.snapshot()

    @property
    def starvation_window(self) -> float:
        return self._stats.window_seconds

    def close(self) -> None:
        """Stop the workers and threads and free the ring; safe to call more than once."""
        self._closed = True
        ref = getattr(self, "_iterator", None)
        it = ref() if ref is not None else None
        if it is not None:
            it.loader_closed()
        if self._finalizer.alive and self._epochs.finished:
            try:  # nothing left to resume: the sampler need keep nothing for this rank (a lease mid-epoch stays)
                self.source.released(self.rank.rank)
            except OSError as exc:
                log.warning("cannot end the reader lease in %s: %s", self.source.describe(), exc)
        self._finalizer()
        stats, cost = getattr(self, "_stats", None), getattr(self, "_cost", None)
        if stats is not None and cost is not None:  # what the last ticks did not push yet
            stats.flush()
            stats.report_cost(cost.snapshot())

    def __enter__(self) -> "StagingLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
