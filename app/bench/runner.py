"""``feedline bench`` / ``scripts/bench``: every contender on the same shards in /dev/shm, in one run,
in interleaved rounds (``rounds.py``): medians and ranges, ratios as medians of per-round ratios.

Writes ``docs/benchmarks.json`` (merged per host, so a CPU run and a GPU run
both stay) and renders ``docs/benchmarks.md`` from it. Ratios, not absolute
numbers, are what carries between machines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ..api.config import parse_size
from .options import add_arguments  # noqa: F401 (the bench's options, where gpu_check finds them)
from .report import CEILING, SHARD_ORDER, STREAM_ORDER, render_markdown, targets
from .small import PACED, SMALL_BYTES, STANDIN_ROWS
from .sections import SECTIONS, keep_earlier_sections
from .shuffle_section import Runners, shuffle_workload
from .rounds import AGAINST_DRAFT, Contender, interleaved, split_against_draft
from .zygote import Zygote
from .contend import (
    FAST_ROWS,
    FILE_ROWS,
    PEER_ROWS,
    _PEER_DIRS,
    _contender,
    _cuda_copy_bandwidth,
    _dataset,
    _fast_python,
    _peer_contender,
    _peer_formats,
    _peers_python,
    _run_json,
    _venv_contender,
)

log = logging.getLogger("feedline.bench")

def _host_label() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda-{torch.cuda.get_device_name(0).replace(' ', '-')}"
    except ImportError:
        pass
    return f"cpu-{os.cpu_count()}core"


def _machine() -> dict[str, Any]:
    import PIL
    import torch

    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                            "pil": PIL.__version__, "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    results: dict[str, Any] = {"machine": _machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "settings": {"workers": args.workers, "batch_size": args.batch_size,
                                            "seconds": args.seconds, "rounds": args.rounds,
                                            "warmup": args.warmup, "quick": args.quick}, "workloads": {}}
    # made just before the try that removes it: a SIGTERM during _machine()'s imports (seconds on a loaded
    # machine) left it in /dev/shm when it was made first
    shm_root = tempfile.mkdtemp(prefix="feedline-bench-", dir=args.shm)
    try:
        with Zygote() if args.quick else contextlib.nullcontext():  # --quick: rows forked from one that has torch
            _run_workloads(args, workloads, results, shm_root)
        results["cuda_copy"] = _cuda_copy_bandwidth()
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    results["targets"] = targets(results, args.workers)
    return results


def _run_workloads(args: argparse.Namespace, workloads: list[str], results: dict[str, Any], shm_root: str) -> None:
    """Each workload's rows, and the sections of their own, into ``results``."""
    for workload in workloads:
        if workload in SECTIONS:  # a section of its own, not a loader workload's rows
            results[workload] = {"sampler": _sampler_workload, "distributed": _distributed_workload,
                                 "scaling": _scaling_workload, "e2e": _e2e_workload,
                                 "shuffle": _shuffle_workload, "launch": _launch_workload,
                                 "placement": _placement_workload,
                                 "remote": _remote_workload}[workload](args, shm_root)
            continue
        if workload == "small":  # 3x64x64 samples: the training process's share a batch (issue 60)
            src = _dataset("raw", args.small_samples, SMALL_BYTES, args.cache_dir)
        elif workload == "video":  # clips decoded in the workers (issue 61)
            src = _dataset("video", args.video_samples, 0, args.cache_dir)
        else:
            count = args.raw_samples if workload == "raw" else args.jpeg_samples // (2 if workload == "captioned"
                                                                                     else 1)
            src = _dataset(workload, count, parse_size(args.sample_size), args.cache_dir)
        peers = _peers_python(args) if workload in ("raw", "jpeg") else None
        if peers:
            _peer_formats(src, workload, peers)
        dst = os.path.join(shm_root, workload)
        shutil.copytree(src, dst, ignore=None if peers else _PEER_DIRS)
        shards = os.path.join(dst, "*.tar")
        rows = interleaved(_contenders(workload, shards, args, peers), args.rounds, args.seconds, args.warmup,
                           _at_once(args))
        results["workloads"][workload] = split_against_draft(rows)
        if workload == "jpeg" and not args.quick and shutil.which("valgrind"):  # issue 68: instructions
            from .bookkeeping import measure

            results["bookkeeping"] = measure(shards)
        shutil.rmtree(dst)


