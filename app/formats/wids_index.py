"""A webdataset shard index (``widsindex create`` of the ``wids`` package writes ``shardindex.json``): each shard's
URL with its sample count, so a listing gives the counts an epoch's plan needs without opening a shard.

    {"__kind__": "wids-shard-index-v1", "wids_version": 1, "base": "optional/prefix/",
     "shardlist": [{"url": "train-000000.tar", "nsamples": 1000, "filesize": 1234567, "md5sum": "..."}, ...]}

``url`` is relative to ``base`` when given, else to the index's own location (as ``wids`` resolves it);
``filesize`` is checked like an index line's size; ``md5sum`` is not checked (a line's sha256 is).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

FORMAT = ('a JSON shard list is a wids shard index: {"wids_version": 1, "shardlist": [{"url": ..., "nsamples": ...}, '
          '...]}, as `widsindex create` writes it')


class Listed(NamedTuple):
    """One shard of the index: its URL as written (``base`` applied), samples, bytes (None: not given)."""

    url: str
    samples: int
    size: int | None


def looks_like(text: str) -> bool:
    """A JSON document, not the lines of a plain index."""
    return text.lstrip().startswith("{")


def _count(shard: dict[str, Any], key: str, where: str) -> int:
    value = shard.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {key} is {value!r}; give a whole number >= 0")
    return value


def parse(text: str) -> list[Listed]:
    """The shards of a wids index, in its order; ``ValueError`` naming what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc}); {FORMAT}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("shardlist"), list):
        raise ValueError(f"it has no shardlist; {FORMAT}")
    if doc.get("wids_version", 1) != 1:
        raise ValueError(f"wids_version {doc.get('wids_version')!r} is not 1; {FORMAT}")
    if doc.get("datasets"):
        raise ValueError("it names sub-datasets (\"datasets\"), which are not followed: list each dataset's own "
                         "shardindex.json, or give them as a mixture's sources")
    base = doc.get("base")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"base is {base!r}; give a URL or a path prefix")
    out = []
    for i, shard in enumerate(doc["shardlist"]):
        where = f"shardlist[{i}]"
        if not isinstance(shard, dict) or not isinstance(shard.get("url"), str) or not shard["url"]:
            raise ValueError(f"{where} is not an object with a url; {FORMAT}")
        url = shard["url"]
        if base and "://" not in url and not url.startswith("/"):  # a base is a folder, with or without its "/"
            url = base.rstrip("/") + "/" + url
        size = _count(shard, "filesize", where) if shard.get("filesize") is not None else None
        out.append(Listed(url, _count(shard, "nsamples", where), size))
    return out
