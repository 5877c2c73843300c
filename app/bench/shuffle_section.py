"""The "shuffle quality" section: loaders side by side on a dataset written in class order (issue 50).

100 classes x 200 samples, written in class order in tar shards of 1000 (what packing a folder per class in sorted
order gives); every sample's label is its written position, so one epoch's delivered labels give both the classes
of each batch (position // 200) and the order. Each contender reads one epoch with its own shuffle on; the figures
(``shuffle_quality.py``) and its samples/s over that epoch go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..formats.shard_index import build_index, write_index
from .shuffle_quality import measure

CLASSES, PER_CLASS, PER_SHARD = 100, 200, 1000
PAYLOAD = 64  # bytes of each sample's `bin`: the order is measured, not the decode
ROWS = {"feedline": "feedline (default: the epoch, by blocks)", "feedline-stream": 'feedline shuffle="stream"',
        "webdataset": "webdataset (shardshuffle=100, .shuffle(1000))", "mosaic": "Mosaic Streaming (shuffle=True)",
        "litdata": "LitData (shuffle=True)"}


def _sorted_dataset(cache_dir: str) -> str:
    """The class-sorted tar shards, written once: sample n holds `cls` = n (its written position)."""
    out = os.path.join(cache_dir, "bench", f"sorted-{CLASSES}x{PER_CLASS}")
    if os.path.exists(os.path.join(out, "complete")):
        return out
    os.makedirs(out, exist_ok=True)
    total = CLASSES * PER_CLASS
    for k in range(total // PER_SHARD):
        path = os.path.join(out, f"sorted-{k:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            for n in range(k * PER_SHARD, (k + 1) * PER_SHARD):
                for ext, data in (("bin", bytes([n % 256]) * PAYLOAD), ("cls", str(n).encode())):
                    info = tarfile.TarInfo(f"s{n:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        write_index(build_index(path))
    open(os.path.join(out, "complete"), "w").close()
    return out


@dataclass(frozen=True)
class Runners:
    """How the bench runs a contender process and the peers' (``runner.py``'s, handed in: it imports this)."""

    contender: Callable[..., dict[str, Any]]
    peer_contender: Callable[..., dict[str, Any]]
    peer_formats: Callable[[str, str, str], None]
    peers_python: Callable[[argparse.Namespace], str | None]


def shuffle_workload(args: argparse.Namespace, shm_root: str, runners: Runners) -> dict[str, Any]:
    """One epoch of each contender over the class-sorted shards, its order measured."""
    _contender, _peer_contender = runners.contender, runners.peer_contender
    src = _sorted_dataset(args.cache_dir)
    python = runners.peers_python(args)
    if python:
        runners.peer_formats(src, "raw", python)
    dst = os.path.join(shm_root, "sorted")
    shutil.copytree(src, dst)
    shards = os.path.join(dst, "*.tar")
    common = ("--report-order", "--sample-bytes", str(PAYLOAD))
    runs = {"feedline": lambda: _contender("feedline", "raw", shards, args, "--shuffle", "epoch", *common),
            "feedline-stream": lambda: _contender("feedline", "raw", shards, args, "--shuffle", "stream", *common),
            "webdataset": lambda: _contender("webdataset", "raw", shards, args, "--shuffle", "epoch", *common)}
    if python:
        for peer in ("mosaic", "litdata"):
            runs[peer] = (lambda p: lambda: _peer_contender(p, "raw", dst, args, python, None, "--shuffle", "epoch",
                                                            *common))(peer)
    labels = [n // PER_CLASS for n in range(CLASSES * PER_CLASS)]
    rows = []
    try:
        for name, run in runs.items():
            result = run()
            batches = result["order"]
            q = measure([[p // PER_CLASS for p in b] for b in batches], [p for b in batches for p in b], labels,
                        args.batch_size)
            seen = sorted(p for b in batches for p in b)
            rows.append({"label": ROWS[name], "distinct": q.distinct, "uniform": q.uniform_distinct,
                         "largest_share": q.largest_share, "spearman": q.spearman,
                         "samples_per_s": result["samples_per_s"], "complete": seen == list(range(len(labels)))})
    finally:
        shutil.rmtree(dst, ignore_errors=True)
    return {"classes": CLASSES, "per_class": PER_CLASS, "per_shard": PER_SHARD, "batch_size": args.batch_size,
            "workers": args.workers, "rows": rows}


def markdown_lines(section: dict[str, Any]) -> list[str]:
    """The section's table in docs/benchmarks.md."""
    s = section
    lines = [f"### Shuffle quality ({s['classes']} classes x {s['per_class']} samples written in class order, "
             f"shards of {s['per_shard']}; one epoch, batch {s['batch_size']}, {s['workers']} workers)", "",
             "| loader | distinct classes a batch (uniform shuffle) | largest class share a batch | Spearman, "
             "delivery vs written | samples/s (one epoch) | every sample once |", "|---|---:|---:|---:|---:|---|"]
    for r in s["rows"]:
        lines.append(f"| {r['label']} | {r['distinct']:.1f} ({r['uniform']:.1f}, {r['distinct'] / r['uniform']:.0%}) "
                     f"| {r['largest_share']:.2f} | {r['spearman']:+.2f} | {r['samples_per_s']:.0f} | "
                     f"{'yes' if r['complete'] else '**no**'} |")
    lines += ["", "Each loader with its own shuffle on, as its documentation shows it; 64-byte samples, so the "
                  "samples/s is the order's cost, not a decode's (the raw and JPEG sections measure those).", ""]
    return lines
