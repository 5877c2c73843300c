"""The member index of one tar shard, grouped into WebDataset samples (a TFRecord file's: ``tfrecord.py``; a
Parquet file's: ``parquet.py``).

Workers ``mmap`` a shard and slice members by offset; the index is what lets
them do that without parsing tar headers on the hot path. It is built once per
shard (by the sampler when it publishes, or lazily by a worker) and stored as
JSON next to the shard as ``<id>.idx`` for ``<id>.tar`` — never pickled.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import tarfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from typing import Protocol

from . import listing, parquet, tar_headers, tfrecord
from .files import atomic_write
from .sample_index import (  # noqa: F401 (Sample: the loader imports it from here)
    MAX_SAMPLES, TOO_MANY, Sample, SampleTable, SampleTableBuilder, ShardError, ShardIndex)

log = logging.getLogger("feedline.formats")

INDEX_SUFFIX = ".idx"
# A worker opens each of its shards again every epoch: the indexes it read or built are kept, up to this many samples
# in all (some 55 bytes each as arrays: ~29 MiB, what 65,536 samples of Python objects took), for the file they were
# made from: same device, inode, size, modification and change times.
MEMO_SAMPLES = 1 << 19

# webdataset's rules (tariterators.base_plus_ext, tar_file_iterator), to the letter: the key is the
# path up to the first dot of the last component; the rest (possibly with more dots, "seg.png") is the
# extension, lowercased. Top-level "__name__" members and paths starting "__...__/" are metadata.
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")


def split_key(name: str) -> tuple[str, str] | None:
    """Split a member name into (key, extension); None for names without one, and for metadata."""
    if _META.match(name) or ("/" not in name and name.startswith("__") and name.endswith("__")):
        return None
    m = _KEY_EXT.match(name)
    if m is None:
        return None
    return m.group(1), m.group(2).lower()


@contextlib.contextmanager
def _open_tar(path: str, fd: int | None) -> Iterator[tarfile.TarFile]:
    """The tar at ``path``, or read through a duplicate of ``fd`` (closed here; ``fd`` stays open)."""
    if fd is None:
        with tarfile.open(path, mode="r:") as tar:
            yield tar
        return
    with os.fdopen(os.dup(fd), "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
        yield tar


def _headers(path: str, fd: int | None) -> Generator[tar_headers.Member, None, int]:
    """The members from the headers read directly (``tar_headers``); ``Unusual`` where ``tarfile`` should."""
    with open(path, "rb") if fd is None else os.fdopen(os.dup(fd), "rb") as f:  # fd: the file, even if unlinked since
        if os.fstat(f.fileno()).st_size == 0:
            raise tar_headers.Unusual("an empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data, memoryview(data) as view:
            return (yield from tar_headers.members(view))


def _tarfile_members(path: str, fd: int | None) -> Generator[tar_headers.Member, None, int]:
    """The regular members as ``tarfile`` reads them, and where they end."""
    with _open_tar(path, fd) as tar:
        while (info := tar.next()) is not None:
            tar.members.clear()  # tarfile keeps every header it read (440 B each): a shard of tiny members
            if info.isfile():  # would hold gigabytes of them; the index keeps what it needs
                yield tar_headers.Member(info.name, info.offset_data, info.size)
        return tar.offset


def _samples(path: str, shard_bytes: int, walk: Generator[tar_headers.Member, None, int]) -> SampleTable:
    """The members grouped into samples (webdataset's keys), the file checked whole."""
    samples = SampleTableBuilder()
    key: str | None = None
    fields: dict[str, tuple[int, int]] = {}
    while True:
        try:
            name, offset, size = next(walk)
        except StopIteration as done:
            end = done.value
            break
        if offset + size > shard_bytes:
            raise ShardError(path, f"truncated: member {name!r} needs bytes up to {offset + size}, the file has "
                                   f"{shard_bytes}")
        parts = split_key(name)
        if parts is None:
            continue
        k, ext = parts
        if k != key or ext in fields:
            if key is not None and fields:
                samples.add(key, fields)
                if len(samples) > MAX_SAMPLES:
                    raise ShardError(path, TOO_MANY)
            key, fields = k, {}
        fields[ext] = (offset, size)
    if shard_bytes < end + tarfile.BLOCKSIZE:
        # Every complete archive ends with zero blocks; a cut at a member boundary has none.
        raise ShardError(path, f"truncated: no end-of-archive marker after byte {end}")
    if key is not None and fields:
        samples.add(key, fields)
    return samples.build()


def build_index(path: str, fd: int | None = None, fmt: str | None = None) -> ShardIndex:
    """Scan the tar headers of ``path`` (ustar, GNU and pax all read the same), a TFRecord file's record
    headers (``tfrecord.py``) or a Parquet file's footer (``parquet.py``): the name's suffix, or ``fmt``'s (the
    shard a plain copy was made from), says which.

    With ``fd``, an already open descriptor of it is read: the file may have been
    unlinked (evicted) since, and still reads whole.
    """
    if tfrecord.is_tfrecord(fmt or path):
        return tfrecord.build_index(path, fd, fmt)
    if parquet.is_parquet(fmt or path):
        return parquet.build_index(path, fd, fmt)
    try:
        shard_bytes = os.fstat(fd).st_size if fd is not None else os.stat(path).st_size
    except OSError as exc:
        raise ShardError(path, f"cannot stat: {exc.strerror}") from None
    try:
        try:
            with contextlib.closing(_headers(path, fd)) as walk:  # its mapping ends here, whatever is raised
                samples = _samples(path, shard_bytes, walk)
        except tar_headers.Unusual:
            with contextlib.closing(_tarfile_members(path, fd)) as walk:
                samples = _samples(path, shard_bytes, walk)
    except tarfile.TarError as exc:
        raise ShardError(path, f"not a readable tar file ({exc})") from None
    except OSError as exc:
        raise ShardError(path, f"read failed: {exc}") from None
    if not samples and shard_bytes > 0:
        raise ShardError(path, "holds no samples (no member has a key.extension name)")
    return ShardIndex(path, shard_bytes, samples)


def index_path(shard_path: str) -> str:
    """``shards/<id>.tar`` -> ``shards/<id>.idx`` (DESIGN.md's cache layout)."""
    base, ext = os.path.splitext(shard_path)
    return (base if ext == ".tar" else shard_path) + INDEX_SUFFIX


def write_index(index: ShardIndex, dest: str | None = None, mode: int = 0o644) -> str:
    """Write the index atomically (temp + rename) so readers never see half of it. Beside a dataset's shards it
    is as readable as they are (``mode``, less the umask); the cache writes its own private (``FILE_MODE``)."""
    dest = dest or index_path(index.path)
    atomic_write(dest, index.to_json(), mode=mode)
    return dest


class _Memo:
    """The indexes a process read or built last, by the identity of their file (a file replaced is a new one)."""

    def __init__(self, max_samples: int = MEMO_SAMPLES):
        self.max_samples = max_samples
        self._kept: OrderedDict[tuple[str, int, int, int, int, int], ShardIndex] = OrderedDict()
        self._samples = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int, int, int, int, int]) -> ShardIndex | None:
        with self._lock:
            index = self._kept.get(key)
            if index is not None:
                self._kept.move_to_end(key)
            return index

    def put(self, key: tuple[str, int, int, int, int, int], index: ShardIndex) -> None:
        with self._lock:
            if key in self._kept or len(index.samples) > self.max_samples:
                return
            self._kept[key] = index
            self._samples += len(index.samples)
            while self._samples > self.max_samples:
                self._samples -= len(self._kept.popitem(last=False)[1].samples)


