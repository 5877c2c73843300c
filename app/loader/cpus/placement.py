"""Which CPUs the training process gets, and which its decode workers: cores of its own for the launching threads.

A GPU step that is launch-bound runs at the speed of the two threads that launch its kernels (the forward on the
loop's thread, the backward on autograd's device thread): a decode worker on their core, or on its hyperthread
sibling, slows the step by the share it takes, while the starvation figure says "fed" (the H100 record: 51 % of
synthetic at 0.7 % starvation). So, within what this rank may use:

1. **The rank's share.** Local ranks that see the same CPUs (a container's cpuset, a whole host) split them
   between them, by cores in NUMA order, so that ranks never overlap; ranks already bound to fewer CPUs than
   the cpuset (torchrun ``--numa-binding``, ``taskset``) split only what they were given with the ranks bound
   alike. A CPU quota smaller than the share keeps as many cores as it can run at once.
2. **The training process** gets ``trainer_cores`` whole cores (both hyperthreads; by default 2 where the share
   has 8 cores or more, else 1), on the GPU's NUMA node first; its transfer threads run there too.
3. **The workers** get the rest, one core each while there are cores (worker ``k`` on the ``k``-th), the GPU's
   node first; a worker past the last core runs on all of the workers' CPUs. ``workers="auto"`` counts only
   these CPUs.

Where nothing can be placed (one core, a quota under two CPUs, more ranks than cores) the plan says why, once,
and nothing is pinned. ``cpu_placement="off"`` pins nothing; ``"trainer=0-1;workers=2-15"`` is taken as written
(checked against the CPUs this process may use).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from ...errors import SettingError
from .host import Host, format_cpus, gpu_node, parse_cpus
from .pinning import ProcessPins

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

    def cpus_for_workers(self, total: int) -> int:
        """CPUs ``workers="auto"`` may fill: the workers' share when placed, else ``total``."""
        return len(self.worker_cpus) if self.placed else total

    def describe(self) -> str:
        """One line for the log and ``feedline doctor``."""
        if not self.placed:
            return f"CPU placement: none ({self.why_not})" if self.why_not else "CPU placement: off"
        host = self.host
        smt = f", {host.siblings} threads a core" if host is not None and host.siblings > 1 else ""
        quota = f", a quota of {host.quota:g} CPUs" if host is not None and host.quota is not None else ""
        cores = len(self.worker_cores)
        return (f"CPU placement: the training process on {_cpus(self.trainer)}, the workers on "
                f"{_cpus(self.worker_cpus)} ({cores} core{'s' if cores != 1 else ''}, one a worker{smt}{quota})")


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
    share, ranks, why = _share(host, local_rank, local_world)
    if why:
        return Placement(why_not=why, host=host)
    if host.quota is not None:  # the cgroup's: the local ranks that share the CPUs share it too
        share, why = _within_quota(share, host.quota / ranks)
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
    return Placement(trainer, tuple(share[reserve:]), host=host, share=tuple(share))


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


def _within_quota(share: list[tuple[int, ...]], quota: float) -> tuple[list[tuple[int, ...]], str]:
    """The cores a CPU quota can keep busy at once (its CPUs, rounded up, whole cores)."""
    if quota < 2:
        return [], f"a CPU quota of {quota:g} CPUs: less than one for the training process and one for the workers"
    need, kept = math.ceil(quota), []
    for core in share:
        if sum(len(c) for c in kept) >= need:
            break
        kept.append(core)
    return kept, ""


def _parse(setting: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``trainer=0-1;workers=2-15`` (either order) as its two CPU lists; refused unless both are named, apart."""
    parts: dict[str, tuple[int, ...]] = {}
    for item in setting.split(";"):
        name, eq, cpus = item.partition("=")
        name = name.strip()
        if not eq or name not in ("trainer", "workers") or name in parts:
            raise SettingError("cpu_placement", f"{setting!r}: give 'auto', 'off', or CPU lists as "
                                                f"'trainer=0-1;workers=2-15'")
        try:
            parts[name] = parse_cpus(cpus)
        except ValueError as exc:
            raise SettingError("cpu_placement", f"{setting!r}: {exc} (CPU lists are like 0-3,8)") from None
    if set(parts) != {"trainer", "workers"} or not all(parts.values()):
        raise SettingError("cpu_placement", f"{setting!r}: name both sides, as 'trainer=0-1;workers=2-15'")
    both = sorted(set(parts["trainer"]) & set(parts["workers"]))
    if both:
        raise SettingError("cpu_placement", f"{setting!r}: CPUs {format_cpus(both)} are on both sides; the "
                                            f"training process's CPUs are its own")
    return parts["trainer"], parts["workers"]


def check_setting(setting: Any) -> str:
    """The setting, stripped, once its form is right (the CPUs themselves are checked against the host later)."""
    if not isinstance(setting, str):
        raise SettingError("cpu_placement", f"must be 'auto', 'off' or CPU lists as 'trainer=0-1;workers=2-15', "
                                            f"got {setting!r}")
    setting = setting.strip()
    if setting not in MODES:
        _parse(setting)
    return setting


def _explicit(host: Host, setting: str) -> Placement:
    """The CPU lists as written, checked against the CPUs this process may use."""
    trainer, workers = _parse(setting)
    outside = sorted(set(trainer + workers) - set(host.allowed))
    if outside:
        raise SettingError("cpu_placement", f"{setting!r}: CPUs {format_cpus(outside)} are not among those this "
                                            f"process may use ({format_cpus(host.allowed)})")
    mine = set(workers)
    cores = tuple(dict.fromkeys(tuple(c for c in core if c in mine) for core in host.cores
                                if any(c in mine for c in core)))
    return Placement(trainer, cores, host=host)


def for_this_process(setting: str, trainer_cores: int | None, device: Any = None) -> Placement:
    """The plan for this process: its host, its local rank (torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``),
    the GPU's NUMA node where ``device`` is a CUDA one; logged once."""
    if setting == "off":
        return Placement()
    try:
        host = Host.read("/")
    except (OSError, AttributeError, ValueError) as exc:  # not Linux, or a /proc it cannot read
        out = Placement(why_not=f"this host's CPUs cannot be read ({exc})")
        log.info("%s", out.describe())
        return out
    node = gpu_node() if getattr(device, "type", None) == "cuda" else None
    out = plan(host, setting, trainer_cores, int(os.environ.get("LOCAL_RANK", "0") or 0),
               int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), node)
    if out.placed and not ProcessPins.claimable(out.trainer):
        out = Placement(why_not=f"CPUs {format_cpus(out.trainer)} are another process's training process's (it "
                                f"placed itself there first): this one is not placed", host=host)
    log.info("%s", out.describe())
    return out
