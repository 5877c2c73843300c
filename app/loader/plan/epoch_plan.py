"""``EpochPlan``: which shards each worker of this rank reads in one epoch — seeded, reproducible, disjoint.

The plan is a value: the same (shards, seed, epoch, rank, workers) give the same
plan on every rank and every run, so it can be described, stored and rebuilt.
A worker receives its part as a ``WorkerPlan`` (JSON on the wire, never pickled),
with the stream position to resume from after a restart.

A rank with fewer shards than workers splits each shard into ``n`` parts —
part ``k`` is the samples whose index ``i`` has ``i % n == k``, read through the
shard's index, no copy — with ``n`` chosen so that every worker gets the same
share of every shard: a few large shards still keep every core busy. A Parquet
file is split by whole row groups instead (``part_indexes``): a row group is
decoded whole, so rows of one group in two workers would be decoded twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ...formats.parquet import groups_of, row_group_bytes
from ...formats.shard_index import ShardError, SharedIndexes, load_index
from ...formats.urls import is_parquet
from .mixture import Mixture
from .rank import Rank

T = TypeVar("T")


def epoch_order(shards: list[str] | tuple[str, ...], seed: int, epoch: int, shuffle: bool = True) -> list[str]:
    """The epoch's shard order: the same (seed, epoch) gives the same order on every rank."""
    ordered = sorted(shards)
    if shuffle:
        random.Random(f"feedline-shards:{seed}:{epoch}").shuffle(ordered)
    return ordered


def split(items: list[T], index: int, count: int) -> list[T]:
    """Every ``count``-th item starting at ``index``: disjoint parts that cover the list."""
    return items[index::count]


Part = tuple[int, int]  # (k, n): the samples i of a shard with i % n == k
WHOLE: Part = (0, 1)


def in_part(index: int, part: Part) -> bool:
    return index % part[1] == part[0]


