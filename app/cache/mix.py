"""A mixed cache: one folder per source (``<cache>/<name>/``, each a cache of its own) and ``mix.json``.

The mixing sidecar writes ``mix.json`` before it fills anything; a loader given the cache folder
(``cache=``, ``FEEDLINE_CACHE``) reads it and mixes the sources by the weights the sidecar was given,
so one setting drives both sides. Plain JSON, written whole (temp + rename).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass

from ..formats.files import atomic_write

MIX_FILE = "mix.json"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")  # a source's name in a mixture (mix_items.py), a folder of the cache
FORMAT = "feedline.mix/1"


@dataclass(frozen=True)
class MixPart:
    """One source of a mixed cache: its name (its folder), and its weight (None: an absolute budget only)."""

    name: str
    weight: float


def write_mix(cache_dir: str, parts: list[MixPart]) -> str:
    path = os.path.join(cache_dir, MIX_FILE)
    doc = {"format": FORMAT, "sources": [{"name": p.name, "weight": p.weight} for p in parts]}
    atomic_write(path, json.dumps(doc, indent=1))
    return path


def read_mix(cache_dir: str) -> list[MixPart] | None:
    """The sources of a mixed cache; None for a cache of one source (no ``mix.json``)."""
    try:
        with open(os.path.join(cache_dir, MIX_FILE)) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{os.path.join(cache_dir, MIX_FILE)} is not a {FORMAT} file")
    parts = [MixPart(str(s["name"]), float(s["weight"])) for s in doc["sources"]]
    for p in parts:  # a name becomes a folder: one under the cache, never a path out of it
        if not _NAME.fullmatch(p.name) or p.name in (".", ".."):
            raise ValueError(f"{os.path.join(cache_dir, MIX_FILE)} names a source {p.name!r}, which is no folder "
                             f"name of a mixed cache (letters, digits and ._- only): it was not written by feedline's "
                             f"sampler; remove it, or use a cache directory of your own")
    return parts


def part_dir(cache_dir: str, name: str) -> str:
    return os.path.join(cache_dir, name)


def wait_for_layout(cache_dir: str, timeout: float) -> list[MixPart] | None:
    """Once the sidecar has started writing the cache: its sources if it mixes, else None.

    A trainer may start before its sidecar (compose, Kubernetes): the cache folder says which kind it
    is only once ``manifest.json`` (one source) or ``mix.json`` is there. Past ``timeout``: one source,
    and the caller's wait for shards says what is missing.
    """
    deadline = time.monotonic() + timeout
    while True:
        parts = read_mix(cache_dir)
        if parts is not None or os.path.exists(os.path.join(cache_dir, "manifest.json")) \
                or time.monotonic() >= deadline:
            return parts
        time.sleep(0.2)
