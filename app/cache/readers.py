"""``readers/<rank>.json``: which epoch each loader rank is in, and the manifest generation it read.

The loader writes its file at every epoch start; the sampler watches them to
grow the cache epoch by epoch. Written atomically; a torn or stale file is
ignored, never fatal.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from dataclasses import asdict, dataclass

from ..formats.files import atomic_write

log = logging.getLogger("feedline.cache")

READERS_DIR = "readers"


@dataclass(frozen=True)
class ReaderState:
    """One loader rank's last epoch start, as the sampler reads it."""

    rank: int
    epoch: int
    generation: int
    shards: int
    pid: int
    updated_at: float


def write_reader(cache_dir: str, rank: int, epoch: int, generation: int, shards: int) -> None:
    d = os.path.join(cache_dir, READERS_DIR)
    os.makedirs(d, exist_ok=True)
    state = ReaderState(rank, epoch, generation, shards, os.getpid(), time.time())
    try:
        atomic_write(os.path.join(d, f"{rank}.json"), json.dumps(asdict(state)), durable=False)
    except OSError as exc:  # advisory: the sampler only grows the cache later than it could
        log.warning("cannot write the reader file of rank %d in %s: %s", rank, d, exc)


def read_readers(cache_dir: str) -> list[ReaderState]:
    out = []
    for path in sorted(glob.glob(os.path.join(cache_dir, READERS_DIR, "*.json"))):
        try:
            with open(path) as f:
                out.append(ReaderState(**json.load(f)))
        except (OSError, ValueError, TypeError):
            continue
    return out
