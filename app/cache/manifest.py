"""``manifest.json``: the published shards of a cache directory (DESIGN.md, Cache directory).

Replaced atomically (temp file, fsync, rename) with a monotonically increasing
``generation``; a reader always sees one whole manifest.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..formats.files import atomic_write
from ..formats.urls import is_parquet, is_tfrecord, redact

MANIFEST = "manifest.json"
SHARDS_DIR = "shards"
# A cached shard's file: ``shards/<id><suffix>``, by its format; published plain (a ``.tar.gz`` as its tar,
# a ``.tfrecord.gz`` as its records), so workers map it as they map a local file of that format.
SUFFIXES = {"tar": ".tar", "tfrecord": ".tfrecord", "parquet": ".parquet"}
# A shard's cache id, as the sampler makes them (formats.urls.shard_stem, and "-<8 hex>" where stems repeat): a
# file name of letters, digits and ``._-``, never hidden, ``.`` nor ``..``, never a path.
ID_MAX = 200
_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,%d}" % (ID_MAX - 1))


def is_cache_id(shard_id: object) -> bool:
    """Whether ``shard_id`` is a cache id the sampler makes (``check_id``)."""
    return isinstance(shard_id, str) and _ID.fullmatch(shard_id) is not None


def check_id(shard_id: object) -> str:
    """``shard_id`` if it is a cache id the sampler makes; else a ValueError naming it. A manifest may be written
    by someone else (a shared cache): its ids become paths only once they pass."""
    if not is_cache_id(shard_id):
        shown = repr(shard_id)[:ID_MAX + 20]
        raise ValueError(f"shard id {shown} is not a cache id (letters, digits and ._- only, not starting "
                         f"with a dot, at most {ID_MAX} characters): this manifest was not written by feedline's "
                         f"sampler; remove the cache directory's manifest.json, or use a cache directory of your own")
    return shard_id


def shard_format(name: str) -> str:
    """``tar``, ``tfrecord`` or ``parquet``: the format a source shard is cached as, from its name."""
    return "tfrecord" if is_tfrecord(name) else "parquet" if is_parquet(name) else "tar"


def split_name(file_name: str) -> tuple[str, str] | None:
    """``<id>.parquet`` -> (``<id>``, ``parquet``); None for a file that is not a cached shard."""
    for fmt, suffix in SUFFIXES.items():
        if file_name.endswith(suffix):
            return file_name[: -len(suffix)], fmt
    return None


@dataclass(frozen=True)
class ShardEntry:
    """One published shard: what the loader may read and the sampler may evict (oldest first)."""

    id: str
    bytes: int
    samples: int
    added_at: float
    source: str = ""
    sha256: str = ""
    format: str = "tar"  # a key of SUFFIXES; manifests written before TFRecord and Parquet were cached lack it

    def __post_init__(self) -> None:
        # where it came from, as a person recognises it: a presigned URL's query values and any userinfo never
        # reach manifest.json (nor its readers), whoever built the entry (formats.urls.redact)
        object.__setattr__(self, "source", redact(self.source))


@dataclass
class Manifest:
    """The whole published state of a cache; each write has a higher generation.

    ``complete``: the cache holds every shard of its source, so nothing more will come and a loader
    waiting for ``min_shards`` starts with what is there (a store of 2 shards, ``min_shards=4``).
    ``retained``: ids evicted from ``shards`` whose files stay on disk while a reader's lease names them
    (``readers.py``); never planned from, not counted in the budget, removed once no lease names them.
    """

    generation: int = 0
    budget_bytes: int = 0
    shards: list[ShardEntry] = field(default_factory=list)
    complete: bool = False
    retained: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "budget_bytes": self.budget_bytes, "complete": self.complete,
                "shards": [asdict(s) for s in self.shards], "retained": list(self.retained)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "Manifest":
        """The manifest a document holds; a ValueError for one feedline's sampler would not write: an
        unknown format, or an id that is not a cache id (``check_id``: ``../x``, ``/abs``, a NUL), in ``shards``
        or ``retained`` — checked before any of them becomes a path."""
        known = set(ShardEntry.__dataclass_fields__)
        for s in doc["shards"]:
            check_id(s.get("id"))
            if s.get("format", "tar") not in SUFFIXES:
                raise ValueError(f"shard {s.get('id')!r} has an unknown format {s.get('format')!r}")
        retained = doc.get("retained", [])
        if not isinstance(retained, list):
            raise ValueError("retained is not a list of shard ids")
        return cls(
            generation=int(doc["generation"]),
            budget_bytes=int(doc.get("budget_bytes", 0)),
            shards=[ShardEntry(**{k: v for k, v in s.items() if k in known}) for s in doc["shards"]],
            complete=bool(doc.get("complete", False)),
            retained=[check_id(i) for i in retained],
        )


def shard_path(cache_dir: str, shard_id: str, fmt: str = "tar") -> str:
    return os.path.join(cache_dir, SHARDS_DIR, shard_id + SUFFIXES[fmt])


def read_manifest(cache_dir: str) -> Manifest:
    """The current manifest; raises FileNotFoundError or ValueError (corrupt) — never guesses."""
    with open(os.path.join(cache_dir, MANIFEST)) as f:
        text = f.read()
    try:
        return Manifest.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{os.path.join(cache_dir, MANIFEST)} is corrupt: {exc}") from None


def write_manifest(cache_dir: str, manifest: Manifest) -> None:
    atomic_write(os.path.join(cache_dir, MANIFEST), json.dumps(manifest.to_json(), separators=(",", ":")))
