"""A contender's worker processes as ``/proc`` shows them: their memory and the CPU they used."""

from __future__ import annotations

import os


def children() -> list[str]:
    """The pids of this process's children (a loader's workers)."""
    pids: list[str] = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += f.read().split()
        except OSError:
            continue
    return pids


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) each child process has used so far, by pid."""
    out = {}
    for pid in children():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return out


def rss_mb() -> list[float]:
    """Resident memory (MB) of each child process of this one (a loader's workers)."""
    out = []
    for pid in children():
        try:
            with open(f"/proc/{pid}/status") as f:
                out += [int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:")]
        except OSError:
            continue
    return out