def _launch_workload(args: argparse.Namespace, shm_root: str) -> dict[str, Any]:
    from .launch_section import launch_workload

    src = _dataset("raw", args.small_samples, SMALL_BYTES, args.cache_dir)
    dst = os.path.join(shm_root, "launch")
    shutil.copytree(src, dst)
    try:
        return launch_workload(args, os.path.join(dst, "*.tar"), _run_json)
    finally:
        shutil.rmtree(dst)


def _placement_workload(args: argparse.Namespace, shm_root: str) -> dict[str, Any]:
    """Issue 69: a launch-bound step beside the loader decoding JPEG at full tilt, placed or not."""
    from .placement_section import placement_workload

    return _on_jpeg(args, shm_root, "placement", placement_workload)


def _on_jpeg(args: argparse.Namespace, shm_root: str, name: str,
             section: Callable[[argparse.Namespace, str, Callable[..., dict[str, Any]]], dict[str, Any]]
             ) -> dict[str, Any]:
    """A section run on a copy of the JPEG dataset in /dev/shm (its tar shards only), removed after it."""
    src = _dataset("jpeg", args.jpeg_samples, parse_size(args.sample_size), args.cache_dir)
    dst = os.path.join(shm_root, name)
    shutil.copytree(src, dst, ignore=_PEER_DIRS)
    try:
        return section(args, os.path.join(dst, "*.tar"), _run_json)
    finally:
        shutil.rmtree(dst)


def _remote_workload(args: argparse.Namespace, shm_root: str) -> dict[str, Any]:
    """Issue 70: JPEG decoded on the GPU node's CPU, and on a Ray node's beside it."""
    from .remote_section import remote_workload

    return _on_jpeg(args, shm_root, "remote", remote_workload)


def _shuffle_workload(args: argparse.Namespace, shm_root: str) -> dict[str, Any]:
    return shuffle_workload(args, shm_root, Runners(_contender, _peer_contender, _peer_formats, _peers_python))


def _at_once(args: argparse.Namespace) -> int:
    """Contenders run side by side: two with --quick (a check, not a measurement), else one at a time."""
    return 2 if args.quick else 1


def _contenders(workload: str, shards: str, args: argparse.Namespace, peers: str | None = None) -> list[Contender]:
    """A workload's rows, in table order; ``peers``: .venv-peers's Python, for the peer loaders' rows (and
    feedline's on the TFRecord and Parquet files two of them read)."""
    def c(row: str, name: str, *extra: str, stock: bool = False, seconds: float | None = None) -> Contender:
        return Contender(row, lambda t: _contender(name, workload, shards, args, *extra, stock_pillow=stock, seconds=t),
                         seconds)

    def peer(name: str, python: str) -> Contender:
        root = os.path.dirname(shards)
        return Contender(PEER_ROWS[name], lambda t: _peer_contender(name, workload, root, args, python, seconds=t))

    def files(name: str) -> Contender:  # feedline on a peer's TFRecord or Parquet files, as they are
        row, pattern = FILE_ROWS[name]
        glob_ = os.path.join(os.path.dirname(shards), name, pattern)
        return Contender(row, lambda t: _contender("feedline", workload, glob_, args, "--zero-copy", seconds=t))

    others = [peer(name, peers) for name in PEER_ROWS] if peers else []
    fast = _fast_python(args) if workload in ("raw", "jpeg") else None
    if fast:  # DALI's CPU pipeline and SPDL on the same tar shards, as many threads as the rows have workers
        others += [Contender(row, lambda t, name=name: _venv_contender(name, workload, shards, args, fast, seconds=t))
                   for name, row in FAST_ROWS.items()]
    feedline = [c("feedline (zero-copy)", "feedline", "--zero-copy"), c("feedline (copy)", "feedline")]
    if peers:
        feedline += [files(name) for name in FILE_ROWS]
    if workload in ("raw", "jpeg"):  # the order before issue 50's default, for its "within 5 %" target
        feedline += [c(SHARD_ORDER, "feedline", "--zero-copy", "--shuffle", "none"),
                     c(STREAM_ORDER, "feedline", "--zero-copy", "--shuffle", "stream")]
    if workload == "raw":
        return feedline + [c("DataLoader", "dataloader"), c("webdataset + DataLoader", "webdataset"), *others]
    if workload == "video":
        from .video_bench import BATCH, SWSCALE_ROW

        batch = ("--batch-size", str(BATCH))
        return [c("feedline (zero-copy)", "feedline", "--zero-copy", *batch), c("feedline (copy)", "feedline", *batch),
                c("DataLoader (PyAV in __getitem__)", "dataloader", *batch),
                c(SWSCALE_ROW, "dataloader", *batch, "--video-swscale"),
                c("webdataset + DataLoader (read_video's whole-video decode)", "webdataset", *batch),
                c("1 core, VideoClip", "single-core", seconds=min(args.seconds, 5.0))]
    if workload == "small":
        small = ("--sample-bytes", str(SMALL_BYTES))
        return [c("feedline (zero-copy)", "feedline", "--zero-copy", *small), c("feedline (copy)", "feedline", *small),
                *[c(row, "feedline", "--zero-copy", *small, "--steps-per-s", str(rate)) for rate, row in PACED.items()],
                *[c(row, "feedline", *small, "--device", "standin", *extra) for row, extra in STANDIN_ROWS.items()],
                c("DataLoader", "dataloader", *small)]
    if workload == "captioned":
        return feedline + [c("webdataset + DataLoader", "webdataset"),
                           c("DataLoader + hand-written collate", "dataloader")]
    single = min(args.seconds, 5.0)
    import torch

    feedline.append(c("feedline (two-source mix)", "feedline", "--zero-copy", "--mix"))  # issue 25's row
    if torch.cuda.is_available():  # the workers copy compressed bytes; the GPU decodes (item 6 of issue 15)
        feedline.append(c("feedline (GPU decode)", "feedline", "--zero-copy", "--device-decode"))
    return feedline + [c("DataLoader + stock Pillow", "dataloader", stock=True),
                       c("DataLoader + pillow-simd", "dataloader"),
                       c("webdataset + DataLoader (stock Pillow)", "webdataset", stock=True), *others,
                       c(AGAINST_DRAFT, "single-core", "--against-draft", seconds=single),
                       c("1 core, stock Pillow, no draft", "single-core", "--no-draft", stock=True, seconds=single)]


