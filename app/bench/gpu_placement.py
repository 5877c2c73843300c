"""``scripts/gpu-check``'s ``placement`` section (issue 69): the rows that tell apart where a fed ResNet-50 step
loses to the same step on synthetic data, at batch 256, and the machine's CPU topology.

- synthetic data alone (the ceiling);
- synthetic data with the loader running beside it at full tilt, its batches drained by a thread and dropped:
  contention alone (the loader's processes and threads, not its data), unplaced and placed;
- feedline feeding the step, unplaced and placed, at 4, 8 and 12 workers (as many as the CPUs allow), and placed
  with ``workers="auto"`` (the defaults a user gets);
- ``DataLoader`` (pinned, ``non_blocking``) with the e2e workers.

Each row is one process of ``e2e.py``, once (a GPU is lent for minutes). The topology is what the loader reads
(``cpus/host.py``: CPUs, cores, threads a core, NUMA nodes, quota), with ``lscpu``'s model and the clock
``/proc/cpuinfo`` gives while the placed auto row runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from .rounds import Contender, interleaved, ratio

CEILING = "synthetic, on the device (the ceiling)"
BESIDE = "synthetic, the loader beside it at full tilt"
COST = 300  # seconds on an H100 host: eleven e2e processes at batch 256, once each


def rows(cpus: int, e2e_workers: int) -> dict[str, tuple[str, ...]]:
    """Row name -> the e2e command's arguments (feed first)."""
    counts = [w for w in (4, 8, 12) if w <= max(1, cpus - 2)] or [max(1, cpus - 2)]
    out: dict[str, tuple[str, ...]] = {CEILING: ("synthetic",)}
    for how in ("off", "auto"):
        word = "unplaced" if how == "off" else "placed"
        out[f"{BESIDE}, {word}"] = ("synthetic-beside", "--workers", str(e2e_workers), "--cpu-placement", how)
    for how in ("off", "auto"):
        word = "unplaced" if how == "off" else "placed"
        for w in counts:
            out[f"feedline, {word}, {w} workers"] = ("feedline", "--workers", str(w), "--cpu-placement", how)
    out['feedline, placed, workers="auto" (the defaults)'] = ("feedline", "--workers", "auto", "--cpu-placement",
                                                              "auto")
    out["DataLoader (pinned, non_blocking)"] = ("dataloader", "--workers", str(e2e_workers))
    return out


def topology() -> dict[str, Any]:
    """The CPUs as the loader sees them, and lscpu's words where it is installed."""
    from ..loader.cpus.host import Host, format_cpus

    h = Host.read("/")
    out: dict[str, Any] = {"cpus": format_cpus(h.allowed), "cores": len(h.cores), "threads_per_core": h.siblings,
                           "numa_nodes": len(set(h.nodes.values())) or 1, "quota": h.quota}
    if shutil.which("lscpu"):
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "Socket(s)", "CPU max MHz", "CPU min MHz", "NUMA node(s)"):
                out[key.strip()] = value.strip()
    return out


def clock_mhz() -> float | None:
    """The mean of /proc/cpuinfo's "cpu MHz" lines now (None where the kernel does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    except (OSError, ValueError):
        return None
    return sum(mhz) / len(mhz) if mhz else None


class ClockSampler:
    """The clock, sampled every half second while a row runs: an all-core load lowers it."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            mhz = clock_mhz()
            if mhz is not None:
                self.samples.append(mhz)

    def __enter__(self) -> "ClockSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def section(e2e_cmd: Callable[..., list[str]], run_json: Callable[..., dict[str, Any]], batch: int,
            e2e_workers: int) -> dict[str, Any]:
    """The rows, once each, the ratios to the ceiling, the topology and the clock idle and under the defaults."""
    cpus = len(os.sched_getaffinity(0))
    clocks: dict[str, Any] = {"idle_mhz": clock_mhz()}
    auto_row = 'feedline, placed, workers="auto" (the defaults)'

    def c(row: str, feed: str, *extra: str) -> Contender:
        def run(_: float) -> dict[str, Any]:
            if row != auto_row:
                return run_json(e2e_cmd(feed, batch, *extra), dict(os.environ), "e2e", row)
            with ClockSampler() as clock:
                out = run_json(e2e_cmd(feed, batch, *extra), dict(os.environ), "e2e", row)
            clocks["under_load_mhz"] = sum(clock.samples) / len(clock.samples) if clock.samples else None
            return out

        return Contender(row, run)

    measured = interleaved([c(row, *how) for row, how in rows(cpus, e2e_workers).items()], 1, 1.0, 0.0)
    ratios = {row: ratio(measured[row], measured[CEILING]) for row in measured if row != CEILING}
    r = ratios[auto_row]
    best = max((row for row in ratios if row.startswith("feedline")), key=lambda row: ratios[row][0])
    beside = {w: ratios[f"{BESIDE}, {w}"][0] for w in ("unplaced", "placed")}
    return {"rows": measured, "ratios": ratios, "ratio": r, "met": r[0] >= 0.95, "batch_size": batch,
            "topology": {**topology(), **clocks},
            "summary": (f"batch {batch}: feedline with the defaults {r[0]:.0%} of synthetic; the best row "
                        f"{best.removeprefix('feedline, ')} {ratios[best][0]:.0%}; synthetic with the loader beside "
                        f"it {beside['unplaced']:.0%} unplaced, {beside['placed']:.0%} placed (contention alone); "
                        f"DataLoader {ratios['DataLoader (pinned, non_blocking)'][0]:.0%}")}


def markdown_lines(s: dict[str, Any]) -> list[str]:
    """The section's rows and topology, under its summary in results.md."""
    t = s.get("topology", {})
    lines = ["", f"Placement, batch {s['batch_size']}: each row once, its share of the synthetic step's samples/s "
             f"(the loader's placement as it logged it). The machine: {t.get('Model name', '?')}, CPUs "
             f"{t.get('cpus')} ({t.get('cores')} cores, {t.get('threads_per_core')} threads a core, "
             f"{t.get('numa_nodes')} NUMA node(s), quota {t.get('quota')}); clock {t.get('idle_mhz') or '?'} MHz "
             f"idle, {t.get('under_load_mhz') or '?'} MHz under the defaults' row.", "",
             "| row | samples/s | of synthetic | starvation | training process CPU % |", "|---|---:|---:|---:|---:|"]
    for row, r in s["rows"].items():
        share = "1.00" if row == CEILING else f"{s['ratios'][row][0]:.2f}"
        lines.append(f"| {row} | {r['samples_per_s']:.0f} | {share} | {r.get('starvation', 0):.1%} | "
                     f"{r.get('main_cpu_pct', 0):.0f} |")
    return lines
