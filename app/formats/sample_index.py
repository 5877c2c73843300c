"""What an index holds, whatever the shard's format: samples, each with its fields' (offset, size) in the file.

``shard_index.py`` builds and stores it for tar shards, ``tfrecord.py`` for TFRecord files; the stream
and the workers read it the same way. Stored as JSON, never pickled.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import BinaryIO

INDEX_VERSION = 1


# An index costs ~400 bytes of memory a sample, in the sampler and in every worker: a shard of millions of empty
# members (512 bytes of tar header each) would cost gigabytes. Datasets' shards hold thousands of samples.
MAX_SAMPLES = 1 << 20
TOO_MANY = (f"holds more than {MAX_SAMPLES:,} samples, past what one shard's index may hold: write smaller shards "
            f"(`feedline make-shards --shard-size`)")


class ShardError(Exception):
    """A shard that cannot be read at all (not a tar, truncated, unreadable)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"shard {path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class Sample:
    """One sample: its key and, per field extension, the member's (offset, size)."""

    key: str
    fields: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class ShardIndex:
    """Every sample of a shard with its members' offsets: what lets workers slice an mmap."""

    path: str
    shard_bytes: int
    samples: list[Sample]

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": INDEX_VERSION,
                "shard_bytes": self.shard_bytes,
                "samples": [
                    [s.key, [[ext, off, size] for ext, (off, size) in s.fields.items()]]
                    for s in self.samples
                ],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, path: str, text: str) -> "ShardIndex":
        doc = json.loads(text)
        if doc.get("version") != INDEX_VERSION:
            raise ValueError(f"unsupported index version {doc.get('version')!r}")
        samples = [
            Sample(key, {ext: (int(off), int(size)) for ext, off, size in fields})
            for key, fields in doc["samples"]
        ]
        return cls(path, int(doc["shard_bytes"]), samples)


def open_shard(path: str, fd: int | None = None) -> tuple[BinaryIO, int]:
    """The shard's file (through a duplicate of ``fd`` when given: it may be unlinked since) and its size; one
    that cannot be opened is a ``ShardError``."""
    try:
        f = os.fdopen(os.dup(fd), "rb") if fd is not None else open(path, "rb")
    except OSError as exc:
        raise ShardError(path, f"cannot open: {exc.strerror}") from None
    return f, os.fstat(f.fileno()).st_size
