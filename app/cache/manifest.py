"""``manifest.json``: the published shards of a cache directory (DESIGN.md, Cache directory).

Replaced atomically (temp file, fsync, rename) with a monotonically increasing
``generation``; a reader always sees one whole manifest.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST = "manifest.json"
SHARDS_DIR = "shards"


@dataclass(frozen=True)
class ShardEntry:
    id: str
    bytes: int
    samples: int
    added_at: float
    source: str = ""
    sha256: str = ""


@dataclass
class Manifest:
    generation: int = 0
    budget_bytes: int = 0
    shards: list[ShardEntry] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "budget_bytes": self.budget_bytes,
                "shards": [asdict(s) for s in self.shards]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "Manifest":
        known = set(ShardEntry.__dataclass_fields__)
        return cls(
            generation=int(doc["generation"]),
            budget_bytes=int(doc.get("budget_bytes", 0)),
            shards=[ShardEntry(**{k: v for k, v in s.items() if k in known}) for s in doc["shards"]],
        )


def shard_path(cache_dir: str, shard_id: str) -> str:
    return os.path.join(cache_dir, SHARDS_DIR, f"{shard_id}.tar")


def read_manifest(cache_dir: str) -> Manifest:
    """The current manifest; raises FileNotFoundError or ValueError (corrupt) — never guesses."""
    with open(os.path.join(cache_dir, MANIFEST)) as f:
        text = f.read()
    try:
        return Manifest.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{os.path.join(cache_dir, MANIFEST)} is corrupt: {exc}") from None


def write_manifest(cache_dir: str, manifest: Manifest) -> None:
    path = os.path.join(cache_dir, MANIFEST)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest.to_json(), f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(cache_dir)


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CacheSource:
    """The shards a cache's manifest lists at the moment an epoch starts.

    The loader reports its epoch (``readers/<rank>.json``) so the sampler can
    grow the cache, and can wait for the cache to hold a minimum of shards.
    """

    def __init__(self, cache_dir: str):
        self.cache_dir = os.fspath(cache_dir)
        self.generation = -1

    def manifest(self) -> Manifest | None:
        try:
            return read_manifest(self.cache_dir)
        except FileNotFoundError:
            return None

    def snapshot(self) -> list[str]:
        manifest = self.manifest()
        if manifest is None:
            return []
        self.generation = manifest.generation
        return [shard_path(self.cache_dir, s.id) for s in manifest.shards]

    def epoch_started(self, rank: int, epoch: int, shards: int) -> None:
        from .readers import write_reader

        write_reader(self.cache_dir, rank, epoch, self.generation, shards)

    def wait_for(self, min_shards: int, timeout: float) -> list[str]:
        """The snapshot once it holds ``min_shards``; a clear error after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                shards = self.snapshot()
            except ValueError:  # a corrupt manifest: the sampler rebuilds it
                shards = []
            if len(shards) >= min_shards:
                return shards
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"cache {self.cache_dir} holds {len(shards)} shard(s) after {timeout:.0f} s, fewer than "
                    f"min_shards={min_shards}: is `feedline sample` running and filling it (its /readyz says "
                    f"when)? Raise wait_timeout (FEEDLINE_WAIT_TIMEOUT) or lower min_shards (FEEDLINE_MIN_SHARDS)"
                )
            time.sleep(0.2)

    def describe(self) -> str:
        return f"cache {self.cache_dir}"
