"""The demo training job (``feedline train``): a small model fed by the staging loader.

The step has a configurable minimum duration, so a user can watch starvation
appear (fast steps, the loader is the bottleneck) and disappear (slow steps).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from ..api.staging_loader import StagingLoader
from .checkpoint import CheckpointDir, random_states, restore_random_states
from ..api.config import Config
from .distributed import Job, anyone, barrier, gather_json
from .keytrace import KeyTrace
from ..formats.transforms import RandomResizedCrop
from ..loader.plan.resume import RANKS_FORMAT
from ..loader.settings import DeviceDecode
from ..loader.stats import LoaderStats
from ..loader.tune.autotune import usable_cpus
from .sgd import MomentumSGD

log = logging.getLogger("feedline.train")


class DemoNet(nn.Module):
    """A small convolutional classifier: enough compute to be a real step, small enough for 2 cores; its dropout
    draws from torch's generator, as real models do, so a resume must restore that too."""

    def __init__(self, classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(32, classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float().div_(255.0)
        return self.body(x)


@dataclass
class EpochSummary:
    """One epoch of the demo job, as the summary table shows it."""

    epoch: int
    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    decoded_bytes: int = 0
    data_wait_seconds: float = 0.0
    step_seconds: float = 0.0
    loss: float = 0.0
    shards: int = 0  # distinct shards this epoch read
    shard_bytes: int = 0  # their size: the cache's size when training from a cache
    started: float = field(default_factory=time.perf_counter)
    depth_sum: dict[str, float] = field(default_factory=lambda: {"free": 0.0, "decoded": 0.0, "device": 0.0})
    sources: dict[str, int] = field(default_factory=dict)  # a mixture: samples trained on, per source

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.decoded_bytes / 1e6 / self.seconds if self.seconds else 0.0

    @property
    def starvation(self) -> float:
        total = self.data_wait_seconds + self.step_seconds
        return self.data_wait_seconds / total if total else 0.0

    def mean_depth(self) -> dict[str, float]:
        return {k: v / self.steps if self.steps else 0.0 for k, v in self.depth_sum.items()}

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("depth_sum")
        d.pop("started")
        d.update(samples_per_s=self.samples_per_s, mb_per_s=self.mb_per_s, starvation=self.starvation,
                 mean_queue_depth=self.mean_depth())
        return d


KEPT_EPOCHS = 100  # rows the summary keeps: a run of weeks with small epochs must not grow without bound


@dataclass
class TrainSummary:
    """The whole demo run: per-epoch rows (all ranks' together; the last ``KEPT_EPOCHS``, the log has every one)
    and the loader's final counters (this rank's)."""

    device: str
    epochs: deque[EpochSummary] = field(default_factory=lambda: deque(maxlen=KEPT_EPOCHS))
    epochs_run: int = 0  # every epoch started, the rows left out included
    final: LoaderStats | None = None
    interrupted: bool = False
    ranks: int = 1
    steps: list[int] = field(default_factory=list)  # per rank, over the whole run
    parameters: list[float] = field(default_factory=list)  # per rank: a checksum of the model's parameters

    def to_json(self) -> dict[str, Any]:
        f = self.final
        return {
            "device": self.device,
            "interrupted": self.interrupted,
            "ranks": self.ranks,
            "steps_per_rank": self.steps,
            "parameter_checksum_per_rank": self.parameters,
            "epochs": [e.to_json() for e in self.epochs],
            "epochs_left_out": self.epochs_run - len(self.epochs),
            "loader": None if f is None else {
                "samples_total": f.samples_total, "bytes_total": f.bytes_total,
                "data_wait_seconds_total": f.data_wait_seconds_total, "step_seconds_total": f.step_seconds_total,
                "gpu_starvation_ratio": f.gpu_starvation_ratio, "sample_errors_total": f.sample_errors_total,
                "worker_restarts_total": f.worker_restarts_total, "h2d_wait_seconds_total": f.h2d_wait_seconds_total,
                "queue_capacity": f.queue_capacity,
            },
        }


# An image and its label: tar members .jpg/.cls, or TFRecord features as TensorFlow's ImageNet scripts name them
# (image/encoded, image/class/label) or as TFDS does (image, label)
DEMO_FIELDS = {"jpg": "jpg;jpeg;image/encoded;image", "cls": "cls;image/class/label;label"}


def build_loader(cfg: Config, job: Job = Job()) -> StagingLoader:
    """The demo's loader: random-resized crops of the JPEGs and their labels; metrics on 9102 (+ LOCAL_RANK)."""
    if cfg.device_decode:  # the same crops, made where the batch lands from the compressed bytes
        return StagingLoader.from_settings(
            cfg.loader_settings().replace(device_decode=DeviceDecode(("jpg",), cfg.image_size)),
            **cfg.loader_source(), fields=["jpg", "cls"], metrics_port=cfg.trainer_port(job.local_rank),
            metrics_addr=cfg.metrics_addr)
    return StagingLoader.from_settings(
        cfg.loader_settings(), **cfg.loader_source(), transform=RandomResizedCrop(cfg.image_size, fields=["jpg"]),
        fields=DEMO_FIELDS, spec={"jpg": ("uint8", (cfg.image_size, cfg.image_size, 3)), "cls": "int64"},
        metrics_port=cfg.trainer_port(job.local_rank), metrics_addr=cfg.metrics_addr)


def train(cfg: Config, loader: StagingLoader,
          on_step: Callable[[EpochSummary, LoaderStats | None], None] | None = None,
          on_epoch_start: Callable[[int], None] | None = None, stop: threading.Event | None = None,
          trace_keys: KeyTrace | None = None, job: Job = Job()) -> TrainSummary:
    """Train the demo model for ``cfg.epochs`` epochs; ``on_step`` drives a progress display.

    Under torchrun (``job.distributed``) the model is wrapped in DistributedDataParallel and every rank
    stops at the same step. With ``cfg.checkpoint`` it saves model, optimizer, every rank's loader state and
    random generators every ``cfg.checkpoint_every`` steps, when ``stop`` is set (SIGTERM: the current step is
    finished first) and at the end; with ``cfg.resume`` it starts from the newest complete checkpoint there.
    ``trace_keys`` gets the key of every sample this rank trained (``keytrace.py``).
    """
    device = loader.device
    if device.type == "cpu":
        _leave_workers_their_cpus(loader, job)
    torch.manual_seed(cfg.seed)
    net = DemoNet(cfg.classes).to(device)
    model: nn.Module = net
    if job.distributed:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = MomentumSGD(model.parameters(), lr=0.05, momentum=0.9)  # torch.optim's: 1.1 s of start-up (sgd.py)
    loss_fn = nn.CrossEntropyLoss()
    summary = TrainSummary(str(device), ranks=job.world)
    step_floor = cfg.step_ms / 1000.0
    checkpoints = CheckpointDir(cfg.checkpoint) if cfg.checkpoint else None
    step = 0
    if checkpoints is not None and cfg.resume:
        step = _resume(checkpoints, net, opt, loader, job, trace_keys)

    def save() -> None:
        state = loader.state_dict()  # every rank takes part (under DDP it gathers every rank's); rank 0 writes
        states = [state] if state.get("format") == RANKS_FORMAT else gather_json(job, state)
        randoms = gather_json(job, random_states())
        traces = gather_json(job, trace_keys.position() if trace_keys is not None else None)
        if checkpoints is not None and job.leader:
            checkpoints.save(step, net.state_dict(), opt.state_dict(), {"ranks": states},
                             {"epoch": loader.epoch, "epochs": cfg.epochs, "world": job.world, "traces": traces},
                             randoms)
        barrier(job)

    for epoch in range(loader.next_epoch, cfg.epochs):
        if anyone(job, stop is not None and stop.is_set()):  # a SIGTERM before the epoch's first step
            log.info("stopping at step %d (SIGTERM), before epoch %d", step, epoch)
            summary.interrupted = True
            break
        loader.set_epoch(epoch)
        before = loader.stats()
        es = EpochSummary(epoch)
        summary.epochs.append(es)
        summary.epochs_run += 1
        it = iter(loader)
        first = next(it, None)  # the epoch starts at its first batch: its shards are known from here
        if on_epoch_start is not None:
            on_epoch_start(epoch)
        es.shards = len(loader.epoch_shards)
        es.shard_bytes = sum(os.path.getsize(p) for p in loader.epoch_shards if os.path.exists(p))
        stopping = False
        for batch in itertools.chain([] if first is None else [first], it):
            t0 = time.perf_counter()
            images, labels = batch["jpg"], batch["cls"] % cfg.classes
            loss = loss_fn(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if device.type == "cuda" and es.steps % 20 == 0:
                es.loss = loss.detach().item()  # an occasional sync, as real loops log
            elif device.type != "cuda":
                es.loss = loss.detach().item()
            spare = step_floor - (time.perf_counter() - t0)
            if spare > 0:
                time.sleep(spare)
            step += 1
            es.steps += 1
            es.samples += int(labels.shape[0])
            for name in batch.get("__source__", ()):
                es.sources[name] = es.sources.get(name, 0) + 1
            if trace_keys is not None:
                trace_keys.write(epoch, batch["__key__"])
            stats = loader.stats() if es.steps % 10 == 1 else None
            if stats is not None:
                for k in es.depth_sum:
                    es.depth_sum[k] += stats.queue_depth[k] * 10
            if on_step is not None:
                on_step(es, stats)
            stopping = anyone(job, stop is not None and stop.is_set())  # all ranks stop at the same step
            if stopping:
                break
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                save()
            if cfg.max_steps and es.steps >= cfg.max_steps:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        es.seconds = es.elapsed()
        after = loader.stats()
        es.decoded_bytes = after.bytes_total["decoded"] - before.bytes_total["decoded"]
        es.data_wait_seconds = after.data_wait_seconds_total - before.data_wait_seconds_total
        es.step_seconds = after.step_seconds_total - before.step_seconds_total
        _across_ranks(es, job)
        log.info("epoch %d: %d samples in %.1f s (%.0f samples/s, %.1f MB/s), data wait %.2f s, starvation %.2f",
                 epoch, es.samples, es.seconds, es.samples_per_s, es.mb_per_s, es.data_wait_seconds, es.starvation)
        if stopping:
            log.info("stopping at step %d (SIGTERM), in epoch %d", step, epoch)
            summary.interrupted = True
            break
    save()
    summary.steps = [int(n) for n in gather_json(job, step)]
    summary.parameters = gather_json(job, float(sum(p.detach().double().sum() for p in net.parameters())))
    summary.final = loader.stats()
    return summary


def _leave_workers_their_cpus(loader: StagingLoader, job: Job) -> None:
    """A CPU step gets the CPUs this rank's decode workers leave it, not torch's default of every core.

    With as many intra-op threads as cores and the workers busy on them, each step waits on threads that
    are not running: the demo model's step (batch 4) took 130 ms that way beside one busy core, under 1 ms
    on one thread. The workers counted are those the loader starts with (``auto`` adds more only while the
    loop waits for data, when the step is not what is slow). Left alone: ``OMP_NUM_THREADS`` set (torchrun
    sets it to 1), and ``device_decode``, whose decoding runs in this process.
    """
    if os.environ.get("OMP_NUM_THREADS") or loader.settings.device_decode is not None:
        return
    cpus = usable_cpus()[0] // max(1, job.local_world)
    threads = max(1, cpus - loader.workers)
    if threads < torch.get_num_threads():
        log.info("torch intra-op threads: %d (%d CPU(s) for this rank, %d decode worker(s); set OMP_NUM_THREADS to "
                 "choose)", threads, cpus, loader.workers)
        torch.set_num_threads(threads)


def _resume(checkpoints: CheckpointDir, net: nn.Module, opt: MomentumSGD, loader: StagingLoader,
            job: Job, trace_keys: KeyTrace | None = None) -> int:
    """Load the newest complete checkpoint into the model, optimizer and loader; its step (0: none yet).

    The key trace is cut back to where the checkpoint left it: what a crash lost is trained again.
    """
    found = checkpoints.latest()
    if found is None:
        log.info("no checkpoint in %s yet: starting from the beginning", checkpoints.directory)
        return 0
    net.load_state_dict(found.model)
    opt.load_state_dict(found.optimizer)
    restore_random_states(found.randoms, job.rank, job.world)
    states = found.loader["ranks"]
    if states and states[0].get("format") == RANKS_FORMAT:  # every rank's state in one: it picks this rank's
        loader.load_state_dict(states[0])
    elif len(states) == job.world:
        loader.load_state_dict(states[job.rank])
    else:  # another world size than the checkpoint's: every rank replays all the saved states
        log.info("the checkpoint has %d rank(s), this job %d: resuming the loader elastically", len(states),
                 job.world)
        loader.load_state_dict(states, elastic=True)
    traces = found.meta.get("traces") or []
    if trace_keys is not None and len(traces) == job.world:
        trace_keys.rewind(traces[job.rank])
    log.info("resuming from %s: step %d, epoch %d", found.path, found.step, loader.next_epoch)
    return found.step


def _across_ranks(es: EpochSummary, job: Job) -> None:
    """The epoch's row for the whole job: samples and bytes summed, the slowest rank's time, the most starved
    rank's data wait and step."""
    if not job.distributed:
        return
    rows = gather_json(job, [es.samples, es.decoded_bytes, es.seconds, es.data_wait_seconds, es.step_seconds,
                             es.sources])
    worst = max(rows, key=lambda r: r[3] / (r[3] + r[4]) if r[3] + r[4] else 0.0)
    es.sources = {name: sum(int(r[5].get(name, 0)) for r in rows) for name in sorted({n for r in rows for n in r[5]})}
    es.samples = int(sum(r[0] for r in rows))
    es.decoded_bytes = int(sum(r[1] for r in rows))
    es.seconds = max(r[2] for r in rows)
    es.data_wait_seconds, es.step_seconds = worst[3], worst[4]


def epoch_samples(loader: StagingLoader) -> int | None:
    """Samples this rank sees in the current epoch, from the shard indexes (for the progress bar)."""
    from ..formats.shard_index import ShardError, load_index
    from ..loader.plan.sources import known_counts

    plan = loader.plan
    if plan is not None and plan.mixture is not None:  # the epoch's draw, not the shards' contents
        return sum(plan.mixture.drawn) // loader.rank.world_size

    if plan is None:
        return None
    counts = known_counts(loader.source)
    try:  # the rank's own shards only: at 100,000 shards every rank reading every index would take minutes
        return sum(counts[p] if p in counts else len(load_index(plan.file_of(p)).samples) for p in plan.own_paths())
    except ShardError:
        return None


def print_summary(console: Console, summary: TrainSummary, loader: StagingLoader) -> None:
    """The run's table, one row an epoch, and the loader's totals."""
    left_out = summary.epochs_run - len(summary.epochs)
    table = Table(title=f"feedline train — {summary.device}, {loader.workers} workers, "
                        f"batch {loader.batch_size}, ring {loader.ring_slots} slots"
                        + (f" (the last {len(summary.epochs)} of {summary.epochs_run} epochs; the log has every one)"
                           if left_out else ""))
    mixed = any(e.sources for e in summary.epochs)
    for col in ("epoch", "shards", "shard MB", "samples", *(("per source",) if mixed else ()), "seconds", "samples/s",
                "MB/s", "data wait s", "starvation", "queues free/decoded/device (mean)", "loss"):
        table.add_column(col, justify="right")
    for e in summary.epochs:
        d = e.mean_depth()
        per_source = (" ".join(f"{name} {n}" for name, n in sorted(e.sources.items())),) if mixed else ()
        table.add_row(str(e.epoch), str(e.shards), f"{e.shard_bytes / 1e6:.0f}", str(e.samples), *per_source,
                      f"{e.seconds:.1f}", f"{e.samples_per_s:.0f}",
                      f"{e.mb_per_s:.1f}", f"{e.data_wait_seconds:.2f}", f"{e.starvation:.2f}",
                      f"{d['free']:.1f}/{d['decoded']:.1f}/{d['device']:.1f}", f"{e.loss:.3f}")
    console.print(table)
    f = summary.final
    errors = {k: v for k, v in f.sample_errors_total.items() if v}
    console.print(
        f"total: {f.samples_total} samples, {f.bytes_total['decoded'] / 1e6:.0f} MB decoded, "
        f"data wait {f.data_wait_seconds_total:.2f} s, step {f.step_seconds_total:.2f} s, "
        f"starvation (last {loader.starvation_window:.0f} s) {f.gpu_starvation_ratio:.2f}, "
        f"queue capacity {f.queue_capacity}, sample errors {errors or 'none'}, "
        f"worker restarts {f.worker_restarts_total}"
    )
