"""Compressed shards (``.tar.gz``, ``.tgz``, ``.tar.zst``, ``.tfrecord.gz``) become plain files once, so workers
can mmap them.

A worker slices members out of a mapped shard by offset; a compressed stream has
no offsets to slice. So a compressed shard is decompressed once — by the sampler
before it publishes (the cache budget counts the uncompressed bytes), or by the
loader into a directory of decompressed copies for ``shards=`` — and read as the
plain tar (or TFRecord file) it holds. ``zstd`` needs the ``zstandard`` package (``pip install zstandard``).
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO

from . import tfrecord
from .files import TMP_MARK, create_new, fsync_dir
from .shard_index import ShardError, build_index, index_path, write_index
from .urls import compression, plain_suffix, shard_stem

log = logging.getLogger("feedline.formats")

CHUNK = 1 << 20


def _reader(f: IO[bytes], kind: str) -> IO[bytes]:
    if kind == "gzip":
        return gzip.GzipFile(fileobj=f, mode="rb")
    if kind == "zstd":
        try:
            import zstandard
        except ImportError:
            raise ShardError(getattr(f, "name", "?"), "a .tar.zst shard needs the zstandard package: "
                                                      "pip install zstandard") from None
        return zstandard.ZstdDecompressor().stream_reader(f)
    raise ValueError(f"unknown compression {kind!r}")


class TooLarge(ShardError):
    """A compressed shard that holds more than the room it may take."""


class _Holey:
    """Copies a stream of framed items (a header, then data), leaving the data of items larger than ``bound`` as
    holes: every offset stays where the stream put it, so the index and the workers see the item (and skip it,
    counted, for its size), but a gigabyte of zeros in a few megabytes of gzip takes no room (a sparse file,
    tmpfs included). A subclass says how long a header is and what follows it (``_framed``)."""

    HEADER = 512

    def __init__(self, out: IO[bytes], bound: int):
        self.out, self.bound = out, bound
        self.head = b""  # the part of a header read so far
        self.copy = 0  # bytes of the current item's data still to write
        self.hole = 0  # ... or to leave as a hole
        self.holes = 0

    def write(self, chunk: bytes) -> None:
        view, pos = memoryview(chunk), 0
        while pos < len(view):
            if self.copy:
                n = min(self.copy, len(view) - pos)
                self.out.write(view[pos : pos + n])
                self.copy -= n
            elif self.hole:
                n = min(self.hole, len(view) - pos)
                self.out.seek(n, os.SEEK_CUR)
                self.hole -= n
            else:
                n = min(self.HEADER - len(self.head), len(view) - pos)
                self.head += bytes(view[pos : pos + n])
                if len(self.head) == self.HEADER:
                    self.out.write(self.head)
                    data, big = self._framed(self.head)
                    if big:
                        self.hole, self.holes = data, self.holes + 1
                    else:
                        self.copy = data
                    self.head = b""
            pos += n

    def _framed(self, header: bytes) -> tuple[int, bool]:
        """(the bytes of data after ``header``, whether they are past the bound: left as a hole)."""
        raise NotImplementedError

    def close(self) -> None:
        self.out.write(self.head)  # a header cut short: the index says the file is truncated
        self.out.truncate(self.out.tell())  # a hole at the end still counts in the file's size


class _HoleyTar(_Holey):
    """A tar stream: members past the bound are holes; headers, pax and long-name records, links as they are."""

    def _framed(self, header: bytes) -> tuple[int, bool]:
        field = header[124:136]
        if field[0] & 0x80:  # base-256 (GNU), for sizes past 8 GiB
            size = int.from_bytes(field[1:], "big")
        else:
            digits = field.split(b"\0", 1)[0].strip(b" ")
            size = int(digits, 8) if digits and all(48 <= c <= 55 for c in digits) else 0
        padded = (size + 511) // 512 * 512
        return padded, size > self.bound and header[156:157] in (b"0", b"\0", b"7")  # a regular file's data


class _HoleyRecords(_Holey):
    """A TFRecord stream: each record's 12-byte header (its length, and the length's CRC) is written, its data
    and data CRC left a hole past the bound. A hole only ever stands for bytes the stream held: a header whose
    length lies (its CRC does not match) leaves the rest of the copy a hole, and the index refuses the file for
    that CRC, as it would the plain file."""

    HEADER = tfrecord.HEADER.size

    def _framed(self, header: bytes) -> tuple[int, bool]:
        (length, _) = tfrecord.HEADER.unpack(header)
        return length + tfrecord.TRAILER, length > self.bound


def decompress(src: str, dest: str, kind: str, max_bytes: int | None = None,
               stopped: Callable[[], bool] | None = None, member_bound: int | None = None,
               records: bool = False) -> int:
    """Write the tar (with ``records``, the TFRecord file) inside ``src`` to ``dest`` (fsynced); its size.

    A broken stream is a ``ShardError``, more than ``max_bytes`` a ``TooLarge``; a failure to write
    ``dest`` (a full disk) stays an ``OSError``: that is the destination's fault, not the shard's.
    ``stopped()`` is asked between chunks; when it says so, the copy is abandoned (``InterruptedError``).
    ``member_bound``: tar members (TFRecord records) larger than it are written as holes (``_HoleyTar``,
    ``_HoleyRecords``), so a few megabytes of gzip holding a gigabyte of zeros take no room.
    """
    written = 0
    try:
        with open(src, "rb") as f, _reader(f, kind) as r, create_new(dest) as out:  # never through a link
            sink: IO[bytes] | _Holey = out
            if member_bound is not None:
                sink = _HoleyRecords(out, member_bound) if records else _HoleyTar(out, member_bound)
            while True:
                try:
                    chunk = r.read(CHUNK)
                except Exception as exc:  # OSError, EOFError, zlib's and zstandard's errors
                    raise ShardError(src, f"not a readable {kind} stream: {exc}") from None
                if not chunk:
                    break
                written += len(chunk)
                if max_bytes is not None and written > max_bytes:
                    raise TooLarge(src, f"decompresses to more than {max_bytes} bytes, the room it may take")
                if stopped is not None and stopped():
                    raise InterruptedError(f"decompressing {src} was stopped")
                sink.write(chunk)
            if isinstance(sink, _Holey):
                sink.close()
                if sink.holes:
                    log.warning("%s: %d %s larger than max_member_bytes=%d left out of its plain copy (skipped and "
                                "counted when read)", src, sink.holes, "record(s)" if records else "member(s)",
                                member_bound)
            out.flush()
            os.fsync(out.fileno())
            return written
    except BaseException:
        try:
            os.unlink(dest)
        except FileNotFoundError:
            pass
        raise


class Inflator:
    """Plain copies of compressed local shards in one directory, made once and reused across runs.

    A copy is named after the shard and a hash of its path, size and mtime, so a changed source
    is decompressed again; each copy is written under a temporary name and renamed, with its
    index, so concurrent ranks or a crash never leave a half-written copy under a used name.
    """

    def __init__(self, directory: str, threads: int = 0, member_bound: int | None = None):
        self.directory = directory
        self.member_bound = member_bound  # tar members (TFRecord records) past it, skipped when read, are holes
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._failed: set[str] = set()  # copies whose source would not decompress, by source identity

    def target(self, src: str) -> str:
        st = os.stat(src)
        # the bound too: a copy whose members past it are holes is no copy for a larger bound
        key = f"{os.path.abspath(src)}:{st.st_size}:{st.st_mtime_ns}" + (f":{self.member_bound}" if self.member_bound
                                                                          else "")
        digest = hashlib.sha1(key.encode()).hexdigest()[:12]
        if plain_suffix(src) == ".tfrecord":  # its records' keys carry its name: the copy keeps it, in a folder
            return os.path.join(self.directory, digest, f"{shard_stem(src)}.tfrecord")
        return os.path.join(self.directory, f"{shard_stem(src)}-{digest}.tar")

    def plain(self, shards: list[str]) -> list[str]:
        """The shards with every compressed one replaced by its plain copy (made now where missing).

        A shard that does not decompress stays in the list as it is, so the worker that reaches it
        skips it and counts it (``bad_shard``) like any other unreadable shard; it is not tried
        again while it is unchanged. A directory that cannot take the copies is an ``OSError``.
        """
        targets = {}
        for s in shards:
            if compression(s) is not None:
                try:
                    targets[s] = self.target(s)
                except FileNotFoundError:
                    continue  # gone since it was listed
        todo = [s for s, t in targets.items() if not os.path.exists(t) and t not in self._failed]
        if todo:
            os.makedirs(self.directory, exist_ok=True)
            log.info("decompressing %d shard(s) into %s (once; later runs reuse them)", len(todo), self.directory)
            with ThreadPoolExecutor(self.threads, thread_name_prefix="feedline-inflate") as pool:
                for src, failure in zip(todo, pool.map(self._make, todo, [targets[s] for s in todo])):
                    if failure is not None:
                        log.warning("%s; skipped", failure)
                        self._failed.add(targets[src])
        return [s if targets.get(s) is None or targets[s] in self._failed else targets[s] for s in shards]

    def _make(self, src: str, dest: str) -> ShardError | None:
        tmp = f"{dest}{TMP_MARK}{os.getpid()}"
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        try:
            decompress(src, tmp, compression(src) or "", member_bound=self.member_bound,
                       records=plain_suffix(src) == ".tfrecord")
            index = build_index(tmp, fmt=src)
            write_index(index, index_path(dest))
            os.replace(tmp, dest)
            fsync_dir(os.path.dirname(dest))
        except ShardError as exc:
            return exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return None
