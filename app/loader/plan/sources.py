"""Where an epoch's shard list comes from: paths and globs, or a cache (``feedline.cache.CacheSource``).

A source is anything with this small surface (``ShardSource``); the loader
never asks which kind it has.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from ...errors import SettingError
from ...formats.compressed import Inflator
from ...formats.shard_index import ShardError, SharedIndexes, load_index
from ...formats.urls import RULES, ShardListError, compression, expand, is_pipe, is_remote, local_shards, redact
from ..errors import LoaderError
from .mixture import Mixture, Source, mix_epoch


def default_decompress_dir() -> str:
    """Where plain copies of compressed ``shards=`` go unless ``decompress_dir`` says: the user's cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "feedline", "decompressed")


class ShardSource(Protocol):
    """The shards an epoch may read, snapshotted at each epoch start."""

    growing: bool  # the list may grow between epochs (a cache): few shards now is no error

    def snapshot(self) -> list[str]:
        """The shards an epoch starting now may read."""
        ...

    def wait_for(self, min_shards: int, timeout: float) -> list[str]:
        """The first snapshot, once it holds ``min_shards`` (or a clear error)."""
        ...

    def epoch_started(self, rank: int, epoch: int, shards: Sequence[str]) -> None:
        """Told at every epoch start, with the epoch's shards (a cache tells its sampler, which grows it and
        keeps those shards on disk for this reader)."""
        ...

    def reading(self, rank: int) -> None:
        """Told as batches go out (a cache renews the reader's lease)."""
        ...

    def released(self, rank: int) -> None:
        """Told when the loader closes with its last epoch read to its end: nothing of it needs keeping (a cache
        ends the reader's lease)."""
        ...

    def describe(self) -> str: ...


class PathSource:
    """Local shards named as the sidecar's ``--source`` names them; re-listed every epoch, so new shards count."""

    growing = False

    def __init__(self, shards: str | os.PathLike | Sequence[str | os.PathLike], decompress_dir: str | None = None,
                 member_bound: int | None = None):
        self.inflator = Inflator(decompress_dir or default_decompress_dir(), member_bound=member_bound)
        self._counts: dict[str, int] = {}
        try:
            self.names = expand(shards)
        except ValueError as exc:
            raise SettingError("shards", f"cannot read the list: {exc}") from None
        if not self.names:
            raise SettingError("shards", "the list is empty; give shard paths, globs, a directory or an index file "
                                         "such as 'data/shard-{000000..000099}.tar'")
        remote = [n for n in self.names if is_remote(n) or is_pipe(n)]
        if remote:
            raise SettingError("shards", f"{redact(remote[0])} is remote: this loader reads local files. "
                                         f"`from feedline import StagingLoader` fetches remote shards with a sidecar "
                                         f"of its own; or run one (feedline sample --source URL --cache DIR) and "
                                         f"read its cache with cache=DIR")

    @property
    def listed(self) -> dict[str, int]:
        """Samples per shard of the last snapshot where its listing gave them (a wids shard index): the plan's
        counts and a mixture's draw need no shard's index then. Not a manifest's ``counts``: a listing is the
        user's, checked against the shards a rank reads (``check_counts``), and never saved in a state."""
        return self._counts

    def snapshot(self) -> list[str]:
        """The shards as named (a compressed one too: every rank splits the same names; each makes the plain
        copies of its own only, ``local_files``)."""
        try:
            entries = local_shards(self.names)
        except ShardListError as exc:
            raise SettingError("shards", str(exc)) from None
        self._counts = {e.url: e.samples for e in entries if e.samples is not None}
        return [e.url for e in entries]

    def local_files(self, paths: Collection[str]) -> dict[str, str]:
        """The plain copy of each compressed shard of ``paths``, made now where missing (in ``decompress_dir``,
        kept for later runs); one that does not decompress maps to itself, so the worker that reaches it skips
        and counts it. A rank asks for its own shards (and those a start or resume reads), never the whole list."""
        compressed = sorted({p for p in paths if compression(p) is not None})
        if not compressed:
            return {}
        try:
            return dict(zip(compressed, self.inflator.plain(compressed)))
        except OSError as exc:
            raise SettingError("decompress_dir", f"cannot keep plain copies of the compressed shards in "
                                                 f"{self.inflator.directory}: {exc}; free room there or set "
                                                 f"decompress_dir") from None

    def wait_for(self, min_shards: int, timeout: float) -> list[str]:
        shards = self.snapshot()
        if not shards:
            raise SettingError("shards", f"nothing matches {self.describe()} ({RULES})")
        return shards

    def epoch_started(self, rank: int, epoch: int, shards: Sequence[str]) -> None:
        pass

    def reading(self, rank: int) -> None:
        pass

    def released(self, rank: int) -> None:
        pass

    def describe(self) -> str:
        shown = ", ".join(self.names[:3])
        return shown + (f" and {len(self.names) - 3} more" if len(self.names) > 3 else "")


