"""Where an epoch's shard list comes from: paths and globs, or a cache (``feedline.cache.CacheSource``).

A source is anything with this small surface (``ShardSource``); the loader
never asks which kind it has.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from ...errors import SettingError
from ...formats.compressed import Inflator
from ...formats.urls import RULES, ShardListError, expand, is_remote, local_shards


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

    def epoch_started(self, rank: int, epoch: int, shards: int) -> None:
        """Told at every epoch start (a cache tells its sampler, which grows it)."""
        ...

    def describe(self) -> str: ...


class PathSource:
    """Local shards named as the sidecar's ``--source`` names them; re-listed every epoch, so new shards count."""

    growing = False

    def __init__(self, shards: str | os.PathLike | Sequence[str | os.PathLike], decompress_dir: str | None = None):
        self.inflator = Inflator(decompress_dir or default_decompress_dir())
        try:
            self.names = expand(shards)
        except ValueError as exc:
            raise SettingError("shards", f"cannot read the list: {exc}") from None
        if not self.names:
            raise SettingError("shards", "the list is empty; give shard paths, globs, a directory or an index file "
                                         "such as 'data/shard-{000000..000099}.tar'")
        remote = [n for n in self.names if is_remote(n)]
        if remote:
            raise SettingError("shards", f"{remote[0]} is remote: the loader reads local files. Fetch remote shards "
                                         f"with the sampler sidecar (feedline sample --source URL --cache DIR) and "
                                         f"read its cache with cache=DIR")

    def snapshot(self) -> list[str]:
        try:
            listed = [e.url for e in local_shards(self.names)]
        except ShardListError as exc:
            raise SettingError("shards", str(exc)) from None
        try:
            return self.inflator.plain(listed)
        except OSError as exc:
            raise SettingError("decompress_dir", f"cannot keep plain copies of the compressed shards in "
                                                 f"{self.inflator.directory}: {exc}; free room there or set "
                                                 f"decompress_dir") from None

    def wait_for(self, min_shards: int, timeout: float) -> list[str]:
        shards = self.snapshot()
        if not shards:
            raise SettingError("shards", f"nothing matches {self.describe()} ({RULES})")
        return shards

    def epoch_started(self, rank: int, epoch: int, shards: int) -> None:
        pass

    def describe(self) -> str:
        shown = ", ".join(self.names[:3])
        return shown + (f" and {len(self.names) - 3} more" if len(self.names) > 3 else "")