_MEMO = _Memo()


class SharedIndexes(Protocol):
    """Where the processes of one loader leave the indexes they built for each other (the loader's
    ``workers/index_share.py``), by the identity of the file."""

    def find(self, identity: tuple[str, int, int, int, int, int]) -> ShardIndex | bool | None:
        """The index left for the file; False: it could not be (build it here); None: not yet."""

    def building(self, identity: tuple[str, int, int, int, int, int]) -> contextlib.AbstractContextManager[None]:
        """Held while building it: the others wait for it."""

    def put(self, identity: tuple[str, int, int, int, int, int], index: ShardIndex | None) -> None:
        """Leave it (None: the mark that it is not shared)."""


def load_index(path: str, fd: int | None = None, share: SharedIndexes | None = None) -> ShardIndex:
    """The index of the shard as it is now: kept from an earlier call, stored beside it (``.idx``, when it matches
    the shard's size) or a fresh scan (of ``fd`` if given). The shard is opened once and asked everything through
    that descriptor: on a shared filesystem a path's ``stat`` or ``open`` is a round trip to its metadata server.
    With ``share``, an index another process built is copied from there, and one built here is left there (one
    build a shard for all of a loader's processes; a Parquet file's footer is read by each)."""
    own = None
    if fd is None:
        try:
            own = fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO: opened, never waited on
        except OSError:
            return _load_index(path, None)  # the error names the shard
    try:
        try:
            st = os.fstat(fd)
        except OSError as exc:  # (a descriptor a worker opened ahead, gone bad): the shard is named, as for an open
            raise ShardError(path, f"cannot read it: {exc.strerror or exc}") from None
        key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        index = _MEMO.get(key)
        shared = share is not None and not parquet.is_parquet(path)
        if index is None:
            index = _shared(share, key, lambda: _load_index(path, fd, st.st_size)) if shared else \
                _load_index(path, fd, st.st_size)
            _MEMO.put(key, index)
        elif shared:  # read before without the share (a mixture's count, a replay): the others need not read it
            _offer(share, key, index)
        return index
    finally:
        if own is not None:
            os.close(own)


def _shared(share: SharedIndexes, identity: tuple[str, int, int, int, int, int],
            load: Callable[[], ShardIndex]) -> ShardIndex:
    """From ``share``, else built here (while another process of the loader waits for it) and left there; where
    the share cannot help (it failed, or the index could not be left), built here as without it."""
    try:
        found = share.find(identity)
        if found is None:
            with share.building(identity):
                found = share.find(identity)  # built by another while this one waited
                if found is None:
                    try:
                        index = load()
                    except ShardError:
                        share.put(identity, None)  # the others find it unreadable at once, not one after another
                        raise
                    _offer(share, identity, index)  # (a failure there loses nothing: it is built)
                    return index
    except OSError as exc:  # (a lock the kernel refused, a descriptor closed): no error of the shard's
        log.debug("the shared index of %s: %s; building it here", identity[0], exc)
        found = False
    return found if isinstance(found, ShardIndex) else load()


def _offer(share: SharedIndexes, identity: tuple[str, int, int, int, int, int], index: ShardIndex) -> None:
    """Leave an index this process had already read (without the share) where the others will look."""
    try:
        share.put(identity, index)  # (nothing written where it is there already)
    except OSError as exc:
        log.debug("the shared index of %s: %s", identity[0], exc)


def _load_index(path: str, fd: int | None, size: int | None = None) -> ShardIndex:
    idx = index_path(path)
    if not listing.index_absent(idx):  # a folder listed here without it: no open to find out
        try:
            with open(idx) as f:
                index = ShardIndex.from_json(path, f.read())
            if size is None:
                size = os.fstat(fd).st_size if fd is not None else os.stat(path).st_size
            if index.shard_bytes == size:
                return index
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return build_index(path, fd)
