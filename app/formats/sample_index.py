"""What an index holds, whatever the shard's format: samples, each with its fields' (offset, size) in the file.

``shard_index.py`` builds and stores it for tar shards, ``tfrecord.py`` for TFRecord files; the stream
and the workers read it the same way. Stored as JSON, never pickled.

An index's samples are held as arrays (``SampleTable``: about 50 bytes a sample, not ~600 as objects): every
worker and the sampler hold the indexes of the shards they read, and a shard of a million samples as a list of
``Sample`` objects (a dataclass, a dict, tuples, two strings) is 600 MB. The keys are one byte string, each
sample's field names one of a few layouts (the same extensions, in the same order, sample after sample), and the
members' offsets and sizes two arrays; ``Sample`` objects are made when a sample is read.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO, overload

INDEX_VERSION = 1


# An index costs ~50 bytes of memory a sample (``sample_table.py``), in the sampler and in every worker, and more
# where it is read whole; a shard of millions of empty members (512 bytes of tar header each) would still cost
# gigabytes somewhere. Datasets' shards hold thousands of samples.
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


class LazySamples(Sequence[Sample]):
    """Samples made when asked for, one at a time, from what an index holds compactly (``SampleTable``, Parquet's
    ``RowSamples``): a subclass gives ``__len__`` and ``_sample``."""

    def _sample(self, i: int) -> Sample:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> Sample: ...

    @overload
    def __getitem__(self, i: slice) -> list[Sample]: ...

    def __getitem__(self, i: int | slice) -> Sample | list[Sample]:
        if isinstance(i, slice):
            return [self._sample(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} of {n}")
        return self._sample(i)

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self._sample(i)


class SampleTable(LazySamples):
    """The samples of one shard, in order (built by ``SampleTableBuilder``)."""

    __slots__ = ("_keys", "_key_at", "_layouts", "_layout_of", "_member_at", "_offsets", "_sizes")

    def __init__(self, keys: bytes, key_at: array, layouts: list[tuple[str, ...]], layout_of: array,
                 member_at: array, offsets: array, sizes: array):
        self._keys, self._key_at, self._layouts, self._layout_of = keys, key_at, layouts, layout_of
        self._member_at, self._offsets, self._sizes = member_at, offsets, sizes

    def __len__(self) -> int:
        return len(self._layout_of)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (SampleTable, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SampleTable({len(self)} samples)"

    def _sample(self, i: int) -> Sample:
        key = self._keys[self._key_at[i]:self._key_at[i + 1]].decode("utf-8", "surrogateescape")
        m = self._member_at[i]
        offsets, sizes = self._offsets, self._sizes
        return Sample(key, {ext: (offsets[m + j], sizes[m + j]) for j, ext in enumerate(self._layouts[self._layout_of[i]])})

    def nbytes(self) -> int:
        """The arrays' bytes (what the table holds beyond a few small objects)."""
        return len(self._keys) + sum(a.itemsize * len(a) for a in self._arrays())

    def _arrays(self) -> tuple[array, ...]:
        return self._key_at, self._layout_of, self._member_at, self._offsets, self._sizes

    def to_bytes(self) -> bytes:
        """The table as bytes another process copies back (``from_bytes``) with no parsing: a small JSON head (the
        layouts, the arrays' types and lengths), then the keys and the arrays as they are in memory."""
        head = json.dumps({"layouts": self._layouts, "keys": len(self._keys),
                           "arrays": [[a.typecode, len(a)] for a in self._arrays()]}, separators=(",", ":")).encode()
        return b"".join((struct.pack("<I", len(head)), head, self._keys, *(a.tobytes() for a in self._arrays())))

    @classmethod
    def from_bytes(cls, data: memoryview | bytes) -> "SampleTable":
        """``to_bytes``'s table, copied into arrays of this process; ``ValueError`` for bytes that are not one."""
        try:
            (size,) = struct.unpack_from("<I", data)
            head = json.loads(bytes(data[4:4 + size]))
            at = 4 + size
            keys = bytes(data[at:at + head["keys"]])
            at += len(keys)
            arrays = []
            for typecode, n in head["arrays"]:
                a = array(typecode)
                a.frombytes(data[at:at + n * a.itemsize])
                if len(a) != n:
                    raise ValueError("cut short")
                arrays.append(a)
                at += n * a.itemsize
            layouts = [tuple(str(ext) for ext in layout) for layout in head["layouts"]]
            if len(keys) != head["keys"] or len(arrays) != 5 or at != len(data):
                raise ValueError("sizes disagree")
        except (struct.error, KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a sample table: {exc}") from None
        return cls(keys, arrays[0], layouts, *arrays[1:])


class SampleTableBuilder:
    """Samples appended one at a time (an index being read), then ``build()``."""

    def __init__(self) -> None:
        self._keys = bytearray()
        self._key_at = array("Q", [0])
        self._layouts: list[tuple[str, ...]] = []
        self._layout_ids: dict[tuple[str, ...], int] = {}
        self._layout_of = array("I")
        self._member_at = array("Q")
        self._offsets = array("q")
        self._sizes = array("q")

    def __len__(self) -> int:
        return len(self._layout_of)

    def add(self, key: str, fields: dict[str, tuple[int, int]] | Any) -> None:
        self._keys += key.encode("utf-8", "surrogateescape")
        self._key_at.append(len(self._keys))
        exts = tuple(fields)
        layout = self._layout_ids.get(exts)
        if layout is None:
            layout = self._layout_ids[exts] = len(self._layouts)
            self._layouts.append(exts)
        self._layout_of.append(layout)
        self._member_at.append(len(self._offsets))
        for off, size in fields.values():
            self._offsets.append(off)
            self._sizes.append(size)

    def build(self) -> SampleTable:
        """The table, in the narrowest arrays its numbers fit."""
        return SampleTable(bytes(self._keys), _narrow(self._key_at), self._layouts,
                           _narrow(self._layout_of), _narrow(self._member_at), self._offsets, self._sizes)


def _narrow(a: array) -> array:
    """``a`` as 32-bit unsigned numbers where they fit (they do for any shard an index may hold)."""
    if a.typecode != "I" and (not a or max(a) < 1 << 32):
        return array("I", a)
    return a


def table_of(samples: Sequence[Sample]) -> SampleTable:
    """``samples`` (a list of ``Sample``) as a table."""
    if isinstance(samples, SampleTable):
        return samples
    builder = SampleTableBuilder()
    for s in samples:
        builder.add(s.key, s.fields)
    return builder.build()


@dataclass(frozen=True)
class ShardIndex:
    """Every sample of a shard with its members' offsets: what lets workers slice an mmap."""

    path: str
    shard_bytes: int
    samples: Sequence[Sample]  # a ``SampleTable`` (tar, TFRecord), Parquet's ``RowSamples``, or a list

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
        samples = SampleTableBuilder()
        for key, fields in doc["samples"]:
            samples.add(str(key), {str(ext): (int(off), int(size)) for ext, off, size in fields})
        return cls(path, int(doc["shard_bytes"]), samples.build())


def open_shard(path: str, fd: int | None = None) -> tuple[BinaryIO, int]:
    """The shard's file (through a duplicate of ``fd`` when given: it may be unlinked since) and its size; one
    that cannot be opened is a ``ShardError``."""
    try:
        f = os.fdopen(os.dup(fd), "rb") if fd is not None else open(path, "rb")
    except OSError as exc:
        raise ShardError(path, f"cannot open: {exc.strerror}") from None
    return f, os.fstat(f.fileno()).st_size
