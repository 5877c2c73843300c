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
from .drain import Drain
from .pyspy import TIMING
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


def _loader(args: argparse.Namespace, device: str) -> Any:
    from ..api.staging_loader import StagingLoader

    if args.device == "standin" and device != "cpu":  # a rehearsal without CUDA: the device path on the stand-in
        device = "standin"
    threads = {} if args.transfer_threads is None else {"transfer_threads": args.transfer_threads}
    extra: dict[str, Any] = ({"device_decode": {"fields": ["jpg"], "size": args.image_size}}
                             if args.device_decode else
                             {"spec": {"jpg": ("uint8", (args.image_size, args.image_size, 3)), "cls": "int64"},
                              "transform": RandomResizedCrop(args.image_size, fields=["jpg"])})
    return StagingLoader(sorted(glob.glob(args.shards)), fields=["jpg", "cls"], batch_size=args.batch_size,
                         workers=args.workers, device=device, shuffle=False, drop_last=args.drop_last, h2d=args.h2d,
                         cpu_placement=args.cpu_placement, **threads, **extra)


def _feed(args: argparse.Namespace, device: torch.device) -> Iterable[dict[str, Any]]:
    if args.feed == "feedline":
        return _loader(args, "standin" if args.device == "standin" else str(device))
    if args.feed == "feedline-host":  # a diagnosis: host batches copied by the loop (pageable: a CPU loader's ring)
        return _loader(args, "cpu")
    if args.feed == "synthetic-beside":  # a diagnosis: the ceiling's step with a loader running in the process
        return _Beside(_Synthetic(args.batch_size, args.image_size, device),
                       _loader(args, "standin" if args.device == "standin" else str(device)))
    if args.feed == "dataloader":
        return torch.utils.data.DataLoader(TarShards(sorted(glob.glob(args.shards)), Convert("jpeg", args.image_size)),
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


class _Beside:
    """The synthetic batches, while the loader runs beside them at full tilt (``drain.py``): does the loader's mere
    running (its threads, streams, copies) slow the step, or only using its tensors?"""

    def __init__(self, synthetic: _Synthetic, loader: Any):
        self.synthetic, self.loader, self.drain = synthetic, loader, Drain(loader)

    @property
    def drained(self) -> int:
        return self.drain.drained

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.synthetic)

    def stats(self) -> Any:
        return self.loader.stats()

    def cost(self) -> Any:
        return self.loader.cost()

    def close(self) -> None:
        self.drain.close()


def _trace(step: Any, steps: int, cuda: bool) -> dict[str, Any]:
    """``steps`` more steps under torch's profiler: the device's own time a step (on CUDA: kernels and copies)
    against the wall time a step, and the kernels that took it. Equal device time and a longer wall: the GPU
    waited (for the CPU, or a sync); a longer device time: the kernels themselves ran slower."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = time.perf_counter() - t0
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if getattr(e, "device_type", kind) == kind]

    def own_us(e: Any) -> float:
        if not cuda:
            return float(e.self_cpu_time_total)
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0))

    events.sort(key=own_us, reverse=True)
    return {"steps": steps, "wall_ms_per_step": 1000 * wall / steps,
            "device_ms_per_step": sum(map(own_us, events)) / 1000 / steps,
            "top": [[e.key[:80], round(own_us(e) / 1000 / steps, 3), e.count // steps] for e in events[:8]]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.switch_interval:  # a diagnosis: how often the interpreter hands the GIL between threads
        sys.setswitchinterval(args.switch_interval)
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
    waited = 0.0

    def step() -> int:
        nonlocal it, waited
        asked = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:  # an epoch ended: the next one
            it = iter(feed)
            batch = next(it, None)
            if batch is None:  # DataLoader's workers each drop their last partial batch
                raise SystemExit(f"e2e: an epoch of {args.feed} gave no batch: {args.workers} workers need "
                                 f"{args.batch_size} samples each, in their own shards (more samples, or fewer "
                                 f"workers)") from None
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
        return int(y.shape[0])

    out: dict[str, Any] = {"feed": args.feed, "model": args.model, "device": str(device), "steps": args.steps,
                           "batch_size": args.batch_size, "device_decode": bool(args.device_decode)}
    try:
        for _ in range(args.warmup):
            step()
        if cuda:  # the clock starts once the pipeline and the kernels are warm
            torch.cuda.synchronize()
        print(TIMING, file=sys.stderr, flush=True)  # gpu-check's py-spy profile starts here
        loader = feed if hasattr(feed, "stats") else None  # feedline's own feeds: the GPU's wait for its copies
        gpu_wait0 = loader.stats().h2d_wait_seconds_total if loader is not None else 0.0
        cost0 = loader.cost() if loader is not None else None
        images, waited, t0, cpu0 = 0, 0.0, time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            images += step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        out.update(samples_per_s=images / wall, starvation=waited / wall, main_cpu_pct=100.0 * cpu / wall)
        if loader is not None and cuda:  # a share of the wall the host's starvation cannot see
            out["gpu_copy_wait"] = (loader.stats().h2d_wait_seconds_total - gpu_wait0) / wall
        if cost0 is not None:  # the training process's share a batch: the budget's counters (cost.py)
            out["cost"] = {k: round(v, 6) for k, v in loader.cost().since(cost0).per_batch().items()}
        if isinstance(feed, _Beside):
            out["beside_batches"] = feed.drained  # the loader beside did run
        if args.trace_steps:
            out["trace"] = _trace(step, args.trace_steps, cuda)
    finally:
        close = getattr(feed, "close", None)
        if close is not None:
            close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("feed", choices=("feedline", "dataloader", "synthetic", "feedline-host", "synthetic-beside"),
                   help="feedline-host and synthetic-beside: gpu-check's diagnosis of a missed e2e target")
    p.add_argument("--shards", default="", help="a glob of the JPEG workload's shards")
    p.add_argument("--model", choices=("resnet50", "tiny"), default="resnet50")
    p.add_argument("--workers", type=lambda v: v if v == "auto" else int(v), default=4, help="a count, or auto")
    p.add_argument("--cpu-placement", default="auto", help="feedline: auto, off, or trainer=...;workers=...")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=50, help="timed steps, after --warmup")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device-decode", action="store_true", help="feedline: decode the JPEGs on the device")
    p.add_argument("--drop-last", action="store_true", help="feedline: no partial batch (no new shape at an epoch's end)")
    p.add_argument("--transfer-threads", type=int, default=None, help="feedline: (default: the loader's)")
    p.add_argument("--h2d", choices=("slot", "fields"), default="slot", help="feedline: how batches go to the device")
    p.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval (0: Python's, 5 ms)")
    p.add_argument("--device", choices=("auto", "standin"), default="auto",
                   help="feedline without CUDA: standin runs the device path on the CPU (a rehearsal)")
    p.add_argument("--trace-steps", type=int, default=0, help="after the timed steps, this many more under torch's "
                   "profiler (the device's own time a step against the wall's)")
    args = p.parse_args(argv)
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
