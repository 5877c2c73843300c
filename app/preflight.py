"""Start-up checks against the memory a process can really use, so nothing dies of SIGBUS later."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryBudget:
    available: int  # bytes this process can still allocate (host and cgroup)
    cgroup_limit: int | None
    source: str  # what bounded it, for messages


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_dir() -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) == 3 and parts[0] == "0":
                    return "/sys/fs/cgroup" + parts[2]
    except OSError:
        pass
    return None


def memory_budget() -> MemoryBudget:
    """The smaller of the host's MemAvailable and the cgroup's limit minus its usage."""
    host = _meminfo_available()
    limit = usage = None
    d = _cgroup_dir()
    if d is not None:
        for sub in (d, "/sys/fs/cgroup"):
            limit = _read_int(os.path.join(sub, "memory.max"))
            if limit is not None:
                usage = _read_int(os.path.join(sub, "memory.current")) or 0
                break
    if limit is None:  # cgroup v1
        v1 = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        if v1 is not None and v1 < 1 << 60:
            limit = v1
            usage = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
    if limit is not None and usage is not None and limit - usage < host:
        return MemoryBudget(max(0, limit - usage), limit, "the cgroup (container) memory limit")
    return MemoryBudget(host, limit, "the host's available memory")


def fs_space(path: str) -> tuple[int, int]:
    """(size, free) bytes of the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
