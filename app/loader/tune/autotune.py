"""``workers="auto"`` and ``transfer_threads="auto"``: chosen from the host at start-up.

Where CPU placement placed this rank (``cpus/placement.py``), the workers' CPUs are the most workers
``auto`` runs. Else the CPUs this process may use (its affinity, capped by a cgroup CPU quota: a
container's ``--cpus`` or a Kubernetes CPU limit), shared by the ranks torchrun started on this node;
one of a rank's CPUs is left to the training loop, the rest may decode: that is the most workers
``auto`` runs (``max_workers`` lowers it). It starts with half of them and grows during the first epoch
while the loop waits and CPUs are idle (``tuner.py``). A rank with fewer shards than workers
splits them between its workers (``plan.assign``). Transfer threads: none — ``next()`` issues a
batch's one copy itself and copies ahead, so no other thread of the training process wakes a
batch (DESIGN.md, "The training process's share") — except with ``device_decode`` on CUDA, whose
decode and resize launches one thread takes off the loop's. Each choice is logged with its reasons.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..cpus.host import cpu_quota
from ..cpus.pinning import ProcessPins

AUTO = "auto"


def usable_cpus(root: str = "/", allowed: set[int] | None = None) -> tuple[int, str]:
    """CPUs this process can run on (``allowed``: by default the mask it had before a loader pinned it), capped
    by the cgroup's quota under ``root``, and how that was found."""
    if allowed is not None:
        affinity = len(allowed)
    else:
        try:
            affinity = len(ProcessPins.original())
        except AttributeError:  # not Linux
            affinity = os.cpu_count() or 1
    quota = cpu_quota(root)
    if quota is not None and quota < affinity:
        return max(1, math.floor(quota)), f"a cgroup CPU quota of {quota:g}"
    return affinity, f"{affinity} CPUs in this process's affinity"


@dataclass(frozen=True)
class Choice:
    """What ``auto`` picked for one rank, and why (logged at start-up)."""

    workers: int  # to start with
    most: int  # to grow to
    transfer_threads: int
    reason: str
    local: int = 0  # places below it decode here, the rest on a Ray cluster (remote=); 0: all of them here

    def __post_init__(self) -> None:
        if not self.local:
            object.__setattr__(self, "local", self.most)


def choose(device_type: str, ranks_on_node: int | None = None, max_workers: int | None = None,
           device_decode: bool = False, threads_per_worker: int = 1, placed_cpus: int | None = None,
           remote_most: int = 0) -> Choice:
    """Workers (to start with, and the most) and transfer threads for one rank; ``threads_per_worker``: decode
    threads each worker runs (a video transform's), so that workers x threads fit the rank's CPUs.
    ``placed_cpus``: the CPUs CPU placement gave this rank's workers (the training process keeps its own).
    ``remote_most``: places a Ray cluster may decode (``remote=``), after the local ones: the local CPUs first,
    the cluster for the rest (Pecan's rule), ``max_workers`` capping the total."""
    threads = max(1, threads_per_worker)
    if placed_cpus is not None:
        most = max(1, placed_cpus // threads)
        why = [f"placed: {placed_cpus} CPU(s) for this rank's workers, the training process on cores of its own"]
    else:
        cpus, found = usable_cpus()
        ranks = ranks_on_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        per_rank = max(1, cpus // max(1, ranks))
        most = max(1, (per_rank - 1) // threads)
        why = [f"{found}", f"{ranks} rank(s) on this node: {per_rank} CPU(s) a rank, one left to the training loop"]
    if threads > 1:
        why.append(f"{threads} decode threads a worker")
    local = most  # the places this host's CPUs decode
    if remote_most > 0:
        most = local + remote_most
    if max_workers is not None:
        most = max_workers if remote_most <= 0 else min(most, max_workers)
        local = min(local, most) if remote_most > 0 else most
        why.append(f"max_workers={max_workers}")
    if most > local:
        why.append(f"places {local}..{most - 1} decoded on the Ray cluster, grown into once the {local} here are "
                   f"in use (local first)")
    start = max(1, local // 2)
    why.append(f"starting with {start} of at most {most}, grown during the first epoch while the loop waits")
    transfer = 1 if device_type == "cuda" and device_decode else 0
    why.append(f"{transfer} transfer thread(s)" + (": the batch's decode launched off the loop's thread" if transfer
                                                    else ": next() copies each batch itself"))
    return Choice(start, most, transfer, "; ".join(why), local)


def resolved(workers: int | str, transfer_threads: int | str, device_type: str,
             max_workers: int | None = None, device_decode: bool = False) -> tuple[int, int]:
    """Both settings as numbers, for sizing: ``auto`` replaced by the most ``choose`` would run."""
    pick = choose(device_type, max_workers=max_workers, device_decode=device_decode)
    return (pick.most if workers == AUTO else int(workers),
            pick.transfer_threads if transfer_threads == AUTO else int(transfer_threads))
