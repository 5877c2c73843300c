"""``scripts/gpu-check``'s results as markdown: its steps, each section against its target, a missed e2e target
taken apart, where the CPU went, every contender's row. ``results.md`` on the lent machine, and the CUDA
section of ``docs/benchmarks.md`` (``report.py``) once recorded here."""

from __future__ import annotations

from typing import Any

TARGETS = {  # in the order they run: what a check must bring back first (issue 69), then what fits
    "placement": "ResNet-50 at batch 256 fed by feedline with the defaults (workers=\"auto\", cpu_placement=\"auto\") "
                 "within 5 % of synthetic; the rows that tell contention, placement and worker count apart",
    "raw": "feedline >= 5x DataLoader (pinned, non_blocking) samples/s, the training process's CPU <= 10 % of a core",
    "decode": "device_decode >= 2x CPU decode samples/s, the same workers",
    "h2d": "the loader's copies against torch's own pinned copy bandwidth (a row)",
    "e2e": "ResNet-50 step fed by feedline within 5 % of synthetic data on the device, batch 32 (launch-bound)",
    "e2e-256": "ResNet-50 step fed by feedline within 5 % of synthetic data on the device, batch 256",
}
SECTIONS = tuple(TARGETS)
PROFILE_SECONDS = 5.0  # py-spy samples a contender's timed part this long


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    device = m.get("gpu", "no CUDA device")
    out = [f"# gpu-check: {device}", "",
           f"{results['when']}; {m['cpus']} CPUs, Python {m['python']}, torch {m['torch']}"
           + (f" (CUDA {m['cuda_version']})" if m.get("cuda_version") else "") + f", PIL {m['pil']}; "
           f"crop decoder: {m['crop_decoder']}.", "", "| step | result |", "|---|---|"]
    for step in results["steps"]:
        out.append(f"| {step['step']} | {step['status']}: {step['detail']} |")
    out += ["", "| section | target | this run | met |", "|---|---|---|---|"]
    for name in SECTIONS:
        s = results["sections"].get(name, {"skipped": "not run"})
        if "skipped" in s or "failed" in s:
            run_, met = ("skipped: " + s["skipped"]) if "skipped" in s else "FAILED: " + s["failed"][:300], "—"
        else:
            run_ = s["summary"] + (f" ({s['rehearsal']})" if "rehearsal" in s else "")
            met = "—" if s.get("met") is None or "rehearsal" in s else ("yes" if s["met"] else "**no**")
        out.append(f"| {name} | {TARGETS[name]} | {run_.replace('|', '/')} | {met} |")
    placed = results["sections"].get("placement", {})
    if "rows" in placed:
        from .gpu_placement import markdown_lines

        out += markdown_lines(placed)
    why = results["sections"].get("e2e", {}).get("why")
    if why:
        out += ["", "The e2e step taken apart (each once; the trace: torch's profiler over 4 more steps; the loader's "
                "own counters a batch: its CPU in the training process, wake-ups, device calls on the loop's thread):",
                "", "| contender | samples/s | starvation | GPU wait for copies | wall ms a step | device ms a step "
                "| loader CPU ms a batch | wake-ups | loop's device calls | most device time |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for row, r in why.items():
            if "failed" in r:
                out.append(f"| {row} | FAILED: {r['failed'][:200].replace('|', '/')} | | | | | | | | |")
                continue
            t, cost = r.get("trace", {}), r.get("cost", {})
            top = "; ".join(f"{k[:50]} {ms:.2f} ms" for k, ms, _ in t.get("top", [])[:2]).replace("|", "/")
            copy_wait = f"{r['gpu_copy_wait']:.1%}" if "gpu_copy_wait" in r else "—"
            counted = (f"{cost['cpu_seconds'] * 1e3:.3f} | {cost['wakeups']:.2f} | {cost['device_calls_loop']:.2f}"
                       if cost else "— | — | —")
            out.append(f"| {row} | {r['samples_per_s']:.0f} | {r['starvation']:.1%} | {copy_wait} | "
                       f"{t.get('wall_ms_per_step', float('nan')):.1f} | "
                       f"{t.get('device_ms_per_step', float('nan')):.1f} | {counted} | {top or '—'} |")
    profiled = [(name, s["profile"]) for name in SECTIONS if "profile" in (s := results["sections"].get(name, {}))]
    if results.get("profiles_failed"):
        out += ["", f"The profiles failed: {results['profiles_failed'][:500]}"]
    if profiled:
        secs = next((p["seconds"] for _, p in profiled if "seconds" in p), PROFILE_SECONDS)
        out += ["", f"Where the CPU went (py-spy over {secs:.0f} s of each contender's timed part; "
                    "profiles.md beside results.md has the functions):", ""]
        for name, prof in profiled:
            if "skipped" in prof:
                out.append(f"- {name}: profile skipped: {prof['skipped']}")
                continue
            parts = []
            for role, r in prof["summary"].items():
                if isinstance(r, dict):
                    top = next(iter(r["self"]), ["-", 0.0])
                    parts.append(f"{role} {r['cpu_s'] / prof['seconds']:.0%} of a core (most on the CPU: "
                                 f"{top[0].replace('|', '/')}, {top[1]:.2f} s)")
            out.append(f"- {name}: " + ("; ".join(parts) or "no samples") + (f" ({prof['problem']})"
                                                                               if prof.get("problem") else ""))
    rows = [(name, row, r) for name in SECTIONS for row, r in results["sections"].get(name, {}).get("rows", {}).items()]
    if rows:
        out += ["", "| section | contender | samples/s (range) | main CPU % | starvation |", "|---|---|---:|---:|---:|"]
        for name, row, r in rows:
            lo, hi = r.get("range", {}).get("samples_per_s", [r["samples_per_s"]] * 2)
            out.append(f"| {name} | {row} | {r['samples_per_s']:.0f} ({lo:.0f}-{hi:.0f}) | "
                       f"{r.get('main_cpu_pct', float('nan')):.1f} | "
                       + (f"{r['starvation']:.1%}" if "starvation" in r else "—") + " |")
    return "\n".join(out) + "\n"
