"""``EpochCounter``: which epoch the next start reads — the same rule in one process and under torch.distributed.

An epoch starts at its first batch, not at ``iter()``: an iterator never consumed
changes nothing. Each start reads one epoch more than the last start, so epochs
count up on their own, and a loop that breaks early still moves on. ``set_epoch(n)``
names the epoch: every start reads ``n`` until an epoch ``n`` is read to its end,
as ``DistributedSampler.set_epoch`` — a peek at a batch before the ``for`` reads the
named epoch again instead of moving this rank ahead of the others. The ranks agree
on each epoch number once (``RankCoordinator.agree``); a rank that starts that same
epoch again reuses the agreement, so an extra start on one rank costs no collective
the other ranks would have to match.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("feedline.loader")


class EpochCounter:
    """The epoch numbers of one loader: the current one, the next one, a named one, the last agreement."""

    def __init__(self) -> None:
        self.current = -1  # the epoch being read (-1 before the first start)
        self.starts = 0  # epochs started: an iterator of an earlier start is stale
        self._next = 0
        self._named: int | None = None
        self._agreed: tuple[int, int] | None = None  # (epoch, batches every rank yields)
        self.finished = True  # the current epoch was read to its end (or none started): nothing to resume

    @property
    def next(self) -> int:
        """The epoch the next start reads (a loaded state aside: the loader resumes that one)."""
        return self._named if self._named is not None else self._next

    def name(self, epoch: int) -> None:
        """``set_epoch``: starts read ``epoch`` until it is read to its end."""
        self._named = int(epoch)

    def load(self, next_epoch: int) -> None:
        """A loaded state says which epoch comes next; the ranks agree on its batch count afresh."""
        self._next, self._named, self._agreed = int(next_epoch), None, None

    def start(self, epoch: int) -> int:
        """Epoch ``epoch`` starts; the start's number (an iterator of an older start is stale)."""
        if self._named == epoch and self.current == epoch:
            log.info("epoch %d starts again: set_epoch(%d) names it until it is read to its end", epoch, epoch)
        self.current, self._next = epoch, epoch + 1
        self.starts += 1
        self.finished = False
        return self.starts

    def ended(self, epoch: int) -> None:
        """Epoch ``epoch`` was read to its end: a name it had is used up."""
        if self._named == epoch:
            self._named = None
        if epoch == self.current:
            self.finished = True

    def agreed(self, epoch: int) -> int | None:
        """The batch count the ranks agreed on for ``epoch`` when it started before, or None."""
        return self._agreed[1] if self._agreed is not None and self._agreed[0] == epoch else None

    def remember(self, epoch: int, batches: int) -> None:
        self._agreed = (epoch, batches)


class EpochSampler:
    """``loader.sampler``: trainers written for ``DataLoader`` (PyTorch Lightning) call ``set_epoch`` on a loader's
    sampler as each epoch starts; this one passes the number to the loader, so a trainer resumed from the end of an
    epoch (where it loads no loader state) still reads the epoch it counts."""

    def __init__(self, set_epoch: Callable[[int], None]):
        self.set_epoch = set_epoch
