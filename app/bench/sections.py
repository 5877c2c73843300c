"""A host's results as sections (each workload, scaling, sampler, distributed, e2e), so that a run of some of them
(``--workloads raw,jpeg``) replaces those and keeps the rest of the host's last run, each dated."""

from __future__ import annotations

from typing import Any

from .report import targets

SECTIONS = ("scaling", "sampler", "distributed", "e2e", "shuffle", "launch", "placement",
            "remote")  # a run's results beside its "workloads"
# kept whole until a run makes them again: scripts/gpu-check's record (a run of its own), and the jpeg workload's
# instruction count (callgrind, in a full run only)
KEPT_WHOLE = ("gpu_check", "bookkeeping")


def _sections(results: dict[str, Any]) -> dict[str, str]:
    """When each section of a host's results ran: ``{"jpeg": "2026-11-26 09:33 UTC", "sampler": ...}``."""
    names = [*results.get("workloads", {}), *(k for k in SECTIONS if results.get(k))]
    return {name: results.get("ran", {}).get(name, results["when"]) for name in names}


def keep_earlier_sections(earlier: dict[str, Any] | None, results: dict[str, Any], workers: int) -> dict[str, Any]:
    """A run of some workloads (``--workloads raw,jpeg``) keeps the sections of the host's last run that it did not
    run, each with the date it ran (``ran``), when both ran with the same settings; the targets are checked again
    over the whole."""
    same = ("workers", "batch_size", "seconds", "rounds", "quick")
    for whole in KEPT_WHOLE:
        if earlier and earlier.get(whole) and not results.get(whole):
            results[whole] = earlier[whole]
    if not earlier or any(earlier.get("settings", {}).get(k) != results["settings"][k] for k in same):
        results["ran"] = _sections(results)
        return results
    ran = {k: v for k, v in _sections(earlier).items()}
    merged = {**results, "workloads": {**earlier.get("workloads", {}), **results["workloads"]}}
    for key in SECTIONS:
        if not results.get(key) and earlier.get(key):
            merged[key] = earlier[key]
    ran.update(_sections(results))
    merged["ran"] = {name: ran[name] for name in _sections(merged)}
    merged["targets"] = targets(merged, workers)
    return merged
