"""The shard indexes a rank's processes share: each index parsed (or its tar scanned) once, then copied.

Under the epoch shuffle every worker reads its part of every shard of the rank (``epoch_plan.interleave``), and a
worker given other shards next epoch meets them anew: without sharing, each of W workers parses every index of the
rank (a JSON index ~2.4 µs a sample, a tar's headers ~20 µs), W times the work. Here the first process to need a
shard's index builds it and leaves its table (``SampleTable.to_bytes``, ~50 bytes a sample) in one region; the
others copy it back (~20 ns a sample) instead. The trainer, which counts its shards' samples as an epoch starts,
is usually that first process.

The region is an anonymous memfd, like the ring's: no name in ``/dev/shm``, made by the trainer, inherited by
the workers, freed by the kernel with its last holder, so no exit leaves it behind. It holds an append-only run of
records (a table, by the identity of the file it was made from: path, device, inode, size, times, so a file
replaced is a new one) after a header (where the records end, a generation, two counters). A copy is taken, never
a view, so when the next table does not fit, the region starts over (a new generation) with nothing to wait for.

Locks are POSIX record locks on the memfd (held per process: the processes share the open file, not its locks;
a process that dies lets go of its own): byte 0 guards the records, byte ``1 + k`` the building of the table
whose identity's digest is ``k`` (56 bits: no two shards share one), so a process that needs an index another is
building waits for it instead of building it too. A process holds at most one building lock (its threads take
turns), and takes byte 0 only briefly inside it: no cycle. A table that cannot be shared (larger than the
region, or a shard that cannot be read) leaves a mark instead, so those waiting build it themselves at once;
and a lock or a read that fails here (the kernel's deadlock check can be wrong about threads) is no error: the
index is built where it is needed, as without the share (``shard_index._shared``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import struct
import threading
from collections.abc import Iterator
from typing import Any

from ...formats.sample_index import SampleTable, ShardIndex

log = logging.getLogger("feedline.loader")

CAPACITY = 32 << 20  # bytes of tables at most (~600,000 samples); pages are only taken as tables are written
_HEADER = struct.Struct("<QQQQ")  # where the records end, the generation, tables built, tables copied
_START = 64  # the first record
_RECORD = struct.Struct("<Q16sQ")  # its length (all of it), the identity's digest, the shard's bytes; the table
_UNSHARED = (1 << 64) - 1  # the shard's bytes of a mark: no table follows (it could not be shared)

Identity = tuple[str, int, int, int, int, int]  # path, device, inode, size, mtime_ns, ctime_ns


def _digest(identity: Identity) -> bytes:
    return hashlib.sha256(repr(identity).encode("utf-8", "surrogateescape")).digest()[:16]


class IndexShare:
    """One loader's shared index tables; the trainer's instance (``create``) owns the memfd, a worker's
    (``attach``) maps nothing and holds only its inherited descriptor."""

    def __init__(self, fd: int, capacity: int, owner: bool):
        self.fd = fd
        self.capacity = capacity
        self._owner = owner
        self._lock = threading.Lock()  # POSIX locks are a process's: threads of one take turns here (byte 0)
        self._building = threading.Lock()  # ... and here, for the building locks
        self._generation = -1
        self._scanned = _START  # records up to here are in ``_where``
        self._where: dict[bytes, tuple[int, int]] = {}  # digest -> (offset, length) of its record

    @classmethod
    def create(cls, capacity: int = CAPACITY) -> "IndexShare":
        fd = os.memfd_create("feedline-indexes", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity)  # sparse: tmpfs pages come as tables are written
            os.pwrite(fd, _HEADER.pack(_START, 0, 0, 0), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, capacity, owner=True)

    @classmethod
    def attach(cls, d: dict[str, Any]) -> "IndexShare":
        """A worker's, from ``to_json`` on its command line (the descriptor inherited at its number; not passed on
        to a process the worker's own code starts, which would keep the memory after the loader closed)."""
        fd = int(d["fd"])
        os.set_inheritable(fd, False)
        return cls(fd, int(d["capacity"]), owner=False)

    def to_json(self) -> dict[str, Any]:
        return {"fd": self.fd, "capacity": self.capacity}

    @contextlib.contextmanager
    def _locked(self, byte: int = 0) -> Iterator[None]:
        with self._lock if byte == 0 else self._building:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, byte)
            try:
                yield
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, byte)

    def building(self, identity: Identity) -> contextlib.AbstractContextManager[None]:
        """Held while this process builds ``identity``'s index: another that needs it waits, then finds it."""
        return self._locked(1 + int.from_bytes(_digest(identity)[:7], "little"))

    def _scan(self) -> tuple[int, int, int, int]:
        """(the header, read under byte 0) with every record up to its end noted in ``_where``."""
        end, generation, built, copied = _HEADER.unpack(os.pread(self.fd, _HEADER.size, 0))
        if generation != self._generation:  # started over since: what was read of it is gone
            self._generation, self._scanned = generation, _START
            self._where.clear()
        while self._scanned < end:
            length, seen, shard_bytes = _RECORD.unpack(os.pread(self.fd, _RECORD.size, self._scanned))
            if length < _RECORD.size:  # (none is written: a bug) the rest is not read
                raise OSError(f"a record of {length} bytes at {self._scanned}")
            self._where[seen] = (self._scanned, length if shard_bytes != _UNSHARED else 0)
            self._scanned += length
        return end, generation, built, copied

    def find(self, identity: Identity) -> ShardIndex | bool | None:
        """A copy of the index another process left for this file; False where one could not leave it (build it
        here); None where none has yet."""
        digest = _digest(identity)
        with self._locked():
            end, generation, built, copied = self._scan()
            place = self._where.get(digest)
            if place is None or place[1] == 0:
                return None if place is None else False
            data = os.pread(self.fd, place[1], place[0])
            os.pwrite(self.fd, _HEADER.pack(end, generation, built, copied + 1), 0)
        _, _, shard_bytes = _RECORD.unpack_from(data)
        try:
            table = SampleTable.from_bytes(memoryview(data)[_RECORD.size:])
        except ValueError as exc:  # (written by a process of this loader: a bug, not bad data) built anew
            log.warning("the shared index of %s does not read back (%s); building it here", identity[0], exc)
            return False
        return ShardIndex(identity[0], shard_bytes, table)

    def put(self, identity: Identity, index: ShardIndex | None) -> None:
        """Leave ``index`` for the others (a table of a tar or TFRecord shard); None, a Parquet file's index (its
        footer, read by each) or a table larger than the region leaves the mark that it is not shared. Past the
        capacity the region starts over."""
        digest = _digest(identity)
        samples = index.samples if index is not None else None
        table = isinstance(samples, SampleTable)
        with self._locked():
            end, generation, built, copied = self._scan()
            there = self._where.get(digest)
            if there is not None and (there[1] or not table):  # there already (left by another, or offered again:
                return  # load_index's memo); only a table replaces a mark (left by a read that failed)
            record = _RECORD.pack(_RECORD.size, digest, _UNSHARED)
            if index is not None and isinstance(samples, SampleTable):
                data = samples.to_bytes()
                if _START + _RECORD.size + len(data) <= self.capacity:
                    record = _RECORD.pack(_RECORD.size + len(data), digest, index.shard_bytes) + data
            if there is not None and len(record) == _RECORD.size:  # (a table too large: the mark stays as it is)
                return
            if end + len(record) > self.capacity:
                log.debug("the shared shard indexes are full (%d bytes): starting over", end)
                end, generation = _START, generation + 1
            os.pwrite(self.fd, record, end)  # then the header: a process that dies in between left nothing
            os.pwrite(self.fd, _HEADER.pack(end + len(record), generation, built + (len(record) > _RECORD.size),
                                            copied), 0)

    def counts(self) -> tuple[int, int]:
        """(tables built and left here, tables copied from here) since the start: what the sharing saved."""
        with self._locked():
            _, _, built, copied = _HEADER.unpack(os.pread(self.fd, _HEADER.size, 0))
        return built, copied

    def close(self) -> None:
        """The trainer's: its descriptor closed (the memory goes with the last worker's)."""
        if self._owner and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "IndexShare":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
