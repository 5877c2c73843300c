"""The demo training job (``feedline train``): a small model fed by the staging loader.

The step has a configurable minimum duration, so a user can watch starvation
appear (fast steps, the loader is the bottleneck) and disappear (slow steps).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .config import Config
from .formats.transforms import RandomResizedCrop
from .loader.loader import StagingLoader
from .loader.stats import LoaderStats

log = logging.getLogger("feedline.train")


class DemoNet(nn.Module):
    """A small convolutional classifier: enough compute to be a real step, small enough for 2 cores."""

    def __init__(self, classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float().div_(255.0)
        return self.body(x)


@dataclass
class EpochSummary:
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


@dataclass
class TrainSummary:
    device: str
    epochs: list[EpochSummary]
    final: LoaderStats | None = None
    interrupted: bool = False

    def to_json(self) -> dict[str, Any]:
        f = self.final
        return {
            "device": self.device,
            "interrupted": self.interrupted,
            "epochs": [e.to_json() for e in self.epochs],
            "loader": None if f is None else {
                "samples_total": f.samples_total, "bytes_total": f.bytes_total,
                "data_wait_seconds_total": f.data_wait_seconds_total, "step_seconds_total": f.step_seconds_total,
                "gpu_starvation_ratio": f.gpu_starvation_ratio, "sample_errors_total": f.sample_errors_total,
                "worker_restarts_total": f.worker_restarts_total, "h2d_wait_seconds_total": f.h2d_wait_seconds_total,
                "queue_capacity": f.queue_capacity,
            },
        }


def build_loader(cfg: Config) -> StagingLoader:
    transform = RandomResizedCrop(cfg.image_size, fields=["jpg"])
    return StagingLoader(transform=transform, spec={"jpg": ("uint8", (cfg.image_size, cfg.image_size, 3)),
                                                     "cls": "int64"}, **cfg.loader_kwargs(serve_metrics=True))


def train(cfg: Config, loader: StagingLoader,
          on_step: Callable[[EpochSummary, LoaderStats | None], None] | None = None,
          on_epoch_start: Callable[[int], None] | None = None) -> TrainSummary:
    """Train the demo model for ``cfg.epochs`` epochs; ``on_step`` drives a progress display."""
    device = loader.device
    torch.manual_seed(cfg.seed)
    model = DemoNet(cfg.classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    summary = TrainSummary(str(device), [])
    step_floor = cfg.step_ms / 1000.0
    for epoch in range(cfg.epochs):
        before = loader.stats()
        es = EpochSummary(epoch)
        summary.epochs.append(es)
        it = iter(loader)
        if on_epoch_start is not None:
            on_epoch_start(epoch)
        es.shards = len(loader.epoch_shards)
        es.shard_bytes = sum(os.path.getsize(p) for p in loader.epoch_shards if os.path.exists(p))
        for batch in it:
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
            es.steps += 1
            es.samples += int(labels.shape[0])
            stats = loader.stats() if es.steps % 10 == 1 else None
            if stats is not None:
                for k in es.depth_sum:
                    es.depth_sum[k] += stats.queue_depth[k] * 10
            if on_step is not None:
                on_step(es, stats)
            if cfg.max_steps and es.steps >= cfg.max_steps:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        es.seconds = es.elapsed()
        after = loader.stats()
        es.decoded_bytes = after.bytes_total["decoded"] - before.bytes_total["decoded"]
        es.data_wait_seconds = after.data_wait_seconds_total - before.data_wait_seconds_total
        es.step_seconds = after.step_seconds_total - before.step_seconds_total
        log.info("epoch %d: %d samples in %.1f s (%.0f samples/s, %.1f MB/s), data wait %.2f s, starvation %.2f",
                 epoch, es.samples, es.seconds, es.samples_per_s, es.mb_per_s, es.data_wait_seconds, es.starvation)
    summary.final = loader.stats()
    return summary
