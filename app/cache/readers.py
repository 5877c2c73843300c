"""``readers/<rank>.json``: which epoch each loader rank is in, and the shards that epoch reads — a lease.

The loader writes its file at every epoch start; the sampler watches them to
grow the cache epoch by epoch. Written atomically; a torn or stale file is
ignored, never fatal.

Beside it, ``readers/<rank>.shards`` lists the ids of the shards the rank's
epoch reads (one per line, written first). While a reader's file is fresh
(the loader touches it as batches go out), the sampler keeps a shard it evicts
from the manifest on disk as long as a lease names it: a trainer restarted
from its checkpoint then finds every shard of the epoch it resumes, as the
running trainer does through the descriptors it holds (DESIGN.md, Cache
directory). The leases end when the rank moves to another epoch or its file
goes stale (``reader_lease`` seconds without a touch).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from ..formats.files import atomic_write
from .ownership import check_folder

log = logging.getLogger("feedline.cache")

READERS_DIR = "readers"
TOUCH_EVERY = 30.0  # seconds between a reader's touches of its file while batches go out


@dataclass(frozen=True)
class ReaderState:
    """One loader rank's last epoch start, as the sampler reads it; ``seen_at``: the file's last touch."""

    rank: int
    epoch: int
    generation: int
    shards: int
    pid: int
    updated_at: float
    seen_at: float = 0.0


def _path(cache_dir: str, rank: int, ext: str) -> str:
    return os.path.join(cache_dir, READERS_DIR, f"{rank}.{ext}")


def write_reader(cache_dir: str, rank: int, epoch: int, generation: int, shard_ids: Iterable[str]) -> None:
    ids = sorted(set(shard_ids))
    d = os.path.join(cache_dir, READERS_DIR)
    check_folder(d, create=True)  # this user's folder, never a link another user planted (ownership.py)
    state = ReaderState(rank, epoch, generation, len(ids), os.getpid(), time.time())
    try:  # the lease's list before the epoch: a sampler that sees the new epoch sees its shards
        atomic_write(_path(cache_dir, rank, "shards"), "".join(f"{i}\n" for i in ids), durable=False)
        atomic_write(_path(cache_dir, rank, "json"), json.dumps(asdict(state)), durable=False)
    except OSError as exc:  # advisory: the sampler only grows the cache later than it could
        log.warning("cannot write the reader file of rank %d in %s: %s", rank, d, exc)


def touch_reader(cache_dir: str, rank: int) -> bool:
    """The rank still reads: its lease stays fresh. False when its file is gone (the sidecar removed it as stale
    during a long pause, a cache wiped by hand): the caller writes it again."""
    try:
        os.utime(_path(cache_dir, rank, "json"))
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not ours to fix here: the next epoch start writes it again


def remove_reader(cache_dir: str, rank: int) -> None:
    """The rank's lease ends now: its files go (the epoch file first, so no sampler sees an epoch without its
    list). Only this process's own files: a rank of another job on the same cache that wrote since is left."""
    path = _path(cache_dir, rank, "json")
    try:
        with open(path) as f:
            if json.load(f).get("pid") != os.getpid():
                return
        os.unlink(path)
        os.unlink(_path(cache_dir, rank, "shards"))
    except (OSError, ValueError, AttributeError):
        pass  # gone already, or torn: it goes stale


def remove_stale(cache_dir: str, lease: float, now: float | None = None) -> list[int]:
    """Remove the files of readers not touched for ``lease`` seconds (a killed trainer's); their ranks."""
    now = time.time() if now is None else now
    gone = []
    for r in read_readers(cache_dir):
        if now - r.seen_at > lease:
            try:  # looked at again just before: a reader that wrote or touched it meanwhile keeps it
                if now - os.stat(_path(cache_dir, r.rank, "json")).st_mtime <= lease:
                    continue
            except FileNotFoundError:
                pass
            for ext in ("json", "shards"):
                try:
                    os.unlink(_path(cache_dir, r.rank, ext))
                except FileNotFoundError:
                    pass
            gone.append(r.rank)
    return gone


def read_readers(cache_dir: str) -> list[ReaderState]:
    out = []
    known = set(ReaderState.__dataclass_fields__)
    for path in sorted(glob.glob(os.path.join(cache_dir, READERS_DIR, "*.json"))):
        try:
            with open(path) as f:
                doc = json.load(f)
                seen = os.fstat(f.fileno()).st_mtime
            out.append(ReaderState(**{k: v for k, v in doc.items() if k in known and k != "seen_at"}, seen_at=seen))
        except (OSError, ValueError, TypeError):
            continue
    return out


def leased_ids(cache_dir: str, lease: float, now: float | None = None) -> set[str]:
    """Ids of the shards that the epochs of readers touched within ``lease`` seconds read."""
    now = time.time() if now is None else now
    ids: set[str] = set()
    for r in read_readers(cache_dir):
        if now - r.seen_at > lease:
            continue
        try:
            with open(_path(cache_dir, r.rank, "shards")) as f:
                ids.update(line.strip() for line in f if line.strip())
        except OSError:
            continue
    return ids
