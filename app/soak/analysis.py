"""What a soak run's record says: slopes after the warm-up, throughput, every epoch's keys, the verdict.

A slope is fitted within each process's life (a restart begins a new series: the
fixed-effects estimate, the mean of the lives' own slopes weighted by their spread in
time), so a kill never reads as a fall. Every life warms up as the first did: a restarted
trainer, sidecar or store starts from nothing and its first ``warmup`` seconds are left out
too (a trainer fills its caches and its heap for ten minutes; judged from its first minute,
the third hour's 20-minute lives read as +2.7 MiB/h, from their tenth as +1.0). Decode workers
live minutes by design and are left out only for ``worker_warmup`` after each start.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from .run import ROLES, Record
from .settings import Targets

MIB = 1 << 20
# Prometheus is measured and shown, not judged: its in-memory head block holds the last two hours of
# samples by design, so it grows through the first hours of any run (its memory is Prometheus's own matter)
JUDGED = ("trainer", "worker", "sidecar", "store")
# What is judged of a decode worker: its private memory, and its descriptors as a pool. Beyond its private memory
# a worker's RSS is pages of the cache's shard files it maps and of the batch ring, shared memory bounded by the
# budget and the ring (and judged as /dev/shm); its descriptors are the epoch's shards it holds, moving between
# two counts as it hands shards over. Workers are killed every few minutes, and within such short lives those
# two-state swings read as slopes of either sign (+6.3 and -6.6 MiB/h in two hours, the private memory flat).
# Their descriptors are flat when the pool's most in the last window is no more than its most in the first, plus
# what the descriptors target allows over the run (a 3-minute run's cache still grows, and so do its epochs).
JUDGED_AS = {"worker": {"rss": "anon", "fds": "peaks"}}




@dataclass
class Verdict:
    """What a run achieved against its targets: slopes, peaks, throughput, epochs, the cache; ``failures`` says what was missed."""

    slopes: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> measure -> per hour
    points: dict[str, int] = field(default_factory=dict)  # role -> samples the slopes used
    peaks: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> measure -> largest seen
    throughput: tuple[float, float] = (0.0, 0.0)  # samples/s in the first and the last window
    epochs: list[dict[str, Any]] = field(default_factory=list)
    cache_peak: int = 0
    cache_bound: int = 0
    retained_peak: int = 0  # evicted shards kept for a reader's epoch (bound: the budget, one epoch's shards)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _slope(lives: dict[int, list[tuple[float, float]]]) -> tuple[float, int]:
    """Per second, fitted within each life; (slope, points used)."""
    sxy = sxx = 0.0
    n = 0
    for points in lives.values():
        if len(points) < 2:
            continue
        mt = sum(t for t, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        sxy += sum((t - mt) * (y - my) for t, y in points)
        sxx += sum((t - mt) ** 2 for t, _ in points)
        n += len(points)
    return (sxy / sxx if sxx > 0 else 0.0), n


def _first_seen(record: Record) -> dict[int, float]:
    """When each process (pid) was first sampled: its life's start, which warm-ups count from."""
    first: dict[int, float] = {}
    for row in record.rows:
        first.setdefault(row["pid"], row["t"])
    return first


def life_warmup(role: str, warmup: float, worker_warmup: float) -> float:
    """Seconds after a process's start that its slope leaves out: the run's warm-up, but a worker's own."""
    return worker_warmup if role == "worker" else warmup


def slopes(record: Record, warmup: float, worker_warmup: float) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """Role -> {rss, pss, anon (MiB per hour), fds, threads (per hour)}, and the points each role's fit used."""
    first_seen = _first_seen(record)
    out: dict[str, dict[str, float]] = {}
    used: dict[str, int] = {}
    for role in ROLES:
        own = life_warmup(role, warmup, worker_warmup)
        rows = [r for r in record.rows if r["role"] == role and r["t"] >= warmup
                and r["t"] - first_seen[r["pid"]] >= own]
        if not rows:
            continue
        out[role] = {}
        for measure, scale in (("rss", MIB), ("pss", MIB), ("anon", MIB), ("fds", 1), ("threads", 1)):
            lives: dict[int, list[tuple[float, float]]] = defaultdict(list)
            for r in rows:
                if r[measure] >= 0:
                    lives[r["pid"]].append((r["t"], r[measure] / scale))
            per_second, n = _slope(lives)
            out[role][measure] = per_second * 3600
            used[role] = max(used.get(role, 0), n)
    return out, used


