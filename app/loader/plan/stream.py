"""A worker's sample stream for one epoch: its shards by blocks in a seeded permutation, or in order through a
shuffle buffer.

The stream yields sample *references* (shard, offsets), never bytes, so the
shuffle buffer costs no memory per sample and a replacement worker can replay
the stream up to a position without decoding anything.
"""

from __future__ import annotations

import logging
import mmap
import os
import random
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from ...formats.parquet import RECORD, groups_of, row_group_bytes
from ...formats.shard_index import Sample, ShardError, SharedIndexes, load_index
from ...formats.urls import is_parquet
from .epoch_plan import part_indexes, split_groups

log = logging.getLogger("feedline.loader")
T = TypeVar("T")


@dataclass
class OpenShard:
    """A mapped shard and how many of its samples are still to be read (then it is unmapped)."""

    path: str
    ordinal: int  # its place in the worker's shard list
    mm: mmap.mmap | None
    samples: list[Sample]
    pending: int  # samples of this shard not yet finished
    unit_bytes: list[int] = field(default_factory=list)  # a Parquet file's row groups, their sizes once read

    def view(self) -> memoryview:
        assert self.mm is not None
        return memoryview(self.mm)

    def release(self) -> None:
        self.pending -= 1
        if self.pending == 0 and self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a decoded view still lives; the GC closes it
                pass
            self.mm = None


@dataclass
class SampleRef:
    """A sample to read: where it is, never its bytes."""

    pos: int  # position in the stream (after shuffling), 0-based
    shard: OpenShard
    sample: Sample
    index: int  # its place among the shard's samples


@dataclass
class ShardProblem:
    """A shard that yielded nothing: reason is a sample-error label."""

    path: str
    reason: str
    message: str


EAGER_OPEN = 256  # shards a worker opens as soon as its epoch starts
WINDOW_BYTES = 64 << 20  # Parquet row groups mixed at once: half the worker's row-group cache, so each is read once


def open_ahead(shards: list[str] | tuple[str, ...], on_open: Callable[[int], None] | None = None,
               inherited: Mapping[str, int] | None = None) -> dict[str, int]:
    """Open the epoch's first shards at once: a shard evicted later in the epoch still reads whole
    (POSIX unlink semantics); only one evicted between the snapshot and this moment is lost.

    ``inherited`` (a replacement worker's: the trainer's descriptors of the epoch's shards, ``held.py``)
    stands in for a path that is gone, so the replacement reads what the worker it replaces read."""
    fds = {}
    inherited = inherited or {}
    for ordinal, path in enumerate(shards[:EAGER_OPEN]):
        if path in fds:  # read twice in the epoch (a mixture's repeat): the second read opens it again
            continue
        if on_open is not None:
            on_open(ordinal)
        try:
            fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if path in inherited:
                fds[path] = os.dup(inherited[path])  # evicted since the epoch started: the trainer still has it
        except OSError:
            pass  # reported, with its reason, when the stream reaches it
    return fds


def _open(path: str, ordinal: int, fd: int | None, share: SharedIndexes | None = None) -> OpenShard | ShardProblem:
    if fd is None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return ShardProblem(path, "evicted", f"shard {path} was removed before it was opened; skipped")
        except OSError as exc:
            return ShardProblem(path, "bad_shard", f"shard {path}: cannot open: {exc.strerror}; skipped")
    try:
        index = load_index(path, fd, share)
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if index.shard_bytes else None
    except ShardError as exc:
        return ShardProblem(path, "bad_shard", f"{exc}; skipped")
    except (OSError, ValueError) as exc:
        return ShardProblem(path, "bad_shard", f"shard {path}: cannot map: {exc}; skipped")
    finally:
        os.close(fd)  # the mapping keeps the file
    return OpenShard(path, ordinal, mm, index.samples, len(index.samples))


def shuffle_order(groups: Iterable[list[T] | ShardProblem], buffer_size: int, seed: str) -> Iterator[T | ShardProblem]:
    """Items of consecutive groups (a shard's samples) through a seeded shuffle buffer of ``buffer_size``.

    The one shuffle of the project: the workers' streams use it, and so does the replay that finds,
    from a saved state, which samples an interrupted epoch had delivered. A ``ShardProblem`` in
    place of a group passes straight through.
    """
    rng = random.Random(seed)
    buffer: list[T] = []
    for group in groups:
        if isinstance(group, ShardProblem):
            yield group
            continue
        for item in group:
            if buffer_size <= 1:
                yield item
            elif len(buffer) < buffer_size:
                buffer.append(item)
            else:
                k = rng.randrange(len(buffer))
                out, buffer[k] = buffer[k], item
                yield out
    rng.shuffle(buffer)
    yield from buffer


def block_order(groups: Iterable[list[T] | ShardProblem], block: int, seed: str,
                unit_of: Callable[[T], tuple[Hashable, int] | None] | None = None) -> Iterator[T | ShardProblem]:
    """The items of ``block`` consecutive groups at once in a seeded uniform permutation, then the next block's.

    The epoch shuffle (``shuffle=True``): a worker reads its part of every shard of its rank (``epoch_plan``),
    so a block of 256 shards mixes samples of 256 places of the dataset at once — batches look like a uniform
    permutation's however the dataset was written — while at most ``block`` shards are mapped. A
    ``ShardProblem`` passes straight through and takes its place in the block, as its shard would have.
    Items ``unit_of`` puts in one unit of so many bytes (a Parquet row group, decoded whole) are read a window
    at a time: the units in a seeded order, as many at once as ``WINDOW_BYTES`` holds, their items mixed — so
    each row group is decoded once an epoch, and small ones mix as widely as tar samples.
    """
    rng = random.Random(f"{seed}:block")
    items: list[T] = []
    taken = 0
    for group in groups:
        if isinstance(group, ShardProblem):
            yield group
        else:
            items.extend(group)
        taken += 1
        if taken == block:
            yield from _permute(items, unit_of, rng)
            items, taken = [], 0
    yield from _permute(items, unit_of, rng)