def _scaling_workload(args: argparse.Namespace, shm_root: str) -> dict[str, Any]:
    """JPEG decode at 1, 2, 4, 8 and cores - 2 workers (as many as this machine has) against one core's rate."""
    cpus = len(os.sched_getaffinity(0))
    counts = sorted({w for w in (1, 2, 4, 8, cpus - 2) if 1 <= w <= cpus})
    src = _dataset("jpeg", args.jpeg_samples, parse_size(args.sample_size), args.cache_dir)
    dst = os.path.join(shm_root, "scaling")
    shutil.copytree(src, dst, ignore=_PEER_DIRS)
    shards = os.path.join(dst, "*.tar")

    def feedline(w: int) -> Contender:
        return Contender(f"{w} workers", lambda t: _contender("feedline", "jpeg", shards, args, "--zero-copy",
                                                              "--workers", str(w), seconds=t))

    single = Contender("1 core, crop decoder", lambda t: _contender("single-core", "jpeg", shards, args,
                                                                    "--crop-decoder", seconds=t),
                       min(args.seconds, 5.0))  # what each worker runs
    try:
        rows = interleaved([feedline(w) for w in counts] + [single], args.rounds, args.seconds, args.warmup,
                           _at_once(args))
    finally:
        shutil.rmtree(dst)
    return {"cpus": cpus, "workers": counts, "rows": rows}


