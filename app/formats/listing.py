"""What the last listing of a folder saw of the index files beside its shards.

On a shared filesystem each ``stat`` and each ``open`` is a round trip to its metadata server: a rank that lists
a folder of 100,000 shards and then looks for a ``.idx`` beside each of its own pays one failed ``open`` a shard
where the dataset has none. The listing (one directory read) already knows: ``index_absent`` says so, for folders
listed in this process. An index written after the listing is simply not used until the next one (the shard's own
headers give the same index).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable

FOLDERS = 64  # folders remembered (a mixture lists a few; a dataset one)
_seen: OrderedDict[str, frozenset[str]] = OrderedDict()
_lock = threading.Lock()


def read(folder: str) -> dict[str, os.DirEntry] | None:
    """``folder``'s entries by name, from one directory read (their types come with them: no ``stat`` each), its
    index files remembered; None where it cannot be read (missing, not a folder, not readable)."""
    try:
        with os.scandir(folder or os.curdir) as entries:
            seen = {e.name: e for e in entries}
    except OSError:
        return None
    listed(folder or os.curdir, seen)
    return seen


def listed(folder: str, names: Iterable[str]) -> None:
    """A listing of ``folder`` just read ``names``: the index files among them are remembered."""
    indexes = frozenset(n for n in names if n.endswith(".idx"))
    with _lock:
        _seen[os.path.abspath(folder)] = indexes
        _seen.move_to_end(os.path.abspath(folder))
        while len(_seen) > FOLDERS:
            _seen.popitem(last=False)


def index_absent(index_path: str) -> bool:
    """The last listing of the index's folder saw no such file (False where the folder was not listed here)."""
    folder, name = os.path.split(os.path.abspath(index_path))
    with _lock:
        names = _seen.get(folder)
    return names is not None and name not in names
