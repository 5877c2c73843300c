"""The end-to-end row: a real training step fed by feedline, by ``DataLoader``, and by synthetic data already
on the device (the ceiling): ``python -m feedline.bench.e2e {feedline,dataloader,synthetic} ...``.

The step is ResNet-50 (written here: torchvision is not a dependency) on 224x224 crops of the JPEG
workload, SGD, cross-entropy; on CUDA in bf16 autocast with channels-last inputs. Each contender
runs in its own process, as in ``contenders.py``, and prints one JSON line: images/s, the share of
the wall time the loop waited for its next batch (starvation), and the main process's CPU. A loop
that waits for nothing runs at the synthetic rate; feedline's target is within 5 % of it where the
decode rate allows. ``--model tiny`` (a narrow, shallow ResNet) lets the CPU-only tests run the path.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.transforms import RandomResizedCrop
from .contenders import TarShards
from .samples import Convert

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


class Bottleneck(nn.Module):
    """ResNet's bottleneck block (1x1, 3x3, 1x1 convolutions and a shortcut), as torchvision's ResNet-50 v1.5."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = (nn.Identity() if stride == 1 and cin == cout else
                      nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.short(x), inplace=True)


def resnet(blocks: tuple[int, ...] = (3, 4, 6, 3), base: int = 64, classes: int = 1000) -> nn.Module:
    """ResNet-50 with the defaults; ``tiny`` is ``resnet((1, 1, 1, 1), 8, classes)``."""
    layers: list[nn.Module] = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = base
    for i, n in enumerate(blocks):
        for j in range(n):
            layers.append(Bottleneck(cin, base * 2 ** i, 2 if j == 0 and i > 0 else 1))
            cin = base * 2 ** i * Bottleneck.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def _feed(args: argparse.Namespace, device: torch.device) -> Iterable[dict[str, Any]]:
    shards = sorted(glob.glob(args.shards))
    if args.feed == "feedline":
        from ..api.staging_loader import StagingLoader

        extra: dict[str, Any] = ({"device_decode": {"fields": ["jpg"], "size": args.image_size}}
                                 if args.device_decode else
                                 {"spec": {"jpg": ("uint8", (args.image_size, args.image_size, 3)), "cls": "int64"},
                                  "transform": RandomResizedCrop(args.image_size, fields=["jpg"])})
        return StagingLoader(shards, fields=["jpg", "cls"], batch_size=args.batch_size, workers=args.workers,
                             device=str(device), shuffle=False, **extra)
    if args.feed == "dataloader":
        return torch.utils.data.DataLoader(TarShards(shards, Convert("jpeg", args.image_size)),
                                           batch_size=args.batch_size, num_workers=args.workers,
                                           pin_memory=device.type == "cuda", persistent_workers=True,
                                           prefetch_factor=4, multiprocessing_context="spawn", drop_last=True)
    return _Synthetic(args.batch_size, args.image_size, device)


class _Synthetic:
    """One batch made on the device, handed out forever: the ceiling of the step."""

    def __init__(self, batch: int, size: int, device: torch.device):
        g = torch.Generator(device="cpu").manual_seed(0)
        self.batch = {"jpg": torch.randint(0, 256, (batch, size, size, 3), generator=g, dtype=torch.uint8).to(device),
                      "cls": torch.randint(0, 10, (batch,), generator=g).to(device)}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            yield self.batch


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = (resnet() if args.model == "resnet50" else resnet((1, 1, 1, 1), 8, 10)).to(device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    classes = 1000 if args.model == "resnet50" else 10
    feed = _feed(args, device)
    it = iter(feed)
    images, waited, t0, cpu0 = 0, 0.0, 0.0, 0.0
    try:
        for step in range(args.warmup + args.steps):
            if step == args.warmup:  # the clock starts once the pipeline and the kernels are warm
                if cuda:
                    torch.cuda.synchronize()
                images, waited, t0, cpu0 = 0, 0.0, time.perf_counter(), time.process_time()
            asked = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:  # an epoch ended: the next one
                it = iter(feed)
                batch = next(it)
            waited += time.perf_counter() - asked
            x, y = batch["jpg"], batch["cls"]
            if x.device != device:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = ((x.permute(0, 3, 1, 2).float() - mean) / std).contiguous(
                memory_format=torch.channels_last if cuda else torch.contiguous_format)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = F.cross_entropy(model(x), y.long() % classes)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            images += int(y.shape[0])
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        close = getattr(feed, "close", None)
        if close is not None:
            close()
    return {"feed": args.feed, "model": args.model, "device": str(device), "steps": args.steps,
            "batch_size": args.batch_size, "samples_per_s": images / wall, "starvation": waited / wall,
            "main_cpu_pct": 100.0 * cpu / wall, "device_decode": bool(args.device_decode)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("feed", choices=("feedline", "dataloader", "synthetic"))
    p.add_argument("--shards", default="", help="a glob of the JPEG workload's shards")
    p.add_argument("--model", choices=("resnet50", "tiny"), default="resnet50")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=50, help="timed steps, after --warmup")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device-decode", action="store_true", help="feedline: decode the JPEGs on the device")
    args = p.parse_args(argv)
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
