"""``manifest.json`` and ``manifest.log``: the published shards of a cache directory (DESIGN.md, Cache directory).

``manifest.json`` is replaced atomically (temp file, fsync, rename) with a monotonically increasing
``generation``. Between two such replacements each publish or eviction appends one line to ``manifest.log``
(one ``write``, fsynced): the next generation's change — shards added, ids removed, ``complete``, ``retained``.
A publish so costs O(1), not a rewrite of every entry (O(C) a publish, O(C^2) to fill a cache of C shards);
the log is folded into a new ``manifest.json`` once it has as many lines as that file has shards (O(1)
amortised: a fill folds at 64, 128, 256, ... shards). The log's first line names the generation of the
``manifest.json`` it follows: a reader applies the lines after the one it read, in order, and stops at a torn
last line (a writer that died mid-line); a log that follows a newer ``manifest.json`` than the one it read means
a fold happened in between: it reads again. A reader always sees one whole generation.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..formats.files import atomic_write
from ..formats.urls import is_parquet, is_tfrecord, redact

MANIFEST = "manifest.json"
LOG = "manifest.log"  # the generations since manifest.json's, a line each
FOLD_AT = 64  # log lines before it is folded into manifest.json, at least (else as many as the cache's shards)
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
    """The current manifest (``manifest.json`` and the generations its log adds); raises FileNotFoundError or
    ValueError (corrupt) — never guesses."""
    path = os.path.join(cache_dir, MANIFEST)
    for _ in range(8):
        with open(path) as f:
            text = f.read()
        try:
            doc = json.loads(text)
            base = int(doc["generation"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is corrupt: {exc}") from None
        try:
            with open(os.path.join(cache_dir, LOG), "rb") as f:
                lines = f.read().split(b"\n")[:-1]  # what follows the last newline is a line being written
        except FileNotFoundError:
            lines = []
        try:
            if lines and int(json.loads(lines[0])["base"]) > base:
                continue  # folded into a newer manifest.json since it was read: read that one
            doc = _apply(doc, lines[1:])
            return Manifest.from_json(doc)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path} (with {LOG}) is corrupt: {exc}") from None
    raise ValueError(f"{path} kept changing under its reader (8 tries): is more than one sampler writing it?")


def _apply(doc: dict[str, Any], lines: list[bytes]) -> dict[str, Any]:
    """``doc`` with the log's generations after its own applied in order (a gap ends them)."""
    generation = int(doc["generation"])
    shards: dict[str, dict[str, Any]] | None = None
    for line in lines:
        try:
            change = json.loads(line)
            g = int(change["g"])
        except (ValueError, KeyError, TypeError):
            break  # a line its writer could not finish nor take back: the generations end before it
        if g <= generation:
            continue
        if g != generation + 1:
            break
        if shards is None:
            shards = {s["id"]: s for s in doc["shards"]}
        for i in change.get("del", ()):
            shards.pop(i, None)
        for s in change.get("add", ()):
            shards[s["id"]] = s
        doc = {**doc, "generation": g, "complete": bool(change.get("complete", False)),
               "retained": list(change.get("retained", ()))}
        generation = g
    if shards is not None:
        doc["shards"] = list(shards.values())
    return doc


def write_manifest(cache_dir: str, manifest: Manifest) -> None:
    """``manifest`` as the whole of the cache's published state: a new ``manifest.json``, then a log that
    follows it (no lines yet)."""
    atomic_write(os.path.join(cache_dir, MANIFEST), json.dumps(manifest.to_json(), separators=(",", ":")))
    atomic_write(os.path.join(cache_dir, LOG), json.dumps({"base": manifest.generation}) + "\n")


class ManifestLog:
    """The one writer's side: each change a line (O(1)), folded into ``manifest.json`` once the log has as many
    lines as that file has shards (``FOLD_AT`` at least)."""

    def __init__(self, cache_dir: str):
        self.cache_dir = cache_dir
        self.lines = 0
        self._folded = 0  # shards manifest.json holds: the log is folded once it has as many lines (or FOLD_AT)
        self._torn = False  # a line could not be taken back: the next write folds

    def write(self, generation: int, added: list[ShardEntry], removed: list[str], complete: bool,
              retained: list[str], whole: Callable[[], Manifest]) -> None:
        """Generation ``generation`` (one past the last written) as a line of the log, or, once the log has as many
        lines as ``manifest.json`` has shards (``FOLD_AT`` at least), ``whole()`` folded into it: a fill folds at
        64, 128, 256, ... shards, so each entry is rewritten twice on average, O(1) a publish. A line that cannot
        be written whole is taken back (or, failing that, the log is folded before any other line follows it);
        raises OSError when neither the line nor a fold could be written (nothing of this generation is then
        published)."""
        if self._torn or self.lines >= max(FOLD_AT, self._folded):
            self.fold(whole())
            return
        line = json.dumps({"g": generation, "add": [asdict(s) for s in added], "del": removed,
                           "complete": complete, "retained": retained}, separators=(",", ":")).encode() + b"\n"
        try:
            fd = os.open(os.path.join(self.cache_dir, LOG), os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # no log (removed by hand): the whole state in one file instead
            self.fold(whole())
            return
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                if os.write(fd, line) == len(line):  # a regular file on a local filesystem takes it whole
                    os.fsync(fd)
                    self.lines += 1
                    return
            except OSError:  # no room (ENOSPC), or the fsync failed
                pass
            try:
                os.ftruncate(fd, end)  # the line taken back: no later line is ever glued to a torn one
            except OSError:
                self._torn = True
        finally:
            os.close(fd)
        self.fold(whole())

    def fold(self, manifest: Manifest) -> None:
        write_manifest(self.cache_dir, manifest)
        self.lines, self._folded, self._torn = 0, len(manifest.shards), False
