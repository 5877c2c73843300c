"""Pinning: the training process's threads on its CPUs while a loader runs, and given back after.

A training process claims its CPUs, one abstract Unix socket name a CPU (``\\0feedline-cpu-N``: gone with the
process, nothing on disk), so that another one on the host places itself elsewhere (a second training job, a
rank whose NUMA slice another took). The names live in a network namespace: containers with a network of their
own do not see each other's (they have cpusets of their own, or share CPUs under a quota, where nothing is
pinned: ``placement.py``).

``sched_setaffinity`` moves one thread; a process's threads are each moved (``/proc/self/task``), and the
threads started later inherit the mask of the thread that starts them. The process is the user's: the masks
its threads had are given back when the last loader that pinned them closes (a thread started meanwhile gets
the process's first mask), and every loader of the process shares the first one's plan. A worker process is
pinned by the trainer as it starts and pins itself, first thing, to the CPUs its header names (``launch.py``),
so every thread it starts (FFmpeg's, a transform's) stays there.

torch's intra-op pool has a thread a CPU the process had at its start: pinned to fewer cores, those threads would
take turns on them (a CPU op twenty times slower on one core with two threads, measured), so the pool is cut to
the cores pinned while they are, and given back with the masks.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import Any

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


def _name(cpu: int) -> str:
    return f"\0feedline-cpu-{cpu}"


def claim(cpus: tuple[int, ...]) -> list[socket.socket] | None:
    """This process's claims of ``cpus`` (a bound socket a CPU, held open), or None when another process holds one
    of them; CPUs this process holds already need none."""
    held: list[socket.socket] = []
    for cpu in cpus:
        if cpu in ProcessPins.cpus():
            continue
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(_name(cpu))
        except OSError:
            s.close()
            for h in held:
                h.close()
            return None
        held.append(s)
    return held


def taken_elsewhere(cpus: tuple[int, ...]) -> set[int]:
    """The CPUs of ``cpus`` another process's training process holds."""
    mine = set(ProcessPins.cpus())
    taken = set()
    for cpu in cpus:
        if cpu in mine:
            continue
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(_name(cpu))
        except OSError:
            taken.add(cpu)
        finally:
            s.close()
    return taken


class ProcessPins:
    """This process's threads pinned, and its CPUs claimed, for as long as some loader holds the pins (one per
    process); ``plan`` is the first holder's placement, which later loaders of the process share."""

    _lock = threading.Lock()
    _holders = 0
    _cpus: tuple[int, ...] = ()
    _before: dict[int, set[int]] = {}
    _first: set[int] = set()
    _claims: list[socket.socket] = []
    _torch_threads = 0  # torch's intra-op threads before they were cut to the pinned cores; 0: not cut
    plan: Any = None

    @classmethod
    def cpus(cls) -> tuple[int, ...]:
        return cls._cpus

    @classmethod
    def original(cls) -> set[int]:
        """The CPUs the process had before it was pinned (while it is), else its mask now."""
        return set(cls._first) if cls._holders else set(os.sched_getaffinity(0))

    @classmethod
    def unpinned(cls) -> tuple[int, ...]:
        """Where a worker of an unplaced loader runs: the mask the process had before it was pinned, so that it
        does not inherit the launching threads' cores; () when nothing is pinned (it inherits as it would)."""
        return tuple(sorted(cls._first)) if cls._holders else ()

    @classmethod
    def hold(cls, plan: Any) -> bool:
        """Pin every thread of this process to ``plan.trainer`` with ``plan.claims`` (the first holder's plan;
        later ones share it, their claims let go). True when this holder must ``release``."""
        if not plan.trainer:
            return False
        with cls._lock:
            if cls._holders == 0:
                cls._first = set(os.sched_getaffinity(0))
                cls._before = {}
                for tid in _threads():
                    try:
                        cls._before[tid] = set(os.sched_getaffinity(tid))
                    except OSError:
                        continue
                    _set(tid, plan.trainer)
                cls._cpus, cls._claims, cls.plan = tuple(plan.trainer), list(plan.claims), plan
                cls._torch_threads = _cut_torch_threads(len(plan.trainer))
            else:
                for c in plan.claims:
                    c.close()
            cls._holders += 1
            return True

    @classmethod
    def release(cls) -> None:
        """The last holder gives every thread its mask back, and the CPUs their claims."""
        with cls._lock:
            if cls._holders == 0:
                return
            cls._holders -= 1
            if cls._holders:
                return
            for tid in _threads():
                _set(tid, cls._before.get(tid, cls._first))
            if cls._torch_threads:
                _torch_set_threads(cls._torch_threads)
            cls._drop()

    @classmethod
    def _drop(cls) -> None:
        for c in cls._claims:
            c.close()
        cls._before, cls._cpus, cls._claims, cls.plan, cls._holders = {}, (), [], None, 0
        cls._torch_threads = 0

    @classmethod
    def _forked(cls) -> None:
        """A child made by fork (a fork-based DataLoader worker, a pool): the claims are the parent's."""
        cls._lock = threading.Lock()
        if cls._holders:  # its one thread inherited the launching cores: it gets the process's first mask
            _set(0, cls._first)
        cls._drop()


os.register_at_fork(after_in_child=ProcessPins._forked)


def _torch_set_threads(n: int) -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)


def _cut_torch_threads(cores: int) -> int:
    """torch's intra-op threads down to ``cores`` when it had more; the count before (to give back), else 0."""
    torch = sys.modules.get("torch")  # not imported: nothing to cut (the loader itself imports it)
    if torch is None:
        return 0
    before = torch.get_num_threads()
    if before <= cores:
        return 0
    torch.set_num_threads(cores)
    log.info("cpu_placement: torch's intra-op threads %d -> %d, the training process's cores, while the loader "
             "runs (torch.set_num_threads after the loader starts overrides it)", before, cores)
    return before


def pin_self(cpus: tuple[int, ...] | list[int]) -> None:
    """A worker process, at its start: this thread (its only one yet) on ``cpus``."""
    if cpus:
        _set(0, tuple(cpus))
