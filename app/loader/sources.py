"""Where an epoch's shard list comes from: paths and globs, snapshotted at each epoch start."""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Protocol


class ShardSource(Protocol):
    def snapshot(self) -> list[str]:
        """The shards an epoch starting now may read."""
        ...

    def describe(self) -> str: ...


class PathSource:
    """Shard paths and glob patterns; re-expanded every epoch so new shards are picked up."""

    def __init__(self, shards: str | os.PathLike | Sequence[str | os.PathLike]):
        if isinstance(shards, (str, os.PathLike)):
            shards = [shards]
        self.patterns = [os.fspath(s) for s in shards]
        if not self.patterns:
            raise ValueError("shards: the list is empty; give shard paths or glob patterns such as 'data/*.tar'")

    def snapshot(self) -> list[str]:
        found: list[str] = []
        for pattern in self.patterns:
            if glob.has_magic(pattern):
                found.extend(sorted(glob.glob(pattern)))
            elif os.path.isdir(pattern):
                found.extend(sorted(glob.glob(os.path.join(pattern, "*.tar"))))
            elif os.path.exists(pattern):
                found.append(pattern)
        return list(dict.fromkeys(os.path.abspath(p) for p in found))

    def describe(self) -> str:
        return ", ".join(self.patterns)
