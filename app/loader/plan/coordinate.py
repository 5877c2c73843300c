"""Ranks of a torch.distributed job agree on each epoch and on how many batches every rank yields.

Under DDP every rank must run the same number of steps, or the last gradient
all-reduce waits for a rank that has run out of data, forever. Shards split by
rank rarely hold the same number of samples, so before each epoch the ranks
exchange their epoch and their batch count (from the shard indexes) over a
process group of their own (gloo, beside the training's group, so the
exchange never interleaves with the training's collectives), and each rank then
yields the same number: the smallest (``drop``: the few extra batches of the
other ranks wait for the next epoch's shuffle) or the largest (``pad``: ranks
with fewer repeat their last batch). The exchange happens at an epoch's first
batch, once per epoch number (``epochs.py``): a rank that reads the same epoch
again (a peek before the loop) does not exchange again. Ranks that meet with
different epoch numbers — one named another with ``set_epoch``, or took batches
of an extra epoch — all get one clear error naming the numbers, instead of
training on overlapping data.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from ..errors import LoaderError

log = logging.getLogger("feedline.loader")

MODES = ("drop", "pad", "off")


class RankCoordinator:
    """The loader's own process group; ``agree`` is one small all-gather per epoch."""

    def __init__(self, mode: str):
        import torch.distributed as dist

        self.mode = mode
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._group = dist.new_group(backend="gloo")  # every rank builds its loaders in the same order

    @staticmethod
    def wanted(mode: str) -> bool:
        """A process group of more than one rank is up, and equal batches were not turned off."""
        try:
            import torch.distributed as dist
        except ImportError:
            return False
        return mode != "off" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def agree(self, epoch: int, batches: int) -> int:
        """The number of batches every rank yields this epoch; a LoaderError if the ranks are in different epochs."""
        import torch.distributed as dist

        mine = torch.tensor([epoch, batches], dtype=torch.int64)
        everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self._group)
        epochs = [int(t[0]) for t in everyone]
        counts = [int(t[1]) for t in everyone]
        if len(set(epochs)) > 1:
            raise LoaderError(
                f"the ranks are in different epochs ({', '.join(f'rank {r}: {e}' for r, e in enumerate(epochs))}): "
                f"epochs count up at each epoch's first batch, on every rank alike; a rank that named another "
                f"epoch with loader.set_epoch(n), or took batches of an extra epoch (a peek at a batch without "
                f"set_epoch), is out of step — call loader.set_epoch(epoch) with the same number on every rank, "
                f"or on none")
        target = min(counts) if self.mode == "drop" else max(counts)
        if min(counts) != max(counts):
            log.info("epoch %d: the ranks have %s batches; every rank yields %d (equal_batches=%s)", epoch,
                     "/".join(map(str, counts)), target, self.mode)
        return target

    def gather(self, doc: Any) -> list[Any]:
        """Every rank's ``doc`` over the loader's group (``state_dict`` under torch.distributed): a collective."""
        return gather_json(doc, self.world, self._group)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group(self._group)
            except (RuntimeError, ValueError):
                pass


def gather_json(doc: Any, world: int, group: Any = None) -> list[Any]:
    """Every rank's ``doc`` (plain JSON data), on every rank, as bytes over ``group`` (None: the default group):
    never pickled, unlike ``all_gather_object``. A collective: every rank of the group calls it. The loader's
    state under torch.distributed and the demo trainer's summaries both go through it."""
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    padded = torch.zeros(int(max(int(n) for n in sizes)), dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(o[: int(n)].numpy().tobytes()) for o, n in zip(out, sizes)]
