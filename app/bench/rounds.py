"""Repeated, interleaved measurement: what makes a benchmark on a shared machine readable.

Each contender runs once to warm up (discarded), then ``rounds`` times; within a round every
contender runs once, in an order rotated each round, so a slow minute on the machine hits every
contender alike instead of one. A row reports the median of its rounds and their range; a ratio
between two rows is the median of the per-round ratios (both measured in the same round), with
its range. Every round is kept in ``docs/benchmarks.json``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
METRICS = ("samples_per_s", "mb_per_s", "main_cpu_pct", "starvation", "draft_samples_per_s", "trainer_ms_per_batch",
           "step_ms", "speed", "workers_cpu_pct", "wait_share", "loader_cpu_share", "standin_copy_share")


@dataclass(frozen=True)
class Contender:
    """One row of a workload's table: ``run(seconds)`` measures it once, in its own process."""

    row: str
    run: Callable[[float], dict[str, Any]]
    seconds: float | None = None  # its own measured time (None: the benchmark's)


def interleaved(contenders: list[Contender], rounds: int, seconds: float, warmup: float,
                at_once: int = 1) -> dict[str, Any]:
    """Every contender ``rounds`` times, rotating the order each round, after one discarded warm-up each.

    ``at_once`` > 1 runs that many contenders side by side: only for ``--quick``, which checks that
    everything runs and measures nothing (they share the CPUs).
    """
    if warmup > 0:
        for c in contenders:
            c.run(min(warmup, c.seconds or seconds))
    runs: dict[str, list[dict[str, Any]]] = {c.row: [] for c in contenders}
    with ThreadPoolExecutor(max(1, at_once)) as pool:
        for r in range(rounds):
            order = rotated(contenders, r)
            for c, result in zip(order, pool.map(lambda c: c.run(c.seconds or seconds), order)):
                runs[c.row].append(result)
    return {c.row: summarize(runs[c.row]) for c in contenders}  # table order, not run order


def rotated(items: list[T], rnd: int) -> list[T]:
    """``items`` in round ``rnd``'s order: each starts a round in turn, so no one always runs first."""
    k = rnd % len(items)
    return items[k:] + items[:k]


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run's fields, each metric replaced by its median over the rounds, with the range."""
    middle = sorted(results, key=lambda x: x["samples_per_s"])[(len(results) - 1) // 2]
    row = dict(middle)
    row["range"] = {}
    for m in METRICS:
        values = [x[m] for x in results if m in x]
        if values:
            row[m] = statistics.median(values)
            row["range"][m] = [min(values), max(values)]
    row["rounds"] = [{m: x[m] for m in METRICS if m in x} for x in results]
    return row


def ratio(a: dict[str, Any], b: dict[str, Any], metric: str = "samples_per_s") -> tuple[float, float, float]:
    """``a / b``: the median of the per-round ratios and their min and max (one run each: that ratio)."""
    ra, rb = a.get("rounds"), b.get("rounds")
    if not ra or not rb or len(ra) != len(rb):
        r = a[metric] / b[metric]
        return r, r, r
    values = [x[metric] / y[metric] for x, y in zip(ra, rb)]
    return statistics.median(values), min(values), max(values)


def fmt_ratio(r: tuple[float, float, float], digits: int = 2) -> str:
    """``2.07x (1.95-2.20)``; without a range where there was one round."""
    med, lo, hi = r
    return f"{med:.{digits}f}x" + (f" ({lo:.{digits}f}-{hi:.{digits}f})" if hi > lo else "")


AGAINST_DRAFT = "1 core: the crop decoder and Pillow's draft decode in turns"


def split_against_draft(rows: dict[str, Any]) -> dict[str, Any]:
    """The turns row as its two rows, "1 core, draft" and "1 core, crop decoder", in its place: each round of
    the two measured in the same process, in alternating slices (their ratio is the per-core target's)."""
    if AGAINST_DRAFT not in rows:
        return rows
    out: dict[str, Any] = {}
    for name, row in rows.items():
        if name != AGAINST_DRAFT:
            out[name] = row
            continue
        crop = {k: v for k, v in row.items() if k not in ("draft_samples_per_s", "range", "rounds")}
        crop["turns"] = True  # both rows measured in one process a round
        crop["range"] = {k: v for k, v in row["range"].items() if k != "draft_samples_per_s"}
        crop["rounds"] = [{k: v for k, v in r.items() if k != "draft_samples_per_s"} for r in row["rounds"]]
        draft = {**crop, "crop_decoder": False, "samples_per_s": row["draft_samples_per_s"],
                 "range": {"samples_per_s": row["range"]["draft_samples_per_s"]},
                 "rounds": [{"samples_per_s": r["draft_samples_per_s"]} for r in row["rounds"]]}
        out["1 core, draft"], out["1 core, crop decoder"] = draft, crop
    return out
