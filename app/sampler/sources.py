"""The shard list of a remote (or local) dataset, by the rules of ``feedline.formats.urls``.

- local: a directory, glob, shard path or ``file://`` URL, or a local index file;
- ``http(s)://`` shard URLs with brace lists (``shard-{000000..001281}.tar``) and ``::`` lists;
  presigned URLs (``...tar?X-Amz-Signature=...``) and compressed shards (``.tar.gz``) included; TFRecord
  (``.tfrecord``, ``.tfrecord.gz``, TFDS's names) and ``.parquet`` files too, cached as they are;
- object stores (``stores.py``): ``s3://bucket/prefix/shard-{000000..000099}.tar``, ``s3://bucket/prefix/``
  for every shard under the prefix, or a glob (``gs://bucket/train/*.tar``); ``gs://``, ``az://``,
  ``abfs://`` and ``hf://datasets/org/name[@revision]/path`` alike;
- an index file, local, over HTTP or in a store: one shard URL or path per line, optionally followed by
  its sha256 and size in bytes (``url [sha256] [bytes]``); relative entries resolve against the index;
- ``pipe:COMMAND`` (webdataset's), braces expanded: the command's stdout is the shard (``pipe.py``). Only
  the source setting itself may name one; an index file never does (``formats.urls.parse_index``).
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..cache.manifest import shard_format
from ..formats.urls import (
    RULES,
    IndexEntry,
    ShardListError,
    compression,
    expand,
    OBJECT_SCHEMES,
    is_index,
    is_pipe,
    is_remote,
    is_shard,
    local_shards,
    parse_index,
    redact,
    shard_stem,
)


class SourceError(ValueError):
    """The source setting cannot give a shard list; the message names it."""


@dataclass(frozen=True)
class SourceShard:
    """One shard of the source: where to fetch it, its cache id, and what to verify."""

    url: str  # http(s)://... or an absolute local path
    id: str  # the cache id: shards/<id>.tar (.tfrecord, .parquet: cache.manifest.SUFFIXES)
    sha256: str = ""
    size: int | None = None  # of the file as fetched (compressed, for a compressed shard)

    @property
    def shown(self) -> str:
        """The URL as logs, errors and ``manifest.json`` show it: a presigned query's values and any userinfo
        ``REDACTED`` (``formats.urls.redact``); the host and path, which say which shard it is, kept."""
        return redact(self.url)

    @property
    def format(self) -> str:
        """What it is cached as once plain: ``tar``, ``tfrecord`` or ``parquet``."""
        return shard_format(self.url)

    @property
    def is_http(self) -> bool:
        return is_remote(self.url)

    @property
    def compression(self) -> str | None:
        return compression(self.url)


def _with_ids(entries: list[IndexEntry]) -> list[SourceShard]:
    """Ids from file names; names that repeat get a short hash of their URL."""
    stems = [shard_stem(e.url) for e in entries]
    seen: dict[str, int] = {}
    for s in stems:
        seen[s] = seen.get(s, 0) + 1
    out = []
    for e, stem in zip(entries, stems):
        sid = stem if seen[stem] == 1 else f"{stem}-{hashlib.sha1(e.url.encode()).hexdigest()[:8]}"
        out.append(SourceShard(e.url, sid, e.sha256, e.size))
    return out


def list_shards(source: str, fetch_text: Callable[[str], str] | None = None,
                list_prefix: Callable[[str], list[IndexEntry]] | None = None) -> list[SourceShard]:
    """The shards a source setting names; ``fetch_text(url)`` reads a remote index, ``list_prefix(url)``
    the objects under an object store's prefix (``s3://``, ``gs://``, ``az://``, ``hf://``)."""
    source = source.strip()
    if not source:
        raise SourceError("source is empty: set --source / FEEDLINE_SOURCE to a URL pattern, an index file or a path")
    if (re.match(r"^[a-z][a-z0-9+.-]*:", source) and not is_pipe(source)
            and not source.startswith(("http://", "https://", "file://", *OBJECT_SCHEMES))):
        raise SourceError(f"source {redact(source)!r}: supported are http(s)://, s3://, gs://, az://, abfs://, "
                          f"hf://datasets/..., pipe:COMMAND, file:// and local paths")
    entries: list[IndexEntry] = []
    try:
        names = expand(source)
        for name in names:
            if is_pipe(name):
                if not name[len("pipe:"):].strip():
                    raise SourceError(f"source {name!r}: pipe: names no command (pipe:curl -sL https://...)")
                entries.append(IndexEntry(name))
            elif not is_remote(name):
                entries.extend(local_shards([name]))
            elif name.startswith(OBJECT_SCHEMES) and glob.has_magic(_path_of(name)):
                entries.extend(_matching(name, list_prefix))
            elif is_shard(name):
                entries.append(IndexEntry(name))
            elif is_index(name):
                if fetch_text is None:
                    raise SourceError(f"source {redact(name)!r} is an index file but cannot be fetched here")
                entries.extend(parse_index(fetch_text(name), name))
            elif name.startswith(OBJECT_SCHEMES) and list_prefix is not None:
                found = [e for e in list_prefix(name) if is_shard(e.url)]
                if not found:
                    raise SourceError(f"source {redact(name)!r}: no shard under this prefix ({RULES})")
                entries.extend(found)
            else:
                raise SourceError(f"source {redact(name)!r} is neither a shard nor an index file: {RULES}")
    except ShardListError as exc:
        raise SourceError(f"source {redact(source)!r}: {exc}") from None
    if not entries:
        raise SourceError(f"source {redact(source)!r}: no shard found ({RULES})")
    unique = dict((e.url, e) for e in entries).values()
    entries = [IndexEntry(e.url, e.sha256, e.size if e.size is not None or is_remote(e.url) or is_pipe(e.url)
                          or not os.path.exists(e.url) else os.path.getsize(e.url)) for e in unique]
    return _with_ids(entries)