def _e2e_workload(args: argparse.Namespace, shm_root: str) -> dict[str, Any]:
    """A training step fed by synthetic data on the device (the ceiling), feedline and DataLoader (``e2e.py``)."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and args.e2e_model != "tiny":
        print("  e2e: skipped (no CUDA device: ResNet-50 on a CPU measures the CPU, not the loader)", file=sys.stderr,
              flush=True)
        return {"skipped": "no CUDA device"}
    src = _dataset("jpeg", args.jpeg_samples, parse_size(args.sample_size), args.cache_dir)
    dst = os.path.join(shm_root, "e2e")
    shutil.copytree(src, dst, ignore=_PEER_DIRS)
    shards = os.path.join(dst, "*.tar")
    steps, warm = (3, 1) if args.quick else (args.e2e_steps, 10)
    size = 224 if args.e2e_model == "resnet50" else 32

    def c(row: str, feed: str, *extra: str) -> Contender:
        cmd = [sys.executable, "-m", "feedline.bench.e2e", feed, "--shards", shards, "--model", args.e2e_model,
               "--workers", str(args.workers), "--batch-size", str(args.e2e_batch_size), "--steps", str(steps),
               "--warmup", str(warm), "--image-size", str(size), *extra]
        return Contender(row, lambda t: _run_json(cmd, dict(os.environ), "e2e", " ".join([feed, *extra])))

    rows = [c(CEILING, "synthetic"), c("feedline", "feedline"), c("DataLoader + pillow-simd", "dataloader")]
    if cuda:  # the compressed bytes in the ring, decoded on the GPU
        rows.insert(2, c("feedline (GPU decode)", "feedline", "--device-decode"))
    try:
        out = interleaved(rows, args.rounds, args.seconds, 0.0 if args.quick else args.warmup, _at_once(args))
    finally:
        shutil.rmtree(dst)
    return {"model": args.e2e_model, "batch_size": args.e2e_batch_size, "steps": steps, "rows": out}


def _sampler_workload(args: argparse.Namespace, shm_root: str) -> dict[str, Any]:
    from .sampler_bench import FILL_REPS, cloud_fill_rates, fill_rate, s3_fill_rate, train_while_filling

    print("  sampler: fill rate from a loopback HTTP store, sidecar vs curl ...", file=sys.stderr, flush=True)
    raw = _dataset("raw", args.raw_samples, parse_size(args.sample_size), args.cache_dir)
    reps = 1 if args.quick else 3
    fill = fill_rate(raw, os.path.join(shm_root, "fill-rate"), reps=1 if args.quick else FILL_REPS)
    print(f"        sidecar {fill['sampler_gb_per_s']:.2f} GB/s, curl {fill['curl_gb_per_s']:.2f} GB/s, urllib "
          f"{fill['urllib_gb_per_s']:.2f} GB/s", file=sys.stderr, flush=True)
    jpeg = _dataset("jpeg", args.jpeg_samples, parse_size(args.sample_size), args.cache_dir)
    work = os.path.join(shm_root, "train-while-filling")
    os.makedirs(work)

    def contender(*extra: str) -> dict[str, Any]:
        return _contender("feedline", "jpeg", "unused", args, "--zero-copy", *extra)

    training = train_while_filling(jpeg, work, contender, args.seconds, rounds=reps)
    shutil.rmtree(work)
    print("  sampler: fill rate from a local S3 server (moto), sidecar vs boto3 ...", file=sys.stderr, flush=True)
    s3 = s3_fill_rate(raw, os.path.join(shm_root, "fill-rate"), reps=reps)
    print(f"        sidecar {s3['sampler_mb_per_s']:.0f} MB/s, boto3 {s3['boto3_mb_per_s']:.0f} MB/s", file=sys.stderr)
    return {"fill": fill, "s3": s3, **cloud_fill_rates(raw, os.path.join(shm_root, "fill-rate"), reps),
            "training": training}


def _distributed_workload(args: argparse.Namespace, shm_root: str) -> dict[str, Any]:
    from .dist_bench import train_nodes

    # small shards even for a tiny run: 2 nodes x 2 ranks need at least 4
    data = _dataset("jpeg", args.jpeg_samples, parse_size(args.sample_size), args.cache_dir, min_shard=64 << 10)
    out = {}
    for nodes, nproc in ((1, 4), (2, 2)):
        print(f"  distributed: {nodes} node(s) x {nproc} ranks (scripts/two-nodes) ...", file=sys.stderr, flush=True)
        out[f"{nodes}x{nproc}"] = row = train_nodes(data, os.path.join(shm_root, f"nodes-{nodes}"), nodes, nproc)
        print(f"        {row['samples_per_s']:9.1f} samples/s", file=sys.stderr, flush=True)
    return out


def _stopped(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "what", "loaders") == "scale":  # `feedline bench scale`: the scale simulation (issue 71)
        from .scale.command import main as scale_main

        return scale_main(args)
    if args.quick:
        args.rounds, args.warmup, args.seconds = 1, 0.0, min(args.seconds, 1.0)
    if args.rounds < 1:
        raise ValueError("--rounds must be at least 1")
    # SIGTERM (a job's timeout, kill) unwinds as Ctrl-C does: the running contender is killed (subprocess.run) and
    # the samples in /dev/shm removed (run_bench's finally); unhandled, it left a gigabyte there
    signal.signal(signal.SIGTERM, _stopped)
    results = run_bench(args)
    host = args.host or _host_label()
    doc: dict[str, Any] = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            doc = json.load(f)
    results = keep_earlier_sections(doc.get(host), results, args.workers)
    doc[host] = results
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=2)
    with open(args.markdown, "w") as f:
        f.write(render_markdown(doc))
    print(render_markdown({host: results}))
    return 0
