"""``manifest.json``: the published shards of a cache directory (DESIGN.md, Cache directory).

Replaced atomically (temp file, fsync, rename) with a monotonically increasing
``generation``; a reader always sees one whole manifest.
"""

from __future__ import annotations

import json
import os
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
    dir_fd = os.open(cache_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class CacheSource:
    """The shards a cache's manifest lists at the moment an epoch starts."""

    def __init__(self, cache_dir: str):
        self.cache_dir = os.fspath(cache_dir)

    def snapshot(self) -> list[str]:
        try:
            manifest = read_manifest(self.cache_dir)
        except FileNotFoundError:
            return []
        return [shard_path(self.cache_dir, s.id) for s in manifest.shards]

    def describe(self) -> str:
        return f"cache {self.cache_dir}"
