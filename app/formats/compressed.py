"""Compressed shards (``.tar.gz``, ``.tgz``, ``.tar.zst``, ``.tfrecord.gz``) become plain files once, so workers
can mmap them.

A worker slices members out of a mapped shard by offset; a compressed stream has
no offsets to slice. So a compressed shard is decompressed once — by the sampler
before it publishes (the cache budget counts the uncompressed bytes), or by the
loader into a directory of decompressed copies for ``shards=`` — and read as the
plain tar it holds. ``zstd`` needs the ``zstandard`` package (``pip install zstandard``).
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO

from .files import TMP_MARK, fsync_dir
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


def decompress(src: str, dest: str, kind: str, max_bytes: int | None = None,
               stopped: Callable[[], bool] | None = None) -> int:
    """Write the tar inside ``src`` to ``dest`` (fsynced); its size.

    A broken stream is a ``ShardError``, more than ``max_bytes`` a ``TooLarge``; a failure to write
    ``dest`` (a full disk) stays an ``OSError``: that is the destination's fault, not the shard's.
    ``stopped()`` is asked between chunks; when it says so, the copy is abandoned (``InterruptedError``).
    """
    written = 0
    try:
        with open(src, "rb") as f, _reader(f, kind) as r, open(dest, "wb") as out:
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
                out.write(chunk)
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

    def __init__(self, directory: str, threads: int = 0):
        self.directory = directory
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._failed: set[str] = set()  # copies whose source would not decompress, by source identity

    def target(self, src: str) -> str:
        st = os.stat(src)
        digest = hashlib.sha1(f"{os.path.abspath(src)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
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
            decompress(src, tmp, compression(src) or "")
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