def known_counts(source: object) -> dict[str, int]:
    """Samples per shard where ``source`` knows them without an index: its listing's (``listed``), then a cache's
    manifest's (``counts``), which win."""
    return {**(getattr(source, "listed", None) or {}), **(getattr(source, "counts", None) or {})}


def check_counts(counts: dict[str, int], paths: Sequence[str], share: SharedIndexes | None = None,
                 files: Mapping[str, str] | None = None) -> None:
    """The sample counts a listing gave, checked against the indexes of ``paths`` (the shards the start's probe
    read, through their ``files``: no index more): a stale listing would plan an epoch the shards do not hold."""
    for path in paths:
        if path not in counts:
            continue
        try:
            held = len(load_index((files or {}).get(path, path), share=share).samples)
        except ShardError:
            continue  # unreadable: the workers skip and count it
        if held != counts[path]:
            raise SettingError("shards", f"{path} holds {held} samples, but its listing says {counts[path]}: the "
                                         f"shard index (shardindex.json) is out of date, or counts samples by other "
                                         f"rules (a macOS '._' member, a member repeated in a sample); write it "
                                         f"again (`widsindex create`), or name the shards themselves")


class MixedSource:
    """The sources of a mixture (``mixture.Source``) as one ``ShardSource``: the plan asks each for its shards.

    ``snapshot()`` is every source's shards together (what a resume compares and the spec is probed from);
    ``snapshots()`` keeps them apart for the epoch's draw (``mixture.mix_epoch``).
    """

    def __init__(self, names: Sequence[str], parts: Sequence[ShardSource]):
        self.names = tuple(names)
        self.parts = tuple(parts)
        self.growing = any(p.growing for p in self.parts)
        self.last: list[list[str]] = [[] for _ in self.parts]
        self._part_of: dict[str, int] = {}  # each shard of the last snapshots: its source's index

    def snapshots(self) -> list[list[str]]:
        return self._keep([p.snapshot() for p in self.parts])

    def _keep(self, last: list[list[str]]) -> list[list[str]]:
        self.last = last
        self._part_of = {path: i for i, shards in enumerate(last) for path in shards}
        return last

    def snapshot(self) -> list[str]:
        return sorted({path for shards in self.snapshots() for path in shards})

    @property
    def counts(self) -> dict[str, int]:
        """Samples per shard where a source knows them (a cache's manifest)."""
        return {path: n for p in self.parts for path, n in getattr(p, "counts", {}).items()}

    @property
    def listed(self) -> dict[str, int]:
        """Samples per shard where a source's listing gives them (``PathSource.listed``)."""
        return {path: n for p in self.parts for path, n in getattr(p, "listed", {}).items()}

    def wait_for(self, min_shards: int, timeout: float) -> list[str]:
        self._keep([p.wait_for(min_shards, timeout) for p in self.parts])
        return sorted({path for shards in self.last for path in shards})

    def local_files(self, paths: Collection[str]) -> dict[str, str]:
        """Each source's plain copies of its compressed shards among ``paths`` (``PathSource.local_files``)."""
        by_part: dict[int, list[str]] = {}
        for path in paths:
            if compression(path) is not None and path in self._part_of:
                by_part.setdefault(self._part_of[path], []).append(path)
        out: dict[str, str] = {}
        for i, mine in by_part.items():
            local = getattr(self.parts[i], "local_files", None)
            if local is not None:
                out.update(local(mine))
        return out

    def epoch_started(self, rank: int, epoch: int, shards: Sequence[str]) -> None:
        for part in self.parts:  # each cache's sampler hears of its own shards (a cache keeps those under it)
            part.epoch_started(rank, epoch, shards)

    def reading(self, rank: int) -> None:
        for part in self.parts:
            part.reading(rank)

    def released(self, rank: int) -> None:
        for part in self.parts:
            part.released(rank)

    def draw(self, sources: Sequence[Source], *, seed: int, epoch: int, shuffle: bool) -> tuple[list[str], Mixture]:
        """(every source's shards, the epoch's draw from them): the samples per shard from a cache's manifest,
        else from the shard's index."""
        snapshots = self.snapshots()
        known = known_counts(self)

        def count(path: str) -> int:
            if path not in known:
                try:  # (a compressed shard is decompressed to be counted: give its source's counts instead)
                    file = self.local_files([path]).get(path, path) if compression(path) is not None else path
                    known[path] = len(load_index(file).samples)
                except ShardError:
                    known[path] = 0  # unreadable: it gives nothing (and a worker reports it if it is drawn)
            return known[path]

        mix = mix_epoch(sources, snapshots, count, seed=seed, epoch=epoch, shuffle=shuffle)
        if not mix.order:
            raise LoaderError(f"no samples to draw in {self.describe()}")
        return sorted({path for shards in snapshots for path in shards}), mix

    def describe(self) -> str:
        return "; ".join(f"{name}: {part.describe()}" for name, part in zip(self.names, self.parts))
