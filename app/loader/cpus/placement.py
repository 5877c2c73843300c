"""Which CPUs the training process gets, and which its decode workers: cores of its own for the launching threads.

A GPU step that is launch-bound runs at the speed of the two threads that launch its kernels (the forward on the
loop's thread, the backward on autograd's device thread): a decode worker on their core, or on its hyperthread
sibling, slows the step by the share it takes, while the starvation figure says "fed" (the H100 record: 51 % of
synthetic at 0.7 % starvation). So, within what this rank may use:

1. **The rank's share.** Local ranks that see the same CPUs (a container's cpuset, a whole host) split them
   between them, by cores in NUMA order, so that ranks never overlap; ranks already bound to fewer CPUs than
   the cpuset (torchrun ``--numa-binding``, ``taskset``) split only what they were given with the ranks bound
   alike. Under a CPU quota smaller than the CPUs it sees (``docker --cpus``, a Kubernetes limit without the
   static CPU manager) a container shares its CPUs with others: nothing is pinned there.
2. **The training process** gets ``trainer_cores`` whole cores (both hyperthreads; by default 2 where the share
   has 8 cores or more, else 1), on the GPU's NUMA node first; its transfer threads run there too.
3. **The workers** get the rest, one core each while there are cores (worker ``k`` on the ``k``-th), the GPU's
   node first; a worker past the last core runs on all of the workers' CPUs. ``workers="auto"`` counts only
   these CPUs.

Where nothing can be placed (one core, a quota, more ranks than cores, CPUs other processes claimed) the plan
says why, once, and nothing is pinned. ``cpu_placement="off"`` pins nothing; ``"trainer=0-1;workers=2-15"`` is taken as written
(checked against the CPUs this process may use).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import SettingError
from .host import Host, format_cpus, gpu_node, parse_cpus
from .pinning import ProcessPins, claim, taken_elsewhere

log = logging.getLogger("feedline.loader")

MODES = ("auto", "off")


@dataclass(frozen=True)
class Placement:
    """The plan: the training process's CPUs, the workers' cores; empty ``trainer`` means nothing is pinned."""

    trainer: tuple[int, ...] = ()
    worker_cores: tuple[tuple[int, ...], ...] = ()  # worker k runs on core k; later workers on all of them
    why_not: str = ""  # why nothing is pinned ("" when placed, or when placement is off)
    host: Host | None = None
    share: tuple[tuple[int, ...], ...] = ()  # the rank's cores
    gpu_node: int | None = None  # the GPU's NUMA node, put first (None: no GPU or none known, explicit lists)
    claims: tuple[Any, ...] = field(default=(), compare=False, repr=False)  # the trainer CPUs' claims (pinning.py)

    @property
    def placed(self) -> bool:
        return bool(self.trainer)

    @property
    def worker_cpus(self) -> tuple[int, ...]:
        return tuple(sorted(c for core in self.worker_cores for c in core))

    def worker(self, k: int) -> tuple[int, ...]:
        """The CPUs worker ``k`` runs on (() when nothing is pinned)."""
        if not self.placed:
            return ()
        return self.worker_cores[k] if k < len(self.worker_cores) else self.worker_cpus

    def describe(self) -> str:
        """One line for the log and ``feedline doctor``."""
        if not self.placed:
            return f"CPU placement: none ({self.why_not})" if self.why_not else "CPU placement: off"
        host = self.host
        smt = f", {host.siblings} threads a core" if host is not None and host.siblings > 1 else ""
        quota = f", a quota of {host.quota:g} CPUs" if host is not None and host.quota is not None else ""
        nodes = len(set(host.nodes.values())) if host is not None else 1
        gpu = f", the GPU's NUMA node {self.gpu_node} first" if self.gpu_node is not None and nodes > 1 else ""
        cores = len(self.worker_cores)
        return (f"CPU placement: the training process on {_cpus(self.trainer)}, the workers on "
                f"{_cpus(self.worker_cpus)} ({cores} core{'s' if cores != 1 else ''}, one a worker{smt}{quota}{gpu})")


def _cpus(cpus: tuple[int, ...]) -> str:
    return f"CPU{'s' if len(cpus) != 1 else ''} {format_cpus(cpus)}"


def plan(host: Host, setting: str = "auto", trainer_cores: int | None = None, local_rank: int = 0,
         local_world: int = 1, gpu_node: int | None = None) -> Placement:
    """The placement ``setting`` asks for on ``host`` (see the module's docstring)."""
    setting = setting.strip()
    if setting == "off":
        return Placement(host=host)
    if setting != "auto":
        return _explicit(host, setting)
    if host.quota is not None and host.quota < len(host.allowed):
        return Placement(why_not=f"a CPU quota of {host.quota:g} CPUs over the {len(host.allowed)} this process may "
                                 f"use: other containers' processes run on these CPUs too, and pinning to some would "
                                 f"stack on theirs (give the container a cpuset of its own — Kubernetes' static CPU "
                                 f"manager, docker --cpuset-cpus — or cpu_placement lists)", host=host)
    share, ranks, why = _share(host, local_rank, local_world)
    if why:
        return Placement(why_not=why, host=host)
    share = sorted(share, key=lambda core: (host.node_of(core) != gpu_node if gpu_node is not None else False,
                                            host.node_of(core), core[0]))
    reserve = trainer_cores if trainer_cores is not None else (2 if len(share) >= 8 else 1)
    if reserve < 1:
        raise SettingError("trainer_cores", f"must be at least 1, got {reserve}")
    if len(share) <= reserve:
        return Placement(why_not=f"{len(share)} core{'s' if len(share) != 1 else ''} for this rank, not more than "
                                 f"the {reserve} the training process keeps: nothing left to place the workers on",
                         host=host, share=tuple(share))
    trainer = tuple(sorted(c for core in share[:reserve] for c in core))
    return Placement(trainer, tuple(share[reserve:]), host=host, share=tuple(share), gpu_node=gpu_node)


def _share(host: Host, local_rank: int, local_world: int) -> tuple[list[tuple[int, ...]], int, str]:
    """This local rank's cores, the ranks that split them, and why there are none."""
    cores = sorted(host.cores, key=lambda core: (host.node_of(core), core[0]))
    if len(cores) < 2:
        return [], 1, (f"{len(host.allowed)} CPU{'s' if len(host.allowed) != 1 else ''} ({len(cores)} core): the "
                       f"training process and the workers share it")
    ranks, index = local_world, local_rank
    if local_world > 1 and len(host.allowed) < len(host.cpuset):  # bound already: split with the ranks bound alike
        ranks = max(1, round(local_world * len(host.allowed) / len(host.cpuset)))
        index = local_rank % ranks
    if ranks == 1:
        return cores, 1, ""
    each = len(cores) // ranks
    if each < 2:
        return [], ranks, (f"{len(cores)} cores for {ranks} local ranks: fewer than 2 a rank, so the training "
                           f"processes and their workers share them")
    return cores[index * each:(index + 1) * each], ranks, ""


def _parse(setting: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``trainer=0-1;workers=2-15`` (either order) as its two CPU lists; ValueError (the reason) unless both are
    named, apart."""
    parts: dict[str, tuple[int, ...]] = {}
    for item in setting.split(";"):
        name, eq, cpus = item.partition("=")
        name = name.strip()
        if not eq or name not in ("trainer", "workers") or name in parts:
            raise ValueError("give 'auto', 'off', or CPU lists as 'trainer=0-1;workers=2-15'")
        try:
            parts[name] = parse_cpus(cpus)
        except ValueError as exc:
            raise ValueError(f"{exc} (CPU lists are like 0-3,8)") from None
    if set(parts) != {"trainer", "workers"} or not all(parts.values()):
        raise ValueError("name both sides, as 'trainer=0-1;workers=2-15'")
    both = sorted(set(parts["trainer"]) & set(parts["workers"]))
    if both:
        raise ValueError(f"CPUs {format_cpus(both)} are on both sides; the training process's CPUs are its own")
    return parts["trainer"], parts["workers"]


def parse_setting(setting: Any) -> str:
    """The setting, stripped, once its form is right; ValueError with the reason (``Config`` names the setting and
    its value)."""
    if not isinstance(setting, str):
        raise ValueError("give 'auto', 'off', or CPU lists as 'trainer=0-1;workers=2-15'")
    setting = setting.strip()
    if setting not in MODES:
        _parse(setting)
    return setting


def check_setting(setting: Any) -> str:
    """``parse_setting`` for the library: a SettingError naming the setting (the CPUs themselves are checked
    against the host later)."""
    try:
        return parse_setting(setting)
    except ValueError as exc:
        raise SettingError("cpu_placement", f"{setting!r}: {exc}") from None


def _explicit(host: Host, setting: str) -> Placement:
    """The CPU lists as written, checked against the CPUs this process may use."""
    trainer, workers = _parse(check_setting(setting))
    outside = sorted(set(trainer + workers) - set(host.allowed))
    if outside:
        raise SettingError("cpu_placement", f"{setting!r}: CPUs {format_cpus(outside)} are not among those this "
                                            f"process may use ({format_cpus(host.allowed)})")
    mine = set(workers)
    cores = tuple(dict.fromkeys(tuple(c for c in core if c in mine) for core in host.cores
                                if any(c in mine for c in core)))
    return Placement(trainer, cores, host=host)


def for_this_process(setting: str, trainer_cores: int | None, on_device: bool = False,
                     gpu_index: int | None = None) -> Placement:
    """The plan for this process, with its claims: its host, its local rank (torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``), the GPU's NUMA node (``gpu_index``: its CUDA device, ``cuda_index``); logged once.

    ``auto`` places a loader that feeds a device (CUDA, or the stand-in): its launching threads are what the
    cores are kept for; a loader whose batches stay on the CPU is left where it is (a CPU training step runs
    on every core its threads may use). A later loader of a process shares the first one's plan. A rank takes
    its own slice of the cores, or the first slice whose training-process CPUs no other process claimed (ranks
    not numbered in NUMA order, a restarted rank); a process alone on CPUs that another one claimed places
    itself on the rest."""
    if setting == "off":
        return Placement()
    if ProcessPins.plan is not None:
        return ProcessPins.plan  # type: ignore[no-any-return]
    if setting == "auto" and not on_device:
        return Placement(why_not="the batches stay on the CPU: a CPU training step runs on every core its threads "
                                 "may use (placement keeps cores for a GPU's launching threads; give CPU lists to "
                                 "place anyway)")
    try:
        host = Host.read("/", ProcessPins.original())
        rank, world = _local_rank()
    except (OSError, AttributeError, ValueError) as exc:  # not Linux, a /proc it cannot read, LOCAL_RANK=x
        return _logged(Placement(why_not=f"this host's CPUs cannot be read ({exc})"))
    node = gpu_node(index=gpu_index) if gpu_index is not None else None
    out = plan(host, setting, trainer_cores, rank, world, node)
    if not out.placed:
        return _logged(out)
    tries = [rank, *(r for r in range(world) if r != rank)] if setting == "auto" else [rank]
    for r in tries:  # the rank's own slice first
        p = out if r == rank else plan(host, setting, trainer_cores, r, world, node)
        claims = claim(p.trainer) if p.placed else None
        if claims is not None:
            return _logged(replace(p, claims=tuple(claims)))
    taken = taken_elsewhere(host.allowed)
    if setting == "auto" and taken:  # alone on the CPUs others claimed: the rest, as one share
        p = plan(host.without(taken), setting, trainer_cores, 0, 1, node)
        claims = claim(p.trainer) if p.placed else None
        if claims is not None:
            return _logged(replace(p, claims=tuple(claims)))
    return _logged(Placement(why_not=f"CPUs {format_cpus(sorted(taken or out.trainer))} are the training processes' "
                                     f"of other processes here, and what is left does not place this one",
                             host=host))


def _local_rank() -> tuple[int, int]:
    world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return min(max(0, int(os.environ.get("LOCAL_RANK", "0") or 0)), world - 1), world


def _logged(p: Placement) -> Placement:
    log.info("%s", p.describe())
    return p
