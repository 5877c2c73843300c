"""``readers/<rank>.json``: which epoch each loader rank is in, and the manifest generation it read.

The loader writes its file at every epoch start; the sampler watches them to
grow the cache epoch by epoch. Written atomically; a torn or stale file is
ignored, never fatal.
"""

from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import asdict, dataclass

READERS_DIR = "readers"


@dataclass(frozen=True)
class ReaderState:
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
    path = os.path.join(d, f"{rank}.json")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(asdict(state), f)
    os.replace(tmp, path)


def read_readers(cache_dir: str) -> list[ReaderState]:
    out = []
    for path in sorted(glob.glob(os.path.join(cache_dir, READERS_DIR, "*.json"))):
        try:
            with open(path) as f:
                out.append(ReaderState(**json.load(f)))
        except (OSError, ValueError, TypeError):
            continue
    return out
