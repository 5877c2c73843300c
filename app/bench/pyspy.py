"""A contender's CPU profile by sampling (py-spy), summarized as where its CPU went: which process, which
thread, which functions.

``scripts/gpu-check`` takes one of each section's feedline contender when it has time left after the
measurements: a GPU is lent for minutes, so a target that the lent machine misses has to come back with
its cause in the same run, not wait for a second lease. py-spy attaches to the running contender (and its
worker processes) once it says its clock started (``TIMING`` on stderr: start-up and imports are left out),
samples only threads that are running (idle ones are left out), and never pauses it (``--nonblocking``), so
the figures are CPU seconds, not wall seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from itertools import zip_longest
from typing import Any

RATE = 100  # samples a second: a sample is 1/RATE s of one thread on a CPU
TIMING = "feedline-bench: timing"  # what a contender writes to stderr as its clock starts: the steady state
_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
_RECORD_END = re.compile(r'(?<=\d)\n(?=process \d+:")')
_PROCESS = re.compile(r'process (?P<pid>\d+):"(?P<cmd>.*?)";(?=process \d+:"|thread \()', re.S)
TRAINING, WORKERS = "training process", "worker processes"


def binary() -> str | None:
    """py-spy on PATH (``scripts/gpu-check`` puts the carried wheel's there) or beside this Python, else None."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


def record(cmd: list[str], env: dict[str, str], duration: float, settle: float = 0.5, rate: int = RATE,
           start_within: float = 120.0) -> tuple[dict[str, Any] | None, str, str]:
    """Run ``cmd`` and sample it and its children for ``duration`` seconds, from ``settle`` seconds after it
    writes ``TIMING`` to stderr (its steady state, not its imports and start-up): (its JSON result line or
    None, py-spy's raw stacks, what went wrong or "")."""
    exe = binary()
    if exe is None:
        return None, "", "py-spy is not on PATH"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    raw_path = f"/tmp/feedline-pyspy-{proc.pid}.txt"
    err: list[str] = []
    timing = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err.append(line)
            if TIMING in line:
                timing.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    problem = ""
    try:
        deadline = time.monotonic() + start_within
        while not timing.wait(0.2) and proc.poll() is None and time.monotonic() < deadline:
            pass  # a contender that fails before its clock starts is not waited for
        if timing.is_set() and proc.poll() is None:
            time.sleep(settle)
            spy = subprocess.run([exe, "record", "--pid", str(proc.pid), "--subprocesses", "--threads",
                                  "--nonblocking", "--format", "raw", "--rate", str(rate), "--duration",
                                  str(max(1, round(duration))), "-o", raw_path],
                                 capture_output=True, text=True, timeout=duration + 60)
            if spy.returncode != 0:
                problem = f"py-spy exited {spy.returncode}: {(spy.stderr or spy.stdout)[-500:]}"
        else:
            problem = ("the contender ended before its timed part" if proc.poll() is not None else
                       f"the contender did not reach its timed part within {start_within:.0f} s")
        out, _ = proc.communicate(timeout=600)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    raw = ""
    if os.path.exists(raw_path):
        with open(raw_path) as f:
            raw = f.read()
        os.unlink(raw_path)
    if proc.returncode != 0:
        return None, raw, f"the contender exited {proc.returncode}: {''.join(err)[-1500:]}"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), raw, problem


def summarize(raw: str, rate: int = RATE, top: int = 12) -> dict[str, Any]:
    """py-spy's raw stacks as CPU seconds by process role, by thread, and the functions that took them (self:
    the function on the CPU; total: the function or anything it called)."""
    stacks = []
    for line in _RECORD_END.split(raw.strip()):  # a command line may hold newlines (``python -c``)
        stack, _, count = line.rpartition(" ")
        procs = []
        while m := _PROCESS.match(stack):  # a process's command line may hold ';' (a worker's ``python -c``)
            procs.append(m["pid"])
            stack = stack[m.end():]
        if procs and count.isdigit():
            stacks.append((procs, stack.split(";"), int(count)))
    roles: dict[str, dict[str, Any]] = defaultdict(lambda: {"samples": 0, "threads": Counter(), "self": Counter(),
                                                          "total": Counter(), "pids": set()})
    for procs, rest, n in stacks:
        role = roles[TRAINING if len(procs) == 1 else WORKERS]
        role["samples"] += n
        role["pids"].add(procs[-1])
        threaded = rest[0].startswith("thread (")
        role["threads"][(re.sub(r"^thread \(\d+\):? ?", "", rest[0]) or "(unnamed)") if threaded else "?"] += n
        funcs = [_function(f) for f in rest[1 if threaded else 0:] if f]
        if funcs:
            role["self"][funcs[-1]] += n
            for fn in set(funcs):
                role["total"][fn] += n
    out: dict[str, Any] = {"rate": rate}
    for name, r in roles.items():
        cpu = r["samples"] / rate
        out[name] = {"cpu_s": round(cpu, 2), "processes": len(r["pids"]),
                     "threads": {t: round(n / rate, 2) for t, n in r["threads"].most_common(top)},
                     "self": [[fn, round(n / rate, 2)] for fn, n in r["self"].most_common(top)],
                     "total": [[fn, round(n / rate, 2)] for fn, n in r["total"].most_common(top)]}
    return out


def _function(frame: str) -> str:
    """``fn (path/file.py:12)`` as ``fn (file.py)``: one row for a function, whatever line was running."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m['fn']} ({os.path.basename(m['file'])})"


def markdown(title: str, summary: dict[str, Any], seconds: float) -> str:
    """One profile as a short section: CPU seconds over ``seconds`` of sampling, by role, thread and function."""
    out = [f"## {title}", "", f"py-spy, {summary.get('rate', RATE)} samples/s, {seconds:.0f} s of the run "
           "(running threads only: CPU seconds).", ""]
    for role in (TRAINING, WORKERS):
        r = summary.get(role)
        if not r:
            continue
        out += [f"### {role}: {r['cpu_s']:.2f} CPU s ({r['cpu_s'] / seconds:.0%} of a core; "
                f"{r['processes']} process{'es' if r['processes'] != 1 else ''})", "",
                "threads: " + ", ".join(f"{t} {s:.2f} s" for t, s in r["threads"].items()), "",
                "| self (on the CPU) | s | total (with callees) | s |", "|---|---:|---|---:|"]
        for (fn, s), (tfn, ts) in zip_longest(r["self"], r["total"], fillvalue=("", 0.0)):
            out.append(f"| {fn.replace('|', '/')} | {s:.2f} | {tfn.replace('|', '/')} | {ts:.2f} |")
        out.append("")
    return "\n".join(out) + "\n"
