"""A launch-bound training step fed by a loader, against the same step on one fixed batch:
``python -m feedline.bench.launch MODE ...`` (one process a row; ``launch_section.py`` runs the rows).

On a GPU a small model's step is bound by the thread that launches its kernels: a few hundred small torch
operations with a little Python between them, every one dropping and retaking the GIL. Whatever a loader
runs in the training process — a thread woken per batch, work inside ``next()`` — slows that thread though
no batch is ever late; the starvation figure cannot show it. This row measures it on any machine: the step
is a chain of tiny torch operations on the CPU (``--ops`` of them, about 8 ms), timed alone, step by step, in
turns of a quarter second: on the loader's batches, then on one fixed batch made once, and so on, in one
process, so that both see the same machine (its other tenants, its clock). Both time only the step. On a
2-core host the workers also compete with it for the cores: read it beside the training process's CPU a
batch, which this prints too.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

TARGET_MS = 8.0  # the step's length: a launch-bound ResNet-50 step at batch 32 on an H100 took about 8 ms


def make_step(ops: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A step of ``ops`` tiny torch operations on a (batch, 64) input, with a little Python between them."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(64, 64, generator=gen) * 0.1).to(device) for _ in range(4)]

    def step(x: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(max(1, ops // 4)):
            h = torch.tanh(h @ weights[i % 4])
            h = h * 0.5 + 0.01
            if i % 8 == 7:  # the Python a model's forward has between its layers
                h = h.clamp(-3.0, 3.0)
        return h

    return step


def as_input(batch: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The step's input from a batch: its first 64 bytes a sample, as floats on ``device``."""
    data = batch["bin"]
    return data[:, :64].to(device, non_blocking=True).float() / 255.0


def calibrate(device: torch.device, batch_size: int, target_ms: float = TARGET_MS) -> int:
    """The number of operations that makes the step take about ``target_ms`` here."""
    x = torch.rand(batch_size, 64, device=device)
    ops = 64
    for _ in range(6):
        step = make_step(ops, device)
        step(x)
        t0 = time.perf_counter()
        for _ in range(5):
            step(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 5 * 1e3
        ops = max(8, int(ops * target_ms / max(ms, 1e-3)))
    return ops


TURN = 0.25  # seconds of steps on one feed before the other's turn


def _batches(args: argparse.Namespace) -> tuple[Iterator[dict[str, Any]], Any]:
    """The batches of MODE, endlessly, and the loader."""
    shards = sorted(glob.glob(args.shards))
    if args.mode == "dataloader":
        from .contenders import TarShards
        from .samples import Convert

        loader: Any = torch.utils.data.DataLoader(
            TarShards(shards, Convert("raw", 224)), batch_size=args.batch_size, num_workers=args.workers,
            pin_memory=torch.cuda.is_available(), persistent_workers=True, prefetch_factor=4,
            multiprocessing_context="spawn", drop_last=True)
    else:
        from ..api.staging_loader import StagingLoader

        device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        threads = {} if args.transfer_threads is None else {"transfer_threads": args.transfer_threads}
        loader = StagingLoader(shards, batch_size=args.batch_size, workers=args.workers, device=device,
                               zero_copy=True, drop_last=True, h2d=args.h2d, **threads,
                               spec={"bin": ("uint8", (args.sample_bytes,)), "cls": "int64"})

    def endless() -> Iterator[dict[str, Any]]:
        while True:
            yield from loader

    return endless(), loader


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # the step's ops on one thread, as a launching thread issues them
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    step = make_step(args.ops, device)
    batches, loader = _batches(args)
    sync = torch.cuda.current_stream().synchronize if device.type == "cuda" else (lambda: None)
    fixed = as_input({"bin": torch.randint(0, 255, (args.batch_size, 64), dtype=torch.uint8)}, device)
    for _ in range(args.warmup_steps):  # the loader and the kernels warm
        step(as_input(next(batches), device))
        step(fixed)
    sync()
    times: dict[bool, list[float]] = {True: [], False: []}  # fed: the loader's batches; else the fixed batch
    cost_before = loader.cost() if hasattr(loader, "cost") else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    deadline = wall0 + args.seconds
    fed = True
    while time.perf_counter() < deadline or not times[False]:
        turn_end = time.perf_counter() + TURN
        while time.perf_counter() < turn_end:
            x = as_input(next(batches), device) if fed else fixed
            t0 = time.perf_counter()
            step(x)
            sync()
            times[fed].append(time.perf_counter() - t0)
        fed = not fed
    step_ms, fixed_ms = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
    out: dict[str, Any] = {"mode": args.mode, "ops": args.ops, "steps": len(times[True]), "step_ms": step_ms,
                           "fixed_step_ms": fixed_ms, "speed": fixed_ms / step_ms,
                           "samples_per_s": args.batch_size * 1e3 / step_ms,  # what the step alone would run at
                           "process_cpu_pct": 100.0 * (time.process_time() - cpu0) / (time.perf_counter() - wall0)}
    if cost_before is not None:
        spent = loader.cost().since(cost_before).per_batch()
        out["trainer_ms_per_batch"] = spent["cpu_seconds"] * 1e3
        out["wakeups_per_batch"] = spent["wakeups"]
    if hasattr(loader, "close"):
        loader.close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("feedline", "dataloader", "calibrate"))
    p.add_argument("--shards", default="")
    p.add_argument("--ops", type=int, default=0, help="the step's operations (0: calibrate to about 8 ms first)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sample-bytes", type=int, default=3 * 64 * 64)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "standin"), default="auto")
    p.add_argument("--transfer-threads", type=int, default=None)
    p.add_argument("--h2d", choices=("slot", "fields"), default="slot")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.mode == "calibrate" or not args.ops:
        args.ops = calibrate(device, args.batch_size)
        if args.mode == "calibrate":
            print(json.dumps({"ops": args.ops}), flush=True)
            return
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