def _path_of(url: str) -> str:
    """The part of an object store's URL after ``scheme://``: where a glob may be (a query never is)."""
    return url.partition("://")[2].partition("?")[0]


def _glob_pattern(pattern: str) -> re.Pattern[str]:
    """A glob as object stores' listings are matched: ``*`` and ``?`` stay within a folder, ``**`` crosses
    folders, ``[...]`` as fnmatch's."""
    parts = re.split(r"(\*\*/?|\*|\?|\[[^\]]*\])", pattern)
    out = []
    for part in parts:
        if part in ("**", "**/"):
            out.append("(?:.*/)?" if part == "**/" else ".*")
        elif part == "*":
            out.append("[^/]*")
        elif part == "?":
            out.append("[^/]")
        elif part.startswith("[") and part.endswith("]") and len(part) > 2:
            out.append(fnmatch.translate(part)[4:-3])  # fnmatch's class, without its (?s:...)\Z
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def _unpinned(url: str) -> str:
    """A Hub URL without its ``@revision`` (a listing pins each file to a commit: the glob names the path)."""
    if url.startswith("hf://"):
        from .hub import unpinned

        return unpinned(url)
    return url


def _matching(pattern: str, list_prefix: Callable[[str], list[IndexEntry]] | None) -> list[IndexEntry]:
    """The shards under a glob's fixed prefix that the glob matches, in order."""
    if list_prefix is None:
        raise SourceError(f"source {redact(pattern)!r} is a glob in a store but cannot be listed here")
    first = min(i for i, ch in enumerate(pattern) if ch in "*?[" and i > pattern.index("://") + 2)
    matcher = _glob_pattern(_unpinned(pattern))
    found = sorted((e for e in list_prefix(pattern[:first])
                    if is_shard(e.url) and matcher.fullmatch(_unpinned(e.url))), key=lambda e: e.url)
    if not found:
        raise SourceError(f"source {redact(pattern)!r}: no shard matches this glob ({RULES})")
    return found