def _window_peaks(record: Record, role: str, measure: str, warmup: float, worker_warmup: float,
                  window: float) -> tuple[float, float]:
    """The role's most of ``measure`` (every process of it) in the first window after the warm-up, and in the last."""
    first_seen = _first_seen(record)
    own = life_warmup(role, warmup, worker_warmup)
    rows = [r for r in record.rows if r["role"] == role and r["t"] - first_seen[r["pid"]] >= own]
    end = max((r["t"] for r in rows), default=0.0)
    first = max((r[measure] for r in rows if warmup <= r["t"] <= warmup + window), default=0)
    last = max((r[measure] for r in rows if r["t"] >= end - window), default=0)
    return first, last


def throughput(record: Record, start: float, end: float, window: float) -> tuple[float, float]:
    """Samples/s over ``window`` seconds from ``start``, and over the last ``window`` seconds before ``end``."""
    def rate(a: float, b: float) -> float:
        pts = [(s["t"], s["keys"]) for s in record.system if a <= s["t"] <= b]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return 0.0
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
    return rate(start, start + window), rate(end - window, end)


def epochs(record: Record, keys_dir: str) -> list[dict[str, Any]]:
    """Every epoch the trainer finished: its samples, keys seen twice, shards read only in part.

    The trace files are ``epoch-<n>.txt``; the last one may be cut by the run's end and is left out
    unless the trainer finished it (a later one exists).
    """
    files = {int(n[len("epoch-"):-len(".txt")]): os.path.join(keys_dir, n) for n in os.listdir(keys_dir)
             if n.startswith("epoch-") and n.endswith(".txt")}
    out = []
    for epoch in sorted(files)[:-1]:
        with open(files[epoch]) as f:
            keys = f.read().split()
        counts = Counter(keys)
        shards = Counter(record.shard_of.get(k, "?") for k in counts)
        partial = sorted(s for s, n in shards.items() if n != record.shard_samples.get(s))
        out.append({"epoch": epoch, "samples": len(keys), "shards": len(shards),
                    "twice": sum(n - 1 for n in counts.values() if n > 1), "partial_shards": partial})
    return out


def judge(record: Record, keys_dir: str, warmup: float, worker_warmup: float,
          targets: Targets = Targets()) -> Verdict:
    v = Verdict()
    v.slopes, v.points = slopes(record, warmup, worker_warmup)
    for role in ROLES:
        rows = [r for r in record.rows if r["role"] == role]
        if rows:
            v.peaks[role] = {"rss": max(r["rss"] for r in rows) / MIB, "fds": max(r["fds"] for r in rows),
                             "threads": max(r["threads"] for r in rows)}
    for role, s in v.slopes.items():
        if role not in JUDGED:
            continue
        memory, fds = JUDGED_AS.get(role, {}).get("rss", "rss"), JUDGED_AS.get(role, {}).get("fds", "fds")
        what = {"rss": "RSS", "anon": "private memory"}[memory]
        if s[memory] > targets.rss_mib_per_hour:
            v.failures.append(f"{role}: {what} grows {s[memory]:.2f} MiB/h after the warm-up (target "
                              f"<= {targets.rss_mib_per_hour:g})")
        if fds == "peaks":
            first, last = _window_peaks(record, role, "fds", warmup, worker_warmup, targets.window)
            hours = max(0.0, (record.system[-1]["t"] if record.system else 0.0) - warmup) / 3600
            if last > first + targets.fds_per_hour * hours:  # what the slope target allows over the run
                v.failures.append(f"{role}: open descriptors reach {last:.0f} in the last {targets.window:.0f} s, "
                                  f"more than the {first:.0f} of the first after the warm-up (target flat)")
        elif s[fds] > targets.fds_per_hour:
            v.failures.append(f"{role}: open descriptors grow {s[fds]:.2f}/h (target flat)")
        if s["threads"] > targets.threads_per_hour:
            v.failures.append(f"{role}: threads grow {s['threads']:.2f}/h (target flat)")
    end = record.system[-1]["t"] if record.system else 0.0
    v.throughput = throughput(record, warmup, end, targets.window)
    first, last = v.throughput
    if first <= 0 or last < targets.throughput_ratio * first:
        v.failures.append(f"throughput: {last:.1f} samples/s in the last {targets.window:.0f} s against "
                          f"{first:.1f} in the first after the warm-up (target >= {targets.throughput_ratio:.0%})")
    v.epochs = epochs(record, keys_dir)
    if not v.epochs:
        v.failures.append("no epoch was trained to its end")
    for e in v.epochs:
        if e["twice"] or e["partial_shards"]:
            v.failures.append(f"epoch {e['epoch']}: {e['twice']} sample(s) trained twice, shards read in part: "
                              f"{e['partial_shards'] or 'none'}")
    v.cache_peak = max((s.get("shard_bytes", s["cache_bytes"]) for s in record.system), default=0)
    v.cache_bound = record.budget + record.settings["fetch_threads"] * record.largest_shard
    if v.cache_peak > v.cache_bound:
        v.failures.append(f"/dev/shm: the cache's shards took {v.cache_peak} bytes, over its budget plus the "
                          f"downloads in flight ({v.cache_bound})")
    v.retained_peak = max((s.get("retained_bytes", 0) for s in record.system), default=0)
    if v.retained_peak > record.budget:
        v.failures.append(f"/dev/shm: evicted shards kept for readers took {v.retained_peak} bytes, more than one "
                          f"epoch's shards can (the budget, {record.budget})")
    for e in record.exits:
        if not e["expected"]:
            last = [line for line in e.get("log_tail", "").splitlines() if line.strip()]
            v.failures.append(f"{e['role']} exited with {e['code']} at {e['t']:.0f} s, not by the schedule"
                              + (f"; its log's last line: {last[-1].strip()}" if last else ""))
    v.failures += [f"left over after the run: {x}" for x in record.leftovers]
    return v


