"""The shard list of a remote (or local) dataset.

- a local directory, glob, or ``file://`` path;
- ``http(s)://`` shard URLs with WebDataset brace expansion (``shard-{000000..001281}.tar``);
- an index file, local or over HTTP: one shard URL or path per line, optionally followed by its
  sha256 and size in bytes (``url [sha256] [bytes]``); relative entries resolve against the index.

``pipe:`` and other shell sources are refused: nothing here runs a command.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import urllib.parse
from dataclasses import dataclass

_BRACE = re.compile(r"\{([^{}]*(?:\.\.|,)[^{}]*)\}")
_RANGE = re.compile(r"(\d+)\.\.(\d+)")


class SourceError(ValueError):
    """The source setting cannot give a shard list; the message names it."""


@dataclass(frozen=True)
class SourceShard:
    url: str  # http(s)://... or an absolute local path
    id: str  # the cache id: shards/<id>.tar
    sha256: str = ""
    size: int | None = None

    @property
    def is_http(self) -> bool:
        return self.url.startswith(("http://", "https://"))


def expand_braces(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` -> a-000.tar, a-001.tar, a-002.tar; ``{x,y}`` lists too; left to right."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end():]
    r = _RANGE.fullmatch(body)
    if r:
        lo, hi = r.group(1), r.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        alts = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        alts = body.split(",")
    return [out for alt in alts for out in expand_braces(head + alt + tail)]


def _stem(url: str) -> str:
    name = os.path.basename(urllib.parse.urlparse(url).path) if "://" in url else os.path.basename(url)
    stem = name[:-4] if name.endswith(".tar") else name
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem) or "shard"


def _with_ids(entries: list[tuple[str, str, int | None]]) -> list[SourceShard]:
    """Ids from file names; names that repeat get a short hash of their URL."""
    stems = [_stem(u) for u, _, _ in entries]
    seen: dict[str, int] = {}
    for s in stems:
        seen[s] = seen.get(s, 0) + 1
    out = []
    for (url, sha, size), stem in zip(entries, stems):
        sid = stem if seen[stem] == 1 else f"{stem}-{hashlib.sha1(url.encode()).hexdigest()[:8]}"
        out.append(SourceShard(url, sid, sha, size))
    return out


def _read_index(text: str, base: str) -> list[tuple[str, str, int | None]]:
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        url = parts[0]
        if not url.startswith(("http://", "https://", "/")):
            url = urllib.parse.urljoin(base, url) if base.startswith(("http://", "https://")) else \
                os.path.join(os.path.dirname(base), url)
        sha = ""
        size = None
        for extra in parts[1:]:
            if re.fullmatch(r"[0-9a-fA-F]{64}", extra):
                sha = extra.lower()
            elif extra.isdigit():
                size = int(extra)
            else:
                raise SourceError(f"index {base} line {lineno}: {extra!r} is neither a sha256 nor a size")
        entries.append((url, sha, size))
    return entries


def list_shards(source: str, fetch_text=None) -> list[SourceShard]:  # type: ignore[no-untyped-def]
    """The shards a source setting names; ``fetch_text(url)`` reads an index over HTTP."""
    source = source.strip()
    if not source:
        raise SourceError("source is empty: set --source / FEEDLINE_SOURCE to a URL pattern, an index file or a path")
    if source.startswith("pipe:") or re.match(r"^[a-z][a-z0-9+.-]*:", source) and not source.startswith(
            ("http://", "https://", "file://")):
        raise SourceError(f"source {source!r}: only http(s)://, file:// and local paths are supported "
                          f"(no pipe: or shell sources)")
    if source.startswith("file://"):
        source = urllib.parse.urlparse(source).path
    patterns = expand_braces(source)
    if source.startswith(("http://", "https://")):
        if all(p.endswith(".tar") for p in patterns):
            return _with_ids([(p, "", None) for p in patterns])
        if fetch_text is None:
            raise SourceError(f"source {source!r} looks like an index file but cannot be fetched here")
        return _with_ids(_read_index(fetch_text(source), source))
    if len(patterns) == 1 and os.path.isfile(patterns[0]) and not patterns[0].endswith(".tar"):
        with open(patterns[0]) as f:
            return _with_ids(_read_index(f.read(), os.path.abspath(patterns[0])))
    found: list[str] = []
    for p in patterns:
        if os.path.isdir(p):
            found.extend(sorted(glob.glob(os.path.join(p, "*.tar"))))
        elif glob.has_magic(p):
            found.extend(sorted(glob.glob(p)))
        elif os.path.exists(p):
            found.append(p)
    if not found:
        raise SourceError(f"source {source!r}: no shard found (a directory of .tar files, a glob, "
                          f"an index file, or http(s):// URLs)")
    return _with_ids([(os.path.abspath(p), "", os.path.getsize(p)) for p in dict.fromkeys(found)])