def part_size(samples: int, part: Part) -> int:
    """How many of a shard's ``samples`` indexes fall in ``part``."""
    k, n = part
    return max(0, (samples - k + n - 1) // n)


GROUP_SPLIT_ROW_BYTES = 16 << 10  # rows this large on average: a Parquet file is split by row groups


def part_indexes(path: str, count: int, part: Part, groups: Sequence[int] | None = None) -> Sequence[int]:
    """The sample indexes of a shard that ``part`` reads: ``i % n == k``; or, with ``groups`` (each row's row group,
    ``split_groups``), whole row groups: group ``g`` is in part ``k`` when ``(g + h) % n == k``, ``h`` a hash of the
    path, so files of one row group each do not all go to part 0."""
    k, n = part
    if n == 1:
        return range(count)
    if groups is None:
        return range(k, count, n)
    h = zlib.crc32(path.encode())
    return [i for i, g in enumerate(groups[:count]) if (g + h) % n == k]


def split_groups(path: str, rows: Sequence[int], sizes: Sequence[int]) -> Sequence[int] | None:
    """``rows`` (each row's row group) when a Parquet file's parts should be whole row groups, else None.

    A row group is decoded whole, so a row split puts every group in every worker: decoded ``n`` times. That
    costs little for small rows (and mixes an epoch better: every worker sees every group); for large rows
    (images, tensors: at least ``GROUP_SPLIT_ROW_BYTES`` on average) decoding is the cost, so groups are split."""
    if not is_parquet(path) or not rows:
        return None
    return rows if sum(sizes) >= GROUP_SPLIT_ROW_BYTES * len(rows) else None


def row_groups_of(path: str) -> Sequence[int] | None:
    """``split_groups`` of a Parquet file on disk (its index and footer); a ShardError if it cannot be read."""
    if not is_parquet(path):
        return None
    return split_groups(path, groups_of(load_index(path).samples), row_group_bytes(path))


def assign(mine: list[str], workers: int) -> tuple[tuple[tuple[str, ...], ...], tuple[tuple[Part, ...], ...]]:
    """(per worker, its shards in reading order; and the part of each it reads).

    With at least as many shards as workers, every ``workers``-th shard, whole. With fewer, every shard
    is split into ``workers / gcd(shards, workers)`` parts and worker ``w`` reads part ``w`` of each
    shard it is given: the same share of every shard for every worker (3 shards, 8 workers: each reads
    an eighth of each shard).
    """
    if len(mine) >= workers or not mine:
        return (tuple(tuple(split(mine, w, workers)) for w in range(workers)),
                tuple(tuple(WHOLE for _ in split(mine, w, workers)) for w in range(workers)))
    n = workers // math.gcd(len(mine), workers)
    pieces = [(path, (k, n)) for path in mine for k in range(n)]
    mine_w = [split(pieces, w, workers) for w in range(workers)]
    return (tuple(tuple(path for path, _ in ps) for ps in mine_w),
            tuple(tuple(part for _, part in ps) for ps in mine_w))


def interleave(mine: list[str], workers: int) -> tuple[tuple[tuple[str, ...], ...], tuple[tuple[Part, ...], ...]]:
    """The epoch shuffle's split: every worker reads part ``w`` (``i % workers == w``) of every shard of the rank, in
    the same order, so each worker's blocks (``stream.block_order``) draw from the whole of the rank's epoch."""
    return (tuple(tuple(mine) for _ in range(workers)),
            tuple(tuple(WHOLE if workers == 1 else (w, workers) for _ in mine) for w in range(workers)))


def as_ranges(indexes: Sequence[int]) -> list[list[int]]:
    """Sample indexes as ``[first, last + 1]`` runs: what a state and a worker's plan hold of the samples left out
    (those delivered before an elastic resume are mostly runs: a shard is read from its start)."""
    runs: list[list[int]] = []
    for i in sorted(set(indexes)):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def from_ranges(value: Sequence[Any]) -> tuple[int, ...]:
    """The indexes of ``as_ranges``'s runs, or of a plain list of indexes (states saved before runs)."""
    out: list[int] = []
    for item in value:
        if isinstance(item, (list, tuple)):
            first, stop = int(item[0]), int(item[1])
            out.extend(range(first, stop))
        else:
            out.append(int(item))
    return tuple(out)


def shards_digest(shards: Sequence[str]) -> str:
    """What a state keeps of a shard list (DESIGN.md, "Scale"): the sorted names' SHA-256, so that a state is
    kilobytes whatever the shard count, and a list given back at load is checked to be the one the plan split."""
    h = hashlib.sha256()
    for name in sorted(shards):
        h.update(name.encode("utf-8", "surrogateescape"))
        h.update(b"\n")
    return h.hexdigest()


def stream_seed(seed: int, epoch: int, rank: int, worker: int) -> str:
    """Seed of a worker's sample shuffle buffer and its transforms' randomness."""
    return f"feedline-samples:{seed}:{epoch}:{rank}:{worker}"


@dataclass(frozen=True)
class WorkerPlan:
    """One worker's part of an epoch, and where in its sample stream to (re)start."""

    epoch: int
    seed: int
    rank: int
    worker: int
    shards: tuple[str, ...]
    resume: int = 0  # samples of the stream already delivered: skip them
    poison: tuple[int, ...] = ()  # stream positions that crashed a worker twice: skip and count
    skip: dict[int, tuple[int, ...]] = field(default_factory=dict)  # shard ordinal -> sample indexes left out
    parts: dict[int, Part] = field(default_factory=dict)  # shard ordinal -> the part read (absent: whole)
    run: int = -1  # the pool's token for this start of the epoch (fills and results carry it); -1: the epoch
    labels: tuple[str, ...] = ()  # per shard ordinal, its source's name (a mixture; else empty)
    repeats: tuple[int, ...] = ()  # per shard ordinal, its pass over its source (a mixture; else empty)

    def __post_init__(self) -> None:
        if self.run < 0:
            object.__setattr__(self, "run", self.epoch)

    @property
    def stream_seed(self) -> str:
        return stream_seed(self.seed, self.epoch, self.rank, self.worker)

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "seed": self.seed, "rank": self.rank, "worker": self.worker,
                           "shards": list(self.shards), "resume": self.resume, "poison": list(self.poison),
                           "skip": {str(k): as_ranges(v) for k, v in self.skip.items()},
                           "parts": {str(k): list(v) for k, v in self.parts.items()}, "run": self.run,
                           "labels": list(self.labels), "repeats": list(self.repeats)})

    @classmethod
    def from_json(cls, text: str | bytes) -> "WorkerPlan":
        d = json.loads(text)
        return cls(int(d["epoch"]), int(d["seed"]), int(d["rank"]), int(d["worker"]), tuple(d["shards"]),
                   int(d["resume"]), tuple(int(p) for p in d["poison"]),
                   {int(k): from_ranges(v) for k, v in d.get("skip", {}).items()},
                   {int(k): (int(v[0]), int(v[1])) for k, v in d.get("parts", {}).items()}, int(d.get("run", -1)),
                   tuple(str(x) for x in d.get("labels", ())), tuple(int(x) for x in d.get("repeats", ())))


