"""The epoch's shards, held open by the trainer so that a replacement worker reads what the one it replaces read.

A worker opens its epoch's shards as the epoch starts, and reads a shard the sidecar evicts later
in the epoch through that descriptor. A worker that dies mid-epoch is replaced by one that replays
the dead one's stream up to where it stopped: opening the shards by path, it would miss those
evicted since, its shuffle would differ, and samples would repeat or go missing. So the trainer
opens the epoch's shards too, when the epoch starts, and a replacement inherits the descriptors
(``launch.py``), using one wherever the path is gone. The descriptors are closed at the next
epoch, or when the loader closes; a worker closes its inherited ones after its first epoch opens.
"""

from __future__ import annotations

import os
import resource

MAX_HELD = 1024  # at most; and at most a quarter of the process's descriptor limit


def _limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_HELD if soft == resource.RLIM_INFINITY else max(0, min(MAX_HELD, soft // 4))


class HeldShards:
    """Read-only descriptors of the current epoch's shards (the first ones of each worker's list), by path."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def hold(self, paths: list[str]) -> None:
        """Hold ``paths`` (opened now) instead of the last epoch's; a path that cannot be opened is left out."""
        self.close()
        room = _limit()
        for path in paths:
            if len(self.fds) >= room:
                break
            if path not in self.fds:
                try:
                    self.fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    pass  # gone already: the workers find it gone too

    def close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)
