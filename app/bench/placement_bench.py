"""The CPU stand-in of a GPU host's launch-bound step beside a loader decoding at full tilt, placed or not:
``python -m feedline.bench.placement_bench ROW ...`` (one process a row; ``placement_section.py`` runs them).

The step is ``launch.py``'s: a chain of tiny torch operations on one thread, about 8 ms, what a small model's
kernel launches are on a GPU. ``alone`` times it with no loader in the process. ``beside`` times it back to
back while a loader decodes JPEG photos and crops them (RandomResizedCrop 224) as fast as its workers can,
feeding the stand-in device (the CUDA path's code on this CPU: a GPU host's loader, which auto places), its
batches taken by a thread and dropped (``drain.py``): the step is bound by its one thread, so whatever takes
that thread's core (a worker scheduled there, the loader's threads, a cache it shares) slows it by the share it
takes, and the step time says so, with no wait for data in it. ``fed`` takes a batch before each step, as a
training loop does (the step still runs on a fixed input, so it does the same work in every row): on a host
whose workers cannot keep up, each step then follows a wait, and the share of time waiting is reported.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from .drain import Drain
from .launch import calibrate, make_step

IMAGE = 224


def _loader(args: argparse.Namespace) -> Any:
    from ..api.staging_loader import StagingLoader
    from ..formats.transforms import RandomResizedCrop

    workers: int | str = "auto" if args.workers == "auto" else int(args.workers)
    return StagingLoader(sorted(glob.glob(args.shards)), batch_size=args.batch_size, workers=workers,
                         spec={"jpg": ("uint8", (IMAGE, IMAGE, 3)), "cls": "int64"}, drop_last=True,
                         transform=RandomResizedCrop(IMAGE, fields=["jpg"]), cpu_placement=args.cpu_placement,
                         device="standin")  # a GPU host's loader, on this CPU: what auto places


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # the step's ops on one thread, as a launching thread issues them
    step = make_step(args.ops, torch.device("cpu"))
    x = torch.rand(args.batch_size, 64)
    loader = _loader(args) if args.row != "alone" else None
    drain = Drain(loader) if args.row == "beside" else None
    batches = _endless(loader) if args.row == "fed" else None
    waited = 0.0
    try:
        for _ in range(args.warmup_steps):
            if batches is not None:
                next(batches)
            step(x)
        times: list[float] = []
        cost0 = loader.cost() if loader is not None else None
        t_start = time.perf_counter()
        t_end = t_start + args.seconds
        while time.perf_counter() < t_end:
            if batches is not None:
                w0 = time.perf_counter()
                next(batches)
                waited += time.perf_counter() - w0
            t0 = time.perf_counter()
            step(x)
            times.append(time.perf_counter() - t0)
        step_ms = statistics.median(times) * 1e3
        out: dict[str, Any] = {"row": args.row, "ops": args.ops, "steps": len(times), "step_ms": step_ms,
                               "samples_per_s": args.batch_size * 1e3 / step_ms,  # what the step alone runs at
                               "wait_share": waited / (waited + sum(times)) if times else 0.0}
        if loader is not None and cost0 is not None:
            spent, wall = loader.cost().since(cost0), time.perf_counter() - t_start
            # the training process's share of its cores spent by the loader: its threads, and the stand-in's copies
            # (on a GPU a copy engine's, here a memcpy on the thread that takes the batch: on the step's cores)
            out["loader_cpu_share"] = spent.cpu_total / wall
            out["standin_copy_share"] = spent.standin_seconds / wall
            out["workers"] = loader.workers
            out["placement"] = loader.placement.describe()
            out["trainer_cpus"] = list(loader.placement.trainer)
            out["process_cpus"] = sorted(os.sched_getaffinity(0))
        if drain is not None:
            out["batches_beside"] = drain.drained  # the loader did run at full tilt beside the step
        return out
    finally:
        if drain is not None:
            drain.close()
        elif loader is not None:
            loader.close()


def _endless(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("row", choices=("alone", "beside", "fed", "calibrate"))
    p.add_argument("--shards", default="")
    p.add_argument("--ops", type=int, default=0, help="the step's operations (0: calibrate to about 8 ms first)")
    p.add_argument("--workers", default="auto")
    p.add_argument("--cpu-placement", default="auto")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--warmup-steps", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.row == "calibrate" or not args.ops:
        args.ops = calibrate(torch.device("cpu"), args.batch_size)
        if args.row == "calibrate":
            print(json.dumps({"ops": args.ops}), flush=True)
            return
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
