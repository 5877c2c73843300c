"""Datasets mixed by weight: which samples of each source one epoch draws, and in what shard order.

A mixture is several sources (``Source``: local shards or a sidecar's cache), each with a weight or
an absolute number of samples per epoch. The epoch's length is one pass over the weighted sources'
samples (plus the absolute ones); each weighted source draws its share of it (largest remainder, so
the counts add up exactly). A source drawing more than it holds is read in whole passes, each pass
in its own seeded shard order, then part of one more; one drawing less reads part of a pass. A part
pass takes whole shards in its order and, from the shard at the boundary, a seeded subset of its
samples: every count is exact and no sample repeats inside a pass. The pieces of every source are
then shuffled together with (seed, epoch), so sources interleave along the epoch; the workers'
shuffle buffers mix them within batches.

The result is plain data (``Mixture``): entry keys in epoch order, each naming its shard and source,
and the samples left out of a shard read in part. ``EpochPlan`` splits it by rank and worker like a
shard list, and a resume rebuilds it from the state, never by re-drawing.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import SettingError


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: ``shards=`` (paths, globs, a brace list) or ``cache=`` (a sidecar's cache),
    and its share: ``weight`` (relative to the other weighted sources) or ``samples`` (per epoch)."""

    name: str
    shards: str | os.PathLike | Sequence[str | os.PathLike] | None = None
    cache: str | os.PathLike | None = None
    weight: float | None = None
    samples: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in "\n\r,=:"):
            raise SettingError("sources", f"a source's name must be a non-empty word without ',', '=', ':' or line "
                                          f"breaks (got {self.name!r}); it labels batches and metrics")
        if (self.shards is None) == (self.cache is None):
            raise SettingError("sources", f"source {self.name!r}: give exactly one of shards= or cache=")
        if self.weight is not None and self.samples is not None:
            raise SettingError("sources", f"source {self.name!r}: give a weight or a number of samples per epoch, "
                                          f"not both")
        if self.weight is not None and not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight)
                                            and self.weight >= 0):
            raise SettingError("sources", f"source {self.name!r}: weight={self.weight!r}; a weight is a finite "
                                          f"number >= 0")
        if self.samples is not None and not (isinstance(self.samples, int) and self.samples >= 0):
            raise SettingError("sources", f"source {self.name!r}: samples={self.samples!r}; give a whole number "
                                          f">= 0 of samples per epoch")

    @property
    def share(self) -> float:
        """The weight this source is drawn by (a source given neither weight nor samples weighs 1)."""
        return 1.0 if self.weight is None and self.samples is None else float(self.weight or 0.0)


def check_sources(sources: Sequence[Source]) -> tuple[Source, ...]:
    """The mixture's sources, refused with the fix named when they cannot make an epoch."""
    sources = tuple(sources)
    if not sources:
        raise SettingError("sources", "the list is empty; give at least one Source(name, shards=... or cache=...)")
    for s in sources:
        if not isinstance(s, Source):
            raise SettingError("sources", f"holds a {type(s).__name__}; give feedline.Source(...) objects")
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SettingError("sources", f"the name(s) {twice} are used twice; every source needs its own name")
    if not any(s.share > 0 for s in sources) and not any(s.samples for s in sources):
        raise SettingError("sources", "every weight is 0 and no source has samples=: the epoch would be empty; "
                                      "give at least one source a weight above 0")
    return sources


def shares(sources: Sequence[Source], totals: Sequence[int]) -> list[int]:
    """Samples each source draws this epoch: ``samples`` as given; the weighted ones split one pass over their
    own samples by weight (largest remainder, so the counts add up to it exactly)."""
    out = [s.samples if s.samples is not None else 0 for s in sources]
    weighted = [i for i, s in enumerate(sources) if s.samples is None and s.share > 0]
    length = sum(totals[i] for i in weighted)
    weight = sum(sources[i].share for i in weighted)
    if not weighted or length == 0:
        return out
    exact = {i: length * sources[i].share / weight for i in weighted}
    for i in weighted:
        out[i] = int(exact[i])
    left = length - sum(out[i] for i in weighted)
    for i in sorted(weighted, key=lambda i: (-(exact[i] - int(exact[i])), i))[:left]:
        out[i] += 1
    return out


@dataclass(frozen=True)
class Mixture:
    """One epoch of a mixture, as plain data: entry keys in epoch order (each says what it reads: ``entry``)."""

    names: tuple[str, ...]  # the sources' names, by index
    order: tuple[str, ...]  # entry keys "<source index>:<pass>:<shard path>", in the epoch's order
    skip: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # key -> sample indexes a part pass leaves out
    drawn: tuple[int, ...] = ()  # samples each source gives the epoch

    @staticmethod
    def entry(key: str) -> tuple[int, int, str]:
        """(source index, pass over that source, shard path) of an entry key."""
        source, pass_, path = key.split(":", 2)
        return int(source), int(pass_), path

    def get_state(self) -> dict[str, Any]:
        """The plan's state holds the skips (``EpochPlan.skip``); this, the rest."""
        return {"names": list(self.names), "order": list(self.order), "drawn": list(self.drawn)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "Mixture":
        return cls(tuple(state["names"]), tuple(state["order"]), drawn=tuple(int(n) for n in state.get("drawn", ())))


def _draw(index: int, shards: Sequence[str], want: int, count: Callable[[str], int], seed: int, epoch: int,
          shuffle: bool) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    """(entry keys, key -> left-out indexes): ``want`` samples of one source, in passes."""
    sizes = {p: count(p) for p in shards}
    total = sum(sizes.values())
    picked: list[str] = []
    skip: dict[str, tuple[int, ...]] = {}
    if total == 0 or want == 0:
        return picked, skip
    passes, rest = divmod(want, total)
    for p in range(passes + (1 if rest else 0)):
        order = sorted(shards)
        if shuffle:  # each pass in its own order
            random.Random(f"feedline-mix-shards:{seed}:{epoch}:{index}:{p}").shuffle(order)
        need = total if p < passes else rest
        for path in order:
            if need == 0:
                break
            n = sizes[path]
            if n == 0:
                continue
            key = f"{index}:{p}:{path}"
            picked.append(key)
            if n > need:  # the boundary shard: a seeded subset of its samples
                keep = set(random.Random(f"feedline-mix:{seed}:{epoch}:{index}:{p}").sample(range(n), need))
                skip[key] = tuple(i for i in range(n) if i not in keep)
                n = need
            need -= n
    return picked, skip


def mix_epoch(sources: Sequence[Source], snapshots: Sequence[Sequence[str]], count: Callable[[str], int], *,
              seed: int, epoch: int, shuffle: bool = True) -> Mixture:
    """The epoch's draw from every source (``count(path)``: a shard's samples), interleaved by (seed, epoch)."""
    totals = [sum(count(p) for p in shards) for shards in snapshots]
    drawn = shares(sources, totals)
    order: list[str] = []
    skip: dict[str, tuple[int, ...]] = {}
    for i, shards in enumerate(snapshots):
        picked, left_out = _draw(i, sorted(shards), drawn[i], count, seed, epoch, shuffle)
        if not picked:
            drawn[i] = 0  # nothing to read in it now (an empty cache): the others still make the epoch
        order += picked
        skip.update(left_out)
    if shuffle:
        random.Random(f"feedline-mix:{seed}:{epoch}").shuffle(order)
    return Mixture(tuple(s.name for s in sources), tuple(order), skip, tuple(drawn))