@dataclass(frozen=True)
class EpochPlan:
    """This rank's epoch: the shard snapshot, its seeded order, and each worker's share of it.

    The plan splits *entries*: one source's shards are entries named by their paths; a mixture's are its
    draw's keys (``mixture.py``: a shard read twice in an epoch is two entries), each naming its shard.
    """

    epoch: int
    seed: int
    rank: Rank
    shuffle: bool
    shards: tuple[str, ...]  # the snapshot every rank split (sorted)
    assignment: tuple[tuple[str, ...], ...]  # per worker, entries in reading order
    parts: tuple[tuple[Part, ...], ...]  # per worker, the part of each entry of its assignment (``assign``)
    skip: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # per entry: delivered before, or not drawn
    mixture: Mixture | None = None
    interleaved: bool = False  # the epoch shuffle: every worker reads its part of every shard (``interleave``)
    # the files this rank's shards are read from where they are not the shards themselves: a compressed shard's
    # plain copy (``PathSource.local_files``, made for the rank's own shards only); not part of the state
    files: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    _groups: dict[str, Sequence[int] | None] = field(default_factory=dict, compare=False, repr=False)  # Parquet rows'
    _digest: list[str] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def make(cls, shards: list[str] | tuple[str, ...], *, epoch: int, seed: int, rank: Rank, workers: int,
             shuffle: bool = True, skip: Mapping[str, tuple[int, ...]] | None = None,
             mixture: Mixture | None = None, interleaved: bool = False,
             ordered: Sequence[str] | None = None) -> "EpochPlan":
        """``ordered``: the epoch's order when the caller has it (``epoch_order`` of these arguments): the plans of
        many ranks of one epoch (an elastic resume's) order the shards once."""
        order = (list(mixture.order) if mixture is not None else list(ordered) if ordered is not None
                 else epoch_order(shards, seed, epoch, shuffle))
        mine = split(order, rank.rank, rank.world_size)
        assignment, parts = interleave(mine, workers) if interleaved else assign(mine, workers)
        left_out = {**(mixture.skip if mixture is not None else {}), **(skip or {})}
        return cls(epoch, seed, rank, shuffle, tuple(sorted(shards)), assignment, parts, left_out, mixture,
                   interleaved)

    def path_of(self, entry: str) -> str:
        """The shard an entry reads."""
        return Mixture.entry(entry)[2] if self.mixture is not None else entry

    def file_of(self, path: str) -> str:
        """The file a shard is read from: its plain copy (``files``), or the shard itself."""
        return self.files.get(path, path)

    def reading(self, files: Mapping[str, str]) -> "EpochPlan":
        """This plan with the files its rank's shards are read from (see ``files``)."""
        return dataclasses.replace(self, files=dict(files), _groups={}, _digest=list(self._digest))

    def source_of(self, entry: str) -> str | None:
        """The name of the source an entry belongs to (None: not a mixture)."""
        return self.mixture.names[Mixture.entry(entry)[0]] if self.mixture is not None else None

    @property
    def workers(self) -> int:
        return len(self.assignment)

    @property
    def rank_shards(self) -> int:
        """Shards this rank reads in the epoch."""
        return len(self.own_paths())

    def batches(self, batch_size: int, drop_last: bool, counts: Mapping[str, int] | None = None,
                share: SharedIndexes | None = None) -> int:
        """Batches this rank yields in the epoch, from the shard indexes: without ``drop_last`` each worker's
        last, partial batch counts as one; samples skipped as corrupt would make it fewer.

        ``counts`` (samples per shard path, from a cache's manifest as the epoch started) win over the
        indexes: a shard the sidecar evicted since then still counts what the epoch planned, so a state
        taken after the eviction never reads an unfinished epoch as finished. An index read here is left in
        ``share`` (the loader's): its workers copy it instead of parsing it again.
        """
        total = 0
        for shards, parts in zip(self.assignment, self.parts):
            n = 0
            for entry, part in zip(shards, parts):
                path = self.path_of(entry)
                groups = None
                if part != WHOLE and is_parquet(path):  # split by row groups: which rows, from its index
                    try:
                        groups = self._groups[path] if path in self._groups else row_groups_of(self.file_of(path))
                        self._groups[path] = groups
                    except ShardError:
                        pass
                if counts is not None and path in counts:
                    count = counts[path]
                elif groups is not None:
                    count = len(groups)
                else:
                    try:
                        count = len(load_index(self.file_of(path), share=share).samples)
                    except ShardError:
                        continue
                members = part_indexes(path, count, part, groups)
                skipped = self.skip.get(entry, ())
                n += len(members) - (sum(1 for i in skipped if in_part(i, part)) if groups is None
                                     else len(set(skipped) & set(members)))
            total += n // batch_size if drop_last else -(-n // batch_size)
        return total

    def for_worker(self, worker: int, resume: int = 0, poison: tuple[int, ...] | list[int] = (),
                   run: int = -1) -> WorkerPlan:
        mine = self.assignment[worker]
        skip = {k: self.skip[entry] for k, entry in enumerate(mine) if self.skip.get(entry)}
        parts = {k: part for k, part in enumerate(self.parts[worker]) if part != WHOLE}
        labels = tuple(self.source_of(e) or "" for e in mine) if self.mixture is not None else ()
        repeats = tuple(Mixture.entry(e)[1] for e in mine) if self.mixture is not None else ()
        return WorkerPlan(self.epoch, self.seed, self.rank.rank, worker,
                          tuple(self.file_of(self.path_of(e)) for e in mine),
                          resume, tuple(sorted(poison)), skip, parts, run, labels, repeats)

    def describe(self) -> str:
        shares = "/".join(str(len(a)) for a in self.assignment)
        split_ = next((f", each shard in {n} parts" for ps in self.parts for _, n in ps if n > 1), "")
        if self.interleaved:
            split_ += ", the epoch shuffled by blocks of shards"
        mix = ""
        if self.mixture is not None:
            mix = ", drawing " + ", ".join(f"{n} {name}" for name, n in zip(self.mixture.names, self.mixture.drawn))
        return (f"epoch {self.epoch}, rank {self.rank.rank} of {self.rank.world_size}: {self.rank_shards} of "
                f"{len(self.shards)} shards{split_}, workers read {shares}, seed {self.seed}"
                f"{'' if self.shuffle else ', unshuffled'}{mix}")

    def get_state(self, with_shards: bool = True) -> dict[str, Any]:
        """Plain data from which ``from_state`` rebuilds this plan exactly (the assignment is derived).

        The shard list is kept by its digest and count; the names themselves only ``with_shards`` (the loader
        decides: ``StagingLoader._keeps_names``). ``from_state`` needs them: ``resume.py`` puts back the list
        the digest names. Of the samples left out, only those of this rank's own entries (the
        rest are other ranks' to keep: an elastic resume takes every rank's state)."""
        mine = {entry for a in self.assignment for entry in a}
        return {"epoch": self.epoch, "seed": self.seed, "rank": self.rank.rank, "world_size": self.rank.world_size,
                "shuffle": self.shuffle, "interleaved": self.interleaved, "workers": self.workers,
                "shards_digest": self.digest, "shards_count": len(self.shards),
                **({"shards": list(self.shards)} if with_shards else {}),
                "skip": {entry: as_ranges(v) for entry, v in self.skip.items() if entry in mine},
                **({"mixture": self.mixture.get_state()} if self.mixture is not None else {})}

    @property
    def digest(self) -> str:
        """``shards_digest`` of the snapshot, computed once a plan."""
        if not self._digest:  # (the plan is frozen: a one-item list holds it)
            self._digest.append(shards_digest(self.shards))
        return self._digest[0]

    def own_paths(self) -> set[str]:
        """The shards this rank reads in the epoch."""
        return {self.path_of(entry) for a in self.assignment for entry in a}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], ordered: Sequence[str] | None = None) -> "EpochPlan":
        return cls.make(state["shards"], epoch=int(state["epoch"]), seed=int(state["seed"]), ordered=ordered,
                        rank=Rank(int(state["rank"]), int(state["world_size"])), workers=int(state["workers"]),
                        shuffle=bool(state["shuffle"]),
                        skip={entry: from_ranges(v) for entry, v in state.get("skip", {}).items()},
                        mixture=Mixture.from_state(state["mixture"]) if state.get("mixture") else None,
                        interleaved=bool(state.get("interleaved", False)))