def table(record: Record, v: Verdict) -> str:
    """The Markdown summary of a run (docs/reliability.md holds the recorded one)."""
    s = record.settings
    worker_warmup = s.get("worker_warmup", s.get("process_warmup", 0.0))  # the name in records before 2026-11-26
    lines = [f"Run: code {s.get('code', 'unknown')}, {s['minutes']:g} min, a sample every {s['interval']:g} s, slopes "
             f"after the first {s['warmup']:g} s of every process's life (a decode worker's: {worker_warmup:g} s); "
             f"{len(record.events)} events.", "",
             "| process | RSS MiB/h | PSS MiB/h | anon MiB/h | fds /h | threads /h | peak RSS MiB | peak fds | "
             "peak threads | points |", "|---|---|---|---|---|---|---|---|---|---|"]
    for role in ROLES:
        if role in v.slopes:
            sl, pk = v.slopes[role], v.peaks[role]
            lines.append(f"| {role}{'' if role in JUDGED else ' (not judged)'} | {sl['rss']:+.2f} | {sl['pss']:+.2f} | {sl['anon']:+.2f} | {sl['fds']:+.2f} | "
                         f"{sl['threads']:+.2f} | {pk['rss']:.0f} | {pk['fds']:.0f} | {pk['threads']:.0f} | "
                         f"{v.points.get(role, 0)} |")
    if "worker" in v.slopes:
        w = v.slopes["worker"]
        lines += ["", f"Workers are judged by their private memory ({w['anon']:+.2f} MiB/h) and by the most descriptors "
                      f"the pool held in the first and the last window: the rest of their RSS is shared pages of the "
                      f"cache and the ring, and each life is a few minutes (docs/reliability.md)."]
    first, last = v.throughput
    twice = sum(e["twice"] for e in v.epochs)
    partial = sum(len(e["partial_shards"]) for e in v.epochs)
    lines += ["", f"- throughput: {first:.1f} samples/s in the first window after the warm-up, {last:.1f} in the "
                  f"last ({last / first:.1%})" if first else "- throughput: no data",
              f"- epochs trained to their end: {len(v.epochs)}, {sum(e['samples'] for e in v.epochs)} samples; "
              f"trained twice: {twice}; shards read in part: {partial}",
              f"- /dev/shm: the cache's shards peaked at {v.cache_peak / MIB:.2f} MiB against a bound of "
              f"{v.cache_bound / MIB:.2f} MiB (budget {record.budget / MIB:.2f} MiB plus the downloads in flight); evicted "
              f"shards kept for a reader's epoch at most {v.retained_peak / MIB:.2f} MiB (bound: the budget); the whole "
              f"cache directory (indexes, manifest, leases; in 4 KiB pages) at "
              f"{max((x['cache_bytes'] for x in record.system), default=0) / MIB:.2f} MiB; "
              f"/dev/shm as a whole at most {max((x.get('shm_bytes', 0) for x in record.system), default=0) / MIB:.1f} "
              f"MiB above its use at the start (the batch ring is a memfd: not in /dev/shm)",
              "- faults: " + ", ".join(f"{k} x{n}" for k, n in Counter(e["kind"] for e in record.events
                                                                         if e["kind"] not in ("start", "end",
                                                                                              "store_up")).items()),
              f"- left over at the end: {', '.join(record.leftovers) or 'nothing'}",
              f"- verdict: {'every target met' if v.ok else 'NOT MET: ' + '; '.join(v.failures)}"]
    return "\n".join(lines) + "\n"
