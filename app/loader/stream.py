"""A worker's sample stream for one epoch: its shards, in order, through a shuffle buffer.

The stream yields sample *references* (shard, offsets), never bytes, so the
shuffle buffer costs no memory per sample and a replacement worker can replay
the stream up to a position without decoding anything.
"""

from __future__ import annotations

import logging
import mmap
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

from ..formats.shard_index import Sample, ShardError, load_index

log = logging.getLogger("feedline.loader")


@dataclass
class OpenShard:
    path: str
    mm: mmap.mmap | None
    samples: list[Sample]
    pending: int  # samples of this shard not yet finished

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
    pos: int  # position in the stream (after shuffling), 0-based
    shard: OpenShard
    sample: Sample


@dataclass
class ShardProblem:
    """A shard that yielded nothing: reason is a sample-error label."""

    path: str
    reason: str
    message: str


EAGER_OPEN = 256  # shards a worker opens as soon as its epoch starts


def open_ahead(shards: list[str]) -> dict[str, int]:
    """Open the epoch's first shards at once: a shard evicted later in the epoch still reads whole
    (POSIX unlink semantics); only one evicted between the snapshot and this moment is lost."""
    fds = {}
    for path in shards[:EAGER_OPEN]:
        try:
            fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass  # reported, with its reason, when the stream reaches it
    return fds


def _open(path: str, fd: int | None) -> OpenShard | ShardProblem:
    if fd is None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return ShardProblem(path, "evicted", f"shard {path} was removed before it was opened; skipped")
        except OSError as exc:
            return ShardProblem(path, "bad_shard", f"shard {path}: cannot open: {exc.strerror}; skipped")
    try:
        index = load_index(path, fd)
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if index.shard_bytes else None
    except ShardError as exc:
        return ShardProblem(path, "bad_shard", f"{exc}; skipped")
    except (OSError, ValueError) as exc:
        return ShardProblem(path, "bad_shard", f"shard {path}: cannot map: {exc}; skipped")
    finally:
        os.close(fd)  # the mapping keeps the file
    return OpenShard(path, mm, index.samples, len(index.samples))


def sample_stream(shards: list[str], buffer_size: int, seed: str,
                  fds: dict[str, int] | None = None) -> Iterator[SampleRef | ShardProblem]:
    """Shards in the given order, samples through a seeded shuffle buffer of ``buffer_size``.

    ``fds`` are descriptors opened ahead (``open_ahead``); the stream closes each one it reaches.
    """
    rng = random.Random(seed)
    buffer: list[tuple[OpenShard, Sample]] = []
    pos = 0
    fds = fds if fds is not None else {}
    for path in shards:
        opened = _open(path, fds.pop(path, None))
        if isinstance(opened, ShardProblem):
            yield opened
            continue
        for sample in opened.samples:
            if buffer_size <= 1:
                yield SampleRef(pos, opened, sample)
                pos += 1
                continue
            if len(buffer) < buffer_size:
                buffer.append((opened, sample))
                continue
            i = rng.randrange(len(buffer))
            shard, out = buffer[i]
            buffer[i] = (opened, sample)
            yield SampleRef(pos, shard, out)
            pos += 1
    rng.shuffle(buffer)
    for shard, out in buffer:
        yield SampleRef(pos, shard, out)
        pos += 1
