"""Pinning: the training process's threads on its CPUs while a loader runs, and given back after.

Another process on the host may have placed itself there first (a second training job, a test runner's other
worker): a training process's CPUs are claimed host-wide, one abstract Unix socket name a CPU (``\0feedline-cpu-
N``: gone with the process, nothing on disk), and a plan whose CPUs another process claims is not pinned.

``sched_setaffinity`` moves one thread; a process's threads are each moved (``/proc/self/task``), and the
threads started later inherit the mask of the thread that starts them. The process is the user's: the masks
its threads had are given back when the last loader that pinned them closes (a thread started meanwhile gets
the process's first mask). A worker process pins itself, first thing, to the CPUs its header names
(``launch.py``), so every thread it starts (FFmpeg's, a transform's) stays there.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

log = logging.getLogger("feedline.loader")


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]


def _set(tid: int, cpus: set[int] | tuple[int, ...]) -> bool:
    try:
        os.sched_setaffinity(tid, cpus)
        return True
    except OSError:  # a thread that ended meanwhile, or CPUs a cpuset took away since
        return False


def _claim(cpus: tuple[int, ...]) -> list[socket.socket] | None:
    """The host-wide claims of ``cpus`` (one bound socket a CPU), or None when another process holds one."""
    held: list[socket.socket] = []
    for cpu in cpus:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(f"\0feedline-cpu-{cpu}")
        except OSError:
            s.close()
            for h in held:
                h.close()
            return None
        held.append(s)
    return held


class ProcessPins:
    """This process's threads pinned for as long as some loader holds the pins (one per process)."""

    _lock = threading.Lock()
    _holders = 0
    _cpus: tuple[int, ...] = ()
    _before: dict[int, set[int]] = {}
    _first: set[int] = set()
    _claims: list[socket.socket] = []

    @classmethod
    def claimable(cls, cpus: tuple[int, ...]) -> bool:
        """No other process on this host has placed its training process on any of ``cpus``."""
        with cls._lock:
            if cls._holders and set(cpus) <= set(cls._cpus):
                return True
            claims = _claim(tuple(c for c in cpus if c not in cls._cpus))
            if claims is None:
                return False
            for c in claims:
                c.close()
            return True

    @classmethod
    def hold(cls, cpus: tuple[int, ...]) -> bool:
        """Pin every thread of this process to ``cpus`` (the first holder's; later ones share them). True when
        this holder must ``release``; False when ``cpus`` is empty or another process claimed them meanwhile."""
        if not cpus:
            return False
        with cls._lock:
            if cls._holders == 0:
                claims = _claim(cpus)
                if claims is None:
                    log.warning("CPUs %s were claimed by another process's training process as this loader "
                                "started: the training process stays unpinned", ",".join(map(str, cpus)))
                    return False
                cls._claims = claims
                cls._first = set(os.sched_getaffinity(0))
                cls._before = {}
                for tid in _threads():
                    try:
                        cls._before[tid] = set(os.sched_getaffinity(tid))
                    except OSError:
                        continue
                    _set(tid, cpus)
                cls._cpus = cpus
            elif tuple(cpus) != cls._cpus:
                log.info("the training process is pinned to CPUs %s already (by an earlier loader); this loader's "
                         "plan keeps them", ",".join(map(str, cls._cpus)))
            cls._holders += 1
            return True

    @classmethod
    def release(cls) -> None:
        """The last holder gives every thread its mask back."""
        with cls._lock:
            if cls._holders == 0:
                return
            cls._holders -= 1
            if cls._holders:
                return
            for tid in _threads():
                _set(tid, cls._before.get(tid, cls._first))
            for c in cls._claims:
                c.close()
            cls._before, cls._cpus, cls._claims = {}, (), []

    @classmethod
    def held(cls) -> tuple[int, ...]:
        return cls._cpus


def pin_self(cpus: tuple[int, ...] | list[int]) -> None:
    """A worker process, at its start: this thread (its only one yet) on ``cpus``."""
    if cpus:
        _set(0, tuple(cpus))