def _permute(items: list[T], unit_of: Callable[[T], tuple[Hashable, int] | None] | None,
             rng: random.Random) -> list[T]:
    found = [unit_of(item) for item in items] if unit_of is not None else []
    if not any(found):  # no units (tar, TFRecord): one uniform permutation
        rng.shuffle(items)
        return items
    units: dict[Hashable, list[T]] = {}
    weights: dict[Hashable, int] = {}
    for n, (item, unit) in enumerate(zip(items, found)):
        key = ("item", n) if unit is None else ("unit", unit[0])
        units.setdefault(key, []).append(item)
        weights[key] = 0 if unit is None else unit[1]
    keys = list(units)
    rng.shuffle(keys)
    out: list[T] = []
    window: list[T] = []
    held = 0
    for key in keys:  # row groups in a seeded order, as many at once as WINDOW_BYTES holds, their rows mixed
        if window and held + weights[key] > WINDOW_BYTES:
            rng.shuffle(window)
            out.extend(window)
            window, held = [], 0
        window.extend(units[key])
        held += weights[key]
    rng.shuffle(window)
    out.extend(window)
    return out


def order(groups: Iterable[list[T] | ShardProblem], buffer_size: int, block: int, seed: str,
          unit_of: Callable[[T], tuple[Hashable, int] | None] | None = None) -> Iterator[T | ShardProblem]:
    """The one choice of shuffle: by blocks of shards (``block`` > 0), else through a buffer (``shuffle_order``);
    the workers' streams and the replay of an interrupted epoch both call it."""
    return block_order(groups, block, seed, unit_of) if block > 0 else shuffle_order(groups, buffer_size, seed)


def sample_stream(shards: list[str] | tuple[str, ...], buffer_size: int, seed: str,
                  fds: dict[str, int] | None = None, on_open: Callable[[int], None] | None = None,
                  skip: Mapping[int, Collection[int]] | None = None,
                  parts: Mapping[int, tuple[int, int]] | None = None,
                  block: int = 0, share: SharedIndexes | None = None) -> Iterator[SampleRef | ShardProblem]:
    """Shards in the given order, samples through a seeded shuffle buffer of ``buffer_size`` — or, with ``block``,
    ``block`` shards at a time in a seeded permutation (``block_order``).

    ``fds`` are descriptors opened ahead (``open_ahead``); the stream closes each one it reaches.
    ``on_open(ordinal)`` is told before each shard is opened (a hung filesystem hangs there).
    ``skip`` leaves out, per shard ordinal, the sample indexes delivered before an elastic resume;
    ``parts`` keeps, per shard ordinal split between workers, the indexes ``i % n == k`` of its ``(k, n)``.
    ``share``: the loader's indexes, each built by one of its processes (``workers/index_share.py``).
    """
    fds = fds if fds is not None else {}
    skip = skip or {}
    parts = parts or {}

    def groups() -> Iterator[list[tuple[OpenShard, Sample, int]] | ShardProblem]:
        for ordinal, path in enumerate(shards):
            if on_open is not None:
                on_open(ordinal)
            opened = _open(path, ordinal, fds.pop(path, None), share)
            k, n = parts.get(ordinal, (0, 1))
            if isinstance(opened, ShardProblem):
                yield opened if k == 0 else []  # a shard read in parts is one problem: part 0's worker counts it
                continue
            left = frozenset(skip.get(ordinal, ()))  # tested once a sample: a set, not the plan's tuple
            if (block > 0 or n > 1) and is_parquet(path):  # its row groups' sizes: the windows, and whether a part
                # is whole row groups, from the footer the plan's count reads too (row_groups_of)
                opened.unit_bytes = row_group_bytes(opened.mm if opened.mm is not None else path)
            rows = split_groups(path, groups_of(opened.samples), opened.unit_bytes) \
                if n > 1 and is_parquet(path) else None
            group = [(opened, opened.samples[i], i) for i in part_indexes(path, len(opened.samples), (k, n), rows)
                     if i not in left]
            opened.samples = []  # the group holds what is read: the rest of the index goes (a block holds many)
            opened.pending = len(group)
            if not group:
                opened.pending = 1
                opened.release()  # nothing of it is read: unmap now
            yield group

    pos = 0  # stream positions count samples; problems take none
    def unit_of(item: tuple[OpenShard, Sample, int]) -> tuple[Hashable, int] | None:
        opened, sample, _ = item
        place = sample.fields.get(RECORD)  # a Parquet row: (row group, row)
        if place is None:
            return None
        sizes = opened.unit_bytes
        return (opened.ordinal, place[0]), sizes[place[0]] if place[0] < len(sizes) else 0

    for item in order(groups(), buffer_size, block, seed, unit_of):
        if isinstance(item, ShardProblem):
            yield item
        else:
            yield SampleRef(pos, *item)
            pos += 1
