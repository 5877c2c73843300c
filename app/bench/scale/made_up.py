"""Made-up datasets for the scale simulation (issue 71): shard lists, tiny real tar shards, metadata calls counted.

Nothing here is data a loader would train on: a shard is a valid tar of ``samples`` one-byte members (what the
real index, planning and cache code read), its name what a large job's would be. What is counted is what a
shared filesystem charges for: each ``stat``, each directory read, each file opened.
"""

from __future__ import annotations

import builtins
import gzip
import io
import os
import tarfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

_BLOCK = 512


def shard_names(count: int, folder: str = "/data/train") -> list[str]:
    """``count`` shard paths as a large job's would read (``train-000000.tar``...)."""
    return [os.path.join(folder, f"train-{i:06d}.tar") for i in range(count)]


def tar_bytes(samples: int, members: tuple[str, ...] = ("bin",)) -> bytes:
    """A tar of ``samples`` samples, each with ``members`` of one byte: what a shard's index is built from."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            for ext in members:
                info = tarfile.TarInfo(f"{i:09d}.{ext}")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
    return out.getvalue()


def write_shards(folder: str, count: int, samples: int = 1, gzipped: bool = False) -> list[str]:
    """``count`` tiny shards in ``folder`` (the same bytes each: only names, sizes and indexes matter here);
    ``gzipped``: ``.tar.gz`` ones."""
    os.makedirs(folder, exist_ok=True)
    data = gzip.compress(tar_bytes(samples)) if gzipped else tar_bytes(samples)
    paths = []
    for i in range(count):
        path = os.path.join(folder, f"train-{i:06d}.tar{'.gz' if gzipped else ''}")
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths


_COUNTED = ("stat", "lstat", "listdir", "scandir", "open")


@contextmanager
def metadata_calls() -> Iterator[Counter]:
    """Count the calls a shared filesystem serves (``os.stat``, ``os.lstat``, ``os.listdir``, ``os.scandir``,
    ``os.open`` and ``open``) made by the code inside: each is a round trip to a metadata server on Lustre or NFS.
    A ``scandir`` counts once however many entries it yields (one directory read; the entries' types come with
    it)."""
    counts: Counter = Counter()
    saved = {name: getattr(os, name) for name in _COUNTED}
    saved_open = builtins.open

    def counting(name: str, fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(os, name, counting(name, fn))
    builtins.open = counting("open", saved_open)
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(os, name, fn)
        builtins.open = saved_open
