"""One process's footprint from ``/proc``: resident and proportional memory, descriptors, threads."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..cache.manifest import SUFFIXES, read_manifest


@dataclass(frozen=True)
class Footprint:
    """What ``/proc`` says of one process at one moment."""

    pid: int
    rss: int  # bytes resident (VmRSS), shared pages included
    pss: int  # bytes, shared pages divided among their users (smaps_rollup); -1 where unreadable
    anon: int  # bytes of private anonymous memory resident (RssAnon): what a leak grows
    fds: int
    threads: int


def footprint(pid: int) -> Footprint | None:
    """The process's footprint now; None when it is gone."""
    try:
        fields = {}
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    pss = -1
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                    break
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        pass

    def kib(name: str) -> int:
        return int(fields.get(name, "0 kB").split()[0]) * 1024

    return Footprint(pid, kib("VmRSS"), pss, kib("RssAnon"), fds, int(fields.get("Threads", "0")))


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (the trainer's decode workers), whichever of its threads started them."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return sorted(found)


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (a cache directory on tmpfs: its pages are its size)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def retained(path: str) -> set[str]:
    """File names of the evicted shards the cache keeps for a reader's epoch (its manifest's ``retained``)."""
    try:
        ids = read_manifest(path).retained
    except (OSError, ValueError):
        return set()
    return {i + suffix for i in ids for suffix in SUFFIXES.values()}


def shard_bytes(path: str, kept: bool = False) -> int:
    """Bytes of the shards under ``path`` (``.tar``, ``.tfrecord``, ``.parquet`` files and downloads in progress),
    as the budget counts them; with ``kept``, those of the evicted shards kept for a reader's epoch instead (not in the budget). The
    cache's other files (indexes, the manifest, reader leases) are the rest of ``tree_bytes``."""
    total = 0
    names = retained(path)
    for root, _, files in os.walk(path):
        for name in files:
            if (name in names) != kept:
                continue
            if name.endswith((*SUFFIXES.values(), ".partial")) or ".partial" in root:
                try:
                    total += os.lstat(os.path.join(root, name)).st_size
                except FileNotFoundError:
                    pass
    return total


def shm_used(path: str = "/dev/shm") -> int:
    """Bytes in use on the ``/dev/shm`` filesystem, by anyone: the soak reports its growth over the run."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def started_at(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``): with the pid, names one process
    even after its pid is reused. None when no process has the pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[19])  # field 22: starttime
