"""The cache directory's writer: publish, evict, recover (DESIGN.md, Cache directory).

Invariants, kept by one lock in the one writer process (the sampler):
- a shard appears under ``shards/<id>.tar`` (``.tfrecord``, ``.parquet``: manifest.SUFFIXES) only
  complete: written under ``shards/.partial/``, verified, fsynced, then renamed;
- its index (``shards/<id>.idx``, ``shards/<id>.tfrecord.idx``) is in place before the shard is;
- each change is a new generation: a line appended to ``manifest.log``, folded into ``manifest.json`` (replaced
  atomically) once the log is as long as the cache (``manifest.py``): a publish costs O(1), not a rewrite;
- eviction publishes a manifest without the shard first, then unlinks it — or, while a
  reader's lease names it (``readers.py``), keeps the file where it is, listed as
  ``retained``, until no lease does (``release()``);
- published bytes never exceed the budget: room is made before a publish.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from ..formats.files import FILE_MODE, fsync_dir, sweep_temporaries
from ..formats.shard_index import ShardError, ShardIndex, build_index, index_path, write_index
from .manifest import (
    SHARDS_DIR,
    SUFFIXES,
    Manifest,
    ManifestLog,
    ShardEntry,
    is_cache_id,
    read_manifest,
    shard_path,
    split_name,
)
from .ownership import CacheDirError, claim_cache_dir
from .readers import READERS_DIR

log = logging.getLogger("feedline.cache")

PARTIAL_DIR = ".partial"
RETAIN_POLL = 0.2  # seconds between looks for room, while a publish waits for a lease to end
CACHE_FOLDERS = (SHARDS_DIR, os.path.join(SHARDS_DIR, PARTIAL_DIR), READERS_DIR)  # parents first
__all__ = ["BudgetError", "CacheDirError", "CacheStore", "Recovery"]


class BudgetError(ValueError):
    """A shard that cannot fit the budget even in an empty cache."""


@dataclass
class Recovery:
    """What start-up found and did; every number is also logged."""

    partial_removed: int = 0
    temporaries_removed: int = 0
    adopted: int = 0
    removed_invalid: int = 0
    dropped_missing: int = 0
    manifest_rebuilt: bool = False
    evicted_over_budget: int = 0
    notes: list[str] = field(default_factory=list)


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


class CacheStore:
    """The cache directory's one writer: keeps the DESIGN.md invariants under one lock."""

    def __init__(self, root: str, budget_bytes: int, on_evict: Callable[[ShardEntry], None] | None = None,
                 source_ids: frozenset[str] | None = None, leased: Callable[[], set[str]] | None = None,
                 retain_bytes: int | None = None):
        self.root = os.path.abspath(root)
        self.budget_bytes = budget_bytes
        # the room for evicted shards kept for readers' leases, beyond the budget (None: unbounded); a publish
        # that would retain more waits for a lease to end, so the shards on disk stay within budget + this
        self.retain_bytes = retain_bytes
        self.source_ids = source_ids  # every shard of the source: when all are published, the manifest says so
        self.shards_dir = os.path.join(self.root, SHARDS_DIR)
        self.partial_dir = os.path.join(self.shards_dir, PARTIAL_DIR)
        self._lock = threading.Lock()
        self._shards: dict[str, ShardEntry] = {}  # published, oldest first (evicted from the front)
        self._total = 0  # their bytes
        self._generation = 0
        self._complete = False
        self._sources_in = 0  # ids of source_ids published
        self._log = ManifestLog(self.root)
        self._on_evict = on_evict
        self._leased = leased  # ids the readers' epochs read: evicted from the manifest, kept on disk
        self._retained: dict[str, int] = {}  # id -> bytes of the files kept so
        # what this store writes and cleans must be its own: folders of this user's, never links (ownership.py)
        claim_cache_dir(self.root, CACHE_FOLDERS)

    # -- reading -------------------------------------------------------------------------

    @property
    def entries(self) -> list[ShardEntry]:
        with self._lock:
            return list(self._shards.values())

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._total

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def complete(self) -> bool:
        """Every shard of the source is published (the manifest's ``complete``)."""
        with self._lock:
            return self._complete

    @property
    def retained_bytes(self) -> int:
        """Bytes of evicted shards kept on disk for a reader's epoch: beyond the budget, in the same tmpfs."""
        with self._lock:
            return sum(self._retained.values())

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._shards)

    def partial_path(self, shard_id: str) -> str:
        return os.path.join(self.partial_dir, f"{shard_id}.{os.getpid()}.{threading.get_ident()}")

    # -- writing -------------------------------------------------------------------------

    def _write(self, added: Sequence[ShardEntry] = (), removed: Sequence[str] = (), fold: bool = False) -> None:
        """The next generation: ``added`` published (the newest), ``removed`` gone; one line of the log, or the
        whole manifest (``fold``, or once the log is long). Written first, then taken into this store's memory:
        a write that fails (no room) changes neither."""
        sources = self.source_ids or frozenset()
        gone = [self._shards[i] for i in removed if i in self._shards]
        out = {e.id for e in gone}
        count = self._sources_in - sum(e.id in sources for e in gone) + sum(e.id in sources for e in added)
        generation, complete, retained = self._generation + 1, bool(sources) and count == len(sources), \
            sorted(self._retained)

        def whole() -> Manifest:
            return Manifest(generation, self.budget_bytes, [e for e in self._shards.values() if e.id not in out]
                            + list(added), complete, retained)

        if fold:
            self._log.fold(whole())
        else:
            self._log.write(generation, list(added), [e.id for e in gone], complete, retained, whole)
        for e in gone:
            del self._shards[e.id]
            self._total -= e.bytes
        for e in added:
            self._shards[e.id] = e
            self._total += e.bytes
        self._sources_in, self._generation, self._complete = count, generation, complete

    def _leases(self) -> set[str]:
        """Ids the readers' leases name now (files read: once per eviction or publish)."""
        return self._leased() if self._leased is not None else set()

    def _evict_locked(self, victims: list[ShardEntry], leased: set[str] | None = None) -> None:
        if not victims:
            return
        leased = self._leases() if leased is None else leased
        for v in victims:
            if v.id in leased:
                self._retained[v.id] = v.bytes
        self._write(removed=[v.id for v in victims])
        for v in victims:  # readers that opened it keep reading (POSIX unlink)
            if v.id in leased:
                log.info("evicted %s (%d bytes, added %.0f s ago); its file stays while a reader's epoch reads it",
                         v.id, v.bytes, time.time() - v.added_at)
            else:
                self._unlink(v.id)
                log.info("evicted %s (%d bytes, added %.0f s ago)", v.id, v.bytes, time.time() - v.added_at)
            if self._on_evict is not None:
                self._on_evict(v)

    def _unlink(self, shard_id: str, keep: str = "") -> None:
        """The shard's file and index, whichever format it was cached as (a retained id keeps no format); but
        not those of format ``keep``."""
        for fmt in SUFFIXES.keys() - {keep}:
            for p in (shard_path(self.root, shard_id, fmt), index_path(shard_path(self.root, shard_id, fmt))):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    def release(self) -> list[str]:
        """Remove the retained shards no reader's lease names any more; the ids removed."""
        if not self._retained:
            return []
        with self._lock:  # the leases read under the lock: an eviction meanwhile may retain for a newer lease
            leased = self._leases()
            done = [i for i in self._retained if i not in leased]
            if not done:
                return []
            for i in done:  # the files first: a file on disk is always in the manifest, as published or retained
                self._unlink(i)
                del self._retained[i]
            self._write()
        log.info("removed %d evicted shard(s) no reader's epoch reads any more: %s", len(done), ", ".join(done[:5]))
        return done

    def evict(self, ids: set[str]) -> list[ShardEntry]:
        """Evict these shards now (a shard the source now has in another format: fetched anew)."""
        with self._lock:
            victims = [s for s in self._shards.values() if s.id in ids]
            self._evict_locked(victims)
            return victims

    def evict_oldest(self, count: int) -> list[ShardEntry]:
        with self._lock:
            victims = list(islice(self._shards.values(), count))  # oldest first
            self._evict_locked(victims)
            return victims

    def _victims(self, size: int) -> tuple[list[ShardEntry], set[str]] | None:
        """The oldest shards whose eviction makes room for ``size`` bytes, and the leases (read only when there
        are victims); None while that would retain more than ``retain_bytes`` for readers' leases (one shard is
        always retained when nothing is: progress)."""
        victims: list[ShardEntry] = []
        total = self._total
        by_age = iter(self._shards.values())  # oldest first: only the victims are looked at
        while total + size > self.budget_bytes and (v := next(by_age, None)) is not None:
            victims.append(v)
            total -= v.bytes
        if not victims:
            return victims, set()
        leased = self._leases()
        if self.retain_bytes is None or self._leased is None:
            return victims, leased
        kept = sum(v.bytes for v in victims if v.id in leased)
        retained = sum(self._retained.values())
        if kept and retained + kept > self.retain_bytes and retained > 0:
            return None
        return victims, leased

    def _publish_now(self, shard_id: str, partial: str, size: int, index: ShardIndex, final: str, source: str,
                     sha256: str, fmt: str) -> ShardEntry | None:
        """Make room and publish, under the lock; None when the room would retain too much (``_victims``)."""
        with self._lock:
            if shard_id in self._shards:
                os.unlink(partial)
                return self._shards[shard_id]
            room = self._victims(size)
            if room is None:
                return None
            self._evict_locked(*room)
            self._retained.pop(shard_id, None)  # fetched again: published (the same bytes) in its place
            self._unlink(shard_id, keep=fmt)  # a retained file of the id in another format: gone, not untracked
            write_index(index, index_path(final), FILE_MODE)
            os.replace(partial, final)
            fsync_dir(self.shards_dir)
            entry = ShardEntry(shard_id, size, len(index.samples), time.time(), source, sha256, fmt)
            self._write(added=[entry])
            return entry

    def publish(self, shard_id: str, partial: str, source: str = "", sha256: str = "", fmt: str = "tar",
                stopped: Callable[[], bool] | None = None) -> ShardEntry:
        """Verify a downloaded file (a plain tar, TFRecord or Parquet file, ``fmt``), make room, and publish it;
        raises ShardError or BudgetError.

        Room made by evicting shards a reader's lease names is room kept on disk: past ``retain_bytes`` of those,
        the publish waits for a lease to end (``release()``); ``stopped()`` ends the wait (``InterruptedError``).
        """
        size = os.path.getsize(partial)
        if size > self.budget_bytes:
            raise BudgetError(f"shard {shard_id} is {size} bytes, larger than the whole budget "
                              f"({self.budget_bytes} bytes): raise --budget / FEEDLINE_BUDGET")
        final = shard_path(self.root, shard_id, fmt)
        index = build_index(partial, fmt=final)  # a whole file of its format (keys named by the id), or ShardError
        fd = os.open(partial, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:  # whoever wrote it (a download, a decompression), a published shard gives other users nothing
            os.fchmod(fd, FILE_MODE)
            os.fsync(fd)
        finally:
            os.close(fd)
        waited = 0.0
        while (entry := self._publish_now(shard_id, partial, size, index, final, source, sha256, fmt)) is None:
            if stopped is not None and stopped():
                raise InterruptedError(f"publishing {shard_id} was stopped while it waited for room")
            if waited == 0.0:
                log.info("%s waits to be published: making room would keep more than %d bytes of evicted shards for "
                         "readers' leases (%d kept now); it goes in once a reader's epoch moves on or its lease ends",
                         shard_id, self.retain_bytes, self.retained_bytes)
            self.release()
            time.sleep(RETAIN_POLL)
            waited += RETAIN_POLL
        log.info("published %s (%d bytes, %d samples); cache %d / %d bytes in %d shards", shard_id, size,
                 entry.samples, self.total_bytes, self.budget_bytes, len(self._shards))
        return entry

    # -- start-up ----------------------------------------------------------------------------

    def recover(self) -> Recovery:
        """Bring the directory to a consistent state after any crash; nothing is trusted unverified."""
        r = Recovery()
        with self._lock:
            for p in glob.glob(os.path.join(self.partial_dir, "*")):  # a link goes, never what it points to
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
                r.partial_removed += 1
            for d in (self.root, self.shards_dir, os.path.join(self.root, READERS_DIR)):
                r.temporaries_removed += sweep_temporaries(d)
            try:
                old = read_manifest(self.root)
            except FileNotFoundError:
                old = Manifest()
            except ValueError as exc:
                log.warning("%s; rebuilding it from the shard files", exc)
                r.manifest_rebuilt = True
                r.notes.append(str(exc))
                old = Manifest()
            known = {s.id: s for s in old.shards}
            kept: list[ShardEntry] = []
            on_disk = sorted(p for suffix in SUFFIXES.values()
                             for p in glob.glob(os.path.join(self.shards_dir, "*" + suffix)))
            for path in [p for p in on_disk if not _regular(p) or not is_cache_id(split_name(os.path.basename(p))[0])]:
                # a link or a FIFO: its name goes, nothing else; a name that is no cache id (an older feedline's)
                # goes too: a manifest naming it would be refused by every loader (manifest.check_id)
                log.warning("removing %s: not a regular file named by a cache id (a shard is only ever one this "
                            "store wrote)", path)
                os.unlink(path)
                on_disk.remove(path)
                r.removed_invalid += 1
            self._retained = {}
            indexes: set[str] = set()
            first: dict[str, str] = {}  # id -> the one file kept for it: the manifest's format, else the first
            for path in on_disk:
                sid, fmt = split_name(os.path.basename(path)) or ("", "")
                if sid not in first or (sid in known and fmt == known[sid].format):
                    first[sid] = path
            for path in on_disk:
                sid, fmt = split_name(os.path.basename(path)) or ("", "")
                if first[sid] != path:  # one id on disk in two formats (the source changed): one file stays
                    log.warning("removing %s: shard %s is on disk as %s too", path, sid, first[sid])
                    for p in (path, index_path(path)):
                        if os.path.exists(p):
                            os.unlink(p)
                    r.removed_invalid += 1
                    continue
                if sid in old.retained and sid not in known:  # still kept for a reader: release() decides
                    self._retained[sid] = os.path.getsize(path)
                    indexes.add(index_path(path))
                    continue
                try:
                    index = build_index(path)
                except ShardError as exc:
                    log.warning("removing %s: %s", path, exc.reason)
                    for p in (path, index_path(path)):
                        if os.path.exists(p):
                            os.unlink(p)
                    r.removed_invalid += 1
                    continue
                size = os.path.getsize(path)
                entry = known.get(sid)
                if (entry is None or entry.bytes != size or entry.samples != len(index.samples)
                        or entry.format != fmt):
                    entry = ShardEntry(sid, size, len(index.samples), os.path.getmtime(path),
                                       entry.source if entry else "", entry.sha256 if entry else "", fmt)
                    if sid not in known:
                        r.adopted += 1
                write_index(index, index_path(path), FILE_MODE)
                indexes.add(index_path(path))
                kept.append(entry)
            present = {e.id for e in kept}
            r.dropped_missing = sum(1 for sid in known if sid not in present)
            for p in glob.glob(os.path.join(self.shards_dir, "*.idx")):
                if p not in indexes:
                    os.unlink(p)
            self._shards, self._total, self._sources_in = {}, 0, 0
            self._generation = old.generation
            self._write(added=sorted(kept, key=lambda s: s.added_at), fold=True)  # the whole of it, a fresh log
            if self._total > self.budget_bytes:
                by_age = list(self._shards.values())
                victims, total = [], self._total
                while total > self.budget_bytes:
                    v = by_age.pop(0)
                    victims.append(v)
                    total -= v.bytes
                self._evict_locked(victims)
                r.evicted_over_budget = len(victims)
        log.info("cache %s recovered: %d shards (%d bytes); %d partial and %d temporary files removed, "
                 "%d shards adopted, %d invalid removed, %d missing dropped, %d evicted to fit the budget%s", self.root,
                 len(self.entries), self.total_bytes, r.partial_removed, r.temporaries_removed, r.adopted,
                 r.removed_invalid,
                 r.dropped_missing, r.evicted_over_budget, ", manifest rebuilt" if r.manifest_rebuilt else "")
        return r
