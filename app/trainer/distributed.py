"""``feedline train`` under torchrun: one process group, the model in DDP, rank 0 speaking for all.

torchrun (and Kubernetes' indexed Jobs running it) sets ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; a
``WORLD_SIZE`` above 1 makes the run distributed. The process group is NCCL on
GPUs and gloo on CPUs, and is destroyed on every way out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ..api.config import ConfigError
from ..loader.plan import coordinate

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Job:
    """This process's place in the job; a world of 1 is a plain run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def leader(self) -> bool:
        """Rank 0: it prints, writes the summary and the checkpoints."""
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Job":
        try:
            world = int(env.get("WORLD_SIZE", "1"))
        except ValueError:
            raise ConfigError(f"WORLD_SIZE={env['WORLD_SIZE']!r} is not a number of processes") from None
        if world <= 1:
            return cls()
        missing = [v for v in TORCHRUN_VARS if v not in env]
        if missing:
            raise ConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                              f"not set: start the job with torchrun (torchrun --nproc-per-node=N -m feedline train "
                              f"...), which sets them all, or unset WORLD_SIZE for a single process")
        return cls(int(env["RANK"]), world, int(env["LOCAL_RANK"]), int(env.get("LOCAL_WORLD_SIZE", "1")))


@contextlib.contextmanager
def process_group(job: Job, device: torch.device, timeout: float) -> Iterator[None]:
    """The job's process group for the duration of the block (nothing for a plain run)."""
    if not job.distributed:
        yield
        return
    import torch.distributed as dist

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _reduce(values: list[float], op: str) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def all_sum(job: Job, values: list[float]) -> list[float]:
    return _reduce(values, "sum") if job.distributed else list(values)


def all_max(job: Job, values: list[float]) -> list[float]:
    return _reduce(values, "max") if job.distributed else list(values)


def anyone(job: Job, flag: bool) -> bool:
    """True on every rank when it is true on one (a SIGTERM seen by any rank stops all at the same step)."""
    return bool(all_max(job, [float(flag)])[0]) if job.distributed else flag


def gather_json(job: Job, doc: Any) -> list[Any]:
    """Every rank's ``doc`` (plain JSON data), on every rank, over the job's group: never pickled."""
    return coordinate.gather_json(doc, job.world) if job.distributed else [doc]


def barrier(job: Job) -> None:
    if job.distributed:
        import torch.distributed as dist

        dist.barrier()
