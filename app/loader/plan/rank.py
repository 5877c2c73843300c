"""Which rank of how many this process is: the one place that reads torch.distributed or torchrun's variables."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import SettingError


@dataclass(frozen=True)
class Rank:
    """This process's place among the data-parallel ranks that split each epoch's shards."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise SettingError("rank", f"rank {self.rank} is outside a world of {self.world_size}")

    @classmethod
    def detect(cls, local: bool = False) -> "Rank":
        """torch.distributed when initialised, else torchrun's RANK/WORLD_SIZE, else 0 of 1.

        ``local``: torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE, for a node-local cache that holds
        only this node's partition of the data.
        """
        if local:
            return cls._from_env("LOCAL_RANK", "LOCAL_WORLD_SIZE")
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return cls(dist.get_rank(), dist.get_world_size())
        except ImportError:
            pass
        return cls._from_env("RANK", "WORLD_SIZE")

    @classmethod
    def _from_env(cls, rank_var: str, world_var: str) -> "Rank":
        try:
            rank = int(os.environ.get(rank_var, "0"))
            world = int(os.environ.get(world_var, "1"))
        except ValueError:
            raise SettingError("rank", f"{rank_var}={os.environ.get(rank_var)!r} / {world_var}="
                                       f"{os.environ.get(world_var)!r} are not integers (torchrun sets both)") from None
        if not 0 <= rank < world:
            raise SettingError("rank", f"{rank_var}={rank} is outside {world_var}={world}")
        return cls(rank, world)

    @classmethod
    def launched(cls) -> "Rank | None":
        """The rank a launcher (torchrun) gave this process, or None outside one: for labels, not for splitting."""
        return cls._from_env("RANK", "WORLD_SIZE") if "RANK" in os.environ else None
