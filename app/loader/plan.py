"""Which shards each rank and worker reads in an epoch: seeded, reproducible, disjoint."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int

    @classmethod
    def detect(cls, local: bool = False) -> "Rank":
        """torch.distributed when initialised, else torchrun's RANK/WORLD_SIZE, else 0 of 1.

        ``local``: torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE, for a node-local cache that holds
        only this node's partition of the data.
        """
        if local:
            rank = int(os.environ.get("LOCAL_RANK", "0"))
            world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            if not 0 <= rank < world:
                raise ValueError(f"LOCAL_RANK={rank} is outside LOCAL_WORLD_SIZE={world}")
            return cls(rank, world)
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return cls(dist.get_rank(), dist.get_world_size())
        except ImportError:
            pass
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
        return cls(rank, world)


def epoch_order(shards: list[str], seed: int, epoch: int, shuffle: bool = True) -> list[str]:
    """The epoch's shard order: the same (seed, epoch) gives the same order on every rank."""
    ordered = sorted(shards)
    if shuffle:
        random.Random(f"feedline-shards:{seed}:{epoch}").shuffle(ordered)
    return ordered


def split(shards: list[str], index: int, count: int) -> list[str]:
    """Every ``count``-th shard starting at ``index``: disjoint parts that cover the list."""
    return shards[index::count]


def worker_shards(shards: list[str], seed: int, epoch: int, rank: Rank, worker: int, workers: int,
                  shuffle: bool = True) -> list[str]:
    return split(split(epoch_order(shards, seed, epoch, shuffle), rank.rank, rank.world_size), worker, workers)


def stream_seed(seed: int, epoch: int, rank: int, worker: int) -> str:
    """Seed of a worker's sample shuffle buffer and its transforms' randomness."""
    return f"feedline-samples:{seed}:{epoch}:{rank}:{worker}"
