"""What the contenders' processes leave in /dev/shm: torch's shared-memory files of dead workers, removed."""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger("feedline.bench")


def torch_shm() -> set[str]:
    """The names of torch's shared-memory files in /dev/shm now (``torch_<pid>_...``)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("torch_")} if os.path.isdir("/dev/shm") else set()


def remove_orphaned_torch_shm(before: set[str], label: str) -> None:
    """torch's shared-memory files (``torch_<pid>_...``) a contender's dead workers left in /dev/shm: LitData's
    loader leaves a batch's when its workers are shut down with one in flight. The bench leaves nothing."""
    left = []
    for name in sorted(torch_shm() - before):
        pid = name.split("_")[1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))
            left.append(name)
    if left:
        log.warning("%s left %d shared-memory file(s) of torch's in /dev/shm (%s): removed", label, len(left),
                    ", ".join(left))
