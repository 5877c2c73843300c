"""Shard lists as users write them: one set of rules for the loader's ``shards=`` and the sidecar's ``--source``.

- brace lists expand as in bash and webdataset (``shard-{000000..000099}.tar``, ``{a,b}``, nested,
  stepped ``{0..6..2}``, descending ``{3..1}``), through the ``braceexpand`` package;
- several lists join with ``::`` (webdataset's convention);
- ``file://`` URLs are local paths;
- a name is a **shard** when its path, before any ``?query``, ends in a shard suffix (``.tar``,
  ``.tar.gz``, ``.tgz``, ``.tar.zst``; TFRecord files: ``.tfrecord``, ``.tfrecords``, either ``.gz``,
  and TFDS's ``<name>.tfrecord-00000-of-00016``; Parquet files: ``.parquet``); an **index file**
  when it ends in an index suffix (``.txt``, ``.lst``, ``.list``, ``.index``): one shard per line,
  optionally followed by its sha256 and size; or ``.json``, a webdataset (``wids``) shard index, which gives
  each shard's sample count too (``wids_index.py``); anything else is refused with these rules named;
- a local directory stands for the shards in it; a local glob for the shards it matches; an object
  store's ``s3://``, ``gs://``, ``az://`` or ``hf://`` prefix that is neither a shard nor an index stands
  for the shards under it, and a glob there for the shards it matches;
- ``pipe:COMMAND`` (webdataset's): the command's stdout is the shard; its name is the last word of the
  command that names a shard (``pipe:curl -sL https://host/a/shard-0001.tar`` is ``shard-0001.tar``).
  Only the user's own setting may name one: an index file never does.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import hashlib
import logging
import os
import posixpath
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from braceexpand import braceexpand

from . import listing, wids_index

TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords", ".tfrecord.gz", ".tfrecords.gz")
TFDS_NAME = re.compile(r"\.tfrecords?-\d+-of-\d+(\.gz)?$")  # TFDS's files: mnist-train.tfrecord-00000-of-00001
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.zstd", *TFRECORD_SUFFIXES, ".parquet")
STEM_MAX = 160  # a shard's cache id: its stem, and "-<8 hex>" where stems repeat (cache.manifest.ID_MAX)
INDEX_SUFFIXES = (".txt", ".lst", ".list", ".index", ".json")  # .json: a wids shard index (wids_index.py)
OBJECT_SCHEMES = ("s3://", "gs://", "gcs://", "az://", "abfs://", "hf://")  # sampler.stores.MODULES
REMOTE_SCHEMES = ("http://", "https://", *OBJECT_SCHEMES)
PIPE = "pipe:"
RULES = (f"a shard ends in {', '.join(SHARD_SUFFIXES)} (or is TFDS's <name>.tfrecord-00000-of-00016) "
         f"(before any ?query); an index file in "
         f"{', '.join(INDEX_SUFFIXES)}; a local directory or glob stands for its shards")


REDACTED = "REDACTED"
_URL_IN_TEXT = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]*[^\s'\"<>.,:;)\]]")  # no trailing punctuation


def redact(url: str) -> str:
    """A URL as logs, errors, metrics and ``manifest.json`` may show it: scheme, host, port and path kept (the
    shard stays recognisable), the userinfo, every query value, any fragment and what the path carries of a
    secret (``redact_path``) replaced by ``REDACTED``.

    Every query value, not a list of known secret names: presigned URLs spread their secret over parameters
    whose names vary by vendor (``X-Amz-Signature``/``X-Amz-Security-Token``, ``X-Goog-Signature``, Azure's
    ``sig``, CloudFront's ``Signature``/``Policy``, Akamai's ``hdnts``, anyone's ``token``), and a shard is
    recognised by its host and path, never by a query value. The parameter names stay: they say it was
    presigned. A local path (no ``scheme://``) is returned as it is.
    """
    if "://" not in url:  # a local path
        return url
    try:
        u = urllib.parse.urlsplit(url)
        netloc = u.netloc
    except ValueError:  # an unparseable netloc ("http://[::1"): nothing of it is shown
        return url.split("://", 1)[0] + "://" + REDACTED
    if "@" in netloc and not (u.scheme == "abfs" and ":" not in netloc.rpartition("@")[0]):
        netloc = REDACTED + "@" + netloc.rpartition("@")[2]  # (abfs://container@account...: a container, no user)
    out = f"{u.scheme}://{netloc}{redact_path(u.path)}"
    if u.query:
        out += "?" + "&".join(part.partition("=")[0] + "=" + REDACTED if "=" in part else REDACTED
                              for part in u.query.split("&") if part)
    if u.fragment:
        out += "#" + REDACTED
    return out


# Path segments that are secrets by their shape: a token a CDN or a store puts in the path instead of the query.
_JWT = re.compile(r"eyJ[\w-]*\.[\w-]+\.[\w-]*")
_SECRET_SEGMENTS = re.compile(
    r"(?:hf|ghp|gho|ghs|ghu|github_pat|glpat|xox[abpr]|sk|sv|sig|se|sp)[-_=][\w-]{8,}"  # a vendor token, Azure SAS parts
    r"|AKIA[0-9A-Z]{16}"  # an AWS access key id
    r"|(?=[\w+/-]*\d)(?=[\w+/-]*[A-Za-z])[\w+/-]{32,}={0,2}")  # a long opaque string of letters and digits
_PARAM_IN_PATH = re.compile(r"([;~&,]?[\w.-]+=)([^;~&,/]*)")  # name=value in a path segment (Akamai's ~hmac=, ;sig=)


def redact_path(path: str) -> str:
    """A URL's path with what it carries of a secret replaced by ``REDACTED``: every ``name=value`` value in a segment
    (a token in the path: ``/__token__/exp=...~hmac=...``, ``;sig=...``), and whole segments shaped like a secret (a
    JWT, a vendor's token, an access key id, a long opaque string of letters and digits with no extension).
    A shard's file name (it has an extension) stays: the shard stays recognisable."""
    if not path:
        return path
    out = []
    for seg in path.split("/"):
        if "=" in seg:
            seg = _PARAM_IN_PATH.sub(lambda m: m.group(1) + REDACTED, seg)
        elif _JWT.fullmatch(seg) or ("." not in seg and _SECRET_SEGMENTS.fullmatch(seg)):
            seg = REDACTED
        out.append(seg)
    return "/".join(out)


def redact_text(text: str) -> str:
    """Every URL in a message redacted (``redact``): for text that may quote one, an exception's included."""
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


class RedactingFormatter(logging.Formatter):
    """A log formatter that redacts every URL of a record, its traceback included: the appliance's net under what
    the parts redact themselves, for what a library quotes (an exception's text)."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


class ShardListError(ValueError):
    """A shard list that names nothing readable; the message says which entry and the rules."""


@dataclass(frozen=True)
class IndexEntry:
    """One line of an index file: a shard's URL or path, and what to verify it against."""

    url: str
    sha256: str = ""
    size: int | None = None
    samples: int | None = None  # its sample count, where the index gives it (a wids shard index)


def expand(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Every name a spec stands for, in order: ``::`` lists, then braces; ``file://`` made a path."""
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    out: list[str] = []
    for item in items:
        for part in os.fspath(item).split("::"):
            part = part.strip()
            if part:
                out.extend(_local_path(name) for name in braceexpand(part))
    return out


def _local_path(name: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(name).path) if name.startswith("file://") else name


def url_path(name: str) -> str:
    """The path part of a URL or a local path: what the suffix rules look at (a ``pipe:``'s: its shard word's)."""
    if is_pipe(name):
        return pipe_target(name)
    return urllib.parse.urlsplit(name).path if is_remote(name) else name


def is_remote(name: str) -> bool:
    return name.startswith(REMOTE_SCHEMES)


def is_pipe(name: str) -> bool:
    return name.startswith(PIPE)


def pipe_target(name: str) -> str:
    """The path of the shard a ``pipe:`` command reads: its last word that names a shard (a URL's path, a
    file), else its last word; what the command's output is taken for (tar, TFRecord, Parquet) and named."""
    words = name[len(PIPE):].split()
    paths = [urllib.parse.urlsplit(w).path if "://" in w else w for w in words]
    named = [p for p in paths if p.lower().endswith(SHARD_SUFFIXES) or TFDS_NAME.search(p.lower())]
    return named[-1] if named else (paths[-1] if paths else "")


def is_shard(name: str) -> bool:
    return url_path(name).lower().endswith(SHARD_SUFFIXES) or is_tfrecord(name)


def is_index(name: str) -> bool:
    return url_path(name).lower().endswith(INDEX_SUFFIXES)


def compression(name: str) -> str | None:
    """``gzip``, ``zstd`` or None for a shard name."""
    path = url_path(name).lower()
    if path.endswith((".tar.gz", ".tgz")) or (path.endswith(".gz") and is_tfrecord(name)):
        return "gzip"
    if path.endswith((".tar.zst", ".tar.zstd")):
        return "zstd"
    return None


@functools.lru_cache(maxsize=4096)  # asked of a shard's name for each of its samples
def is_tfrecord(name: str) -> bool:
    """A TFRecord file's name: ``.tfrecord``, ``.tfrecords``, either ``.gz``, or TFDS's
    ``<name>.tfrecord-00000-of-00016``."""
    path = url_path(name).lower()
    return path.endswith(TFRECORD_SUFFIXES) or TFDS_NAME.search(path) is not None


@functools.lru_cache(maxsize=4096)
def is_parquet(name: str) -> bool:
    return url_path(name).lower().endswith(".parquet")


def plain_suffix(name: str) -> str:
    """What the shard is once decompressed: ``.tfrecord`` for TFRecord files, else ``.tar``."""
    return ".tfrecord" if is_tfrecord(name) else ".tar"


def shard_stem(name: str) -> str:
    """The shard's name without its suffix, safe as a file name: ``.../train-0001.tar.gz?x=1`` -> ``train-0001``;
    letters, digits, ``._-`` only, no leading dot, at most ``STEM_MAX`` characters (cache ids:
    ``cache.manifest.check_id``)."""
    base = os.path.basename(url_path(name))
    for suffix in sorted(SHARD_SUFFIXES, key=len, reverse=True):
        if base.lower().endswith(suffix):
            base = base[: -len(suffix)]
            break
    else:
        if base.lower().endswith(".gz") and TFDS_NAME.search(base.lower()):
            base = base[: -len(".gz")]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip(".") or "shard"  # never ".." nor a hidden file
    if len(stem) > STEM_MAX:  # a file name has 255 bytes, and the cache adds a suffix and a partial's name
        stem = f"{stem[:STEM_MAX - 9]}-{hashlib.sha1(stem.encode()).hexdigest()[:8]}"
    return stem


def _remote_entry(entry: str, base: str, where: str) -> str:
    """An entry of a remote index as a URL: relative ones resolve against the index's own URL (``/x.tar`` on its
    host, ``x.tar`` beside it); another scheme (``file:``, ``pipe:``...) is refused by name."""
    scheme = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*):", entry)
    if scheme and not is_remote(entry):
        raise ShardListError(f"index {redact(base)} {where}: {redact(entry)!r} is a {scheme.group(1)}: entry; "
                             f"a remote index names remote shards only (http://, https://, s3://, or paths "
                             f"relative to the index)")
    if is_remote(entry):
        return entry
    if base.startswith("s3://"):  # urljoin knows no s3: the bucket is the root, the index's folder the base
        bucket, _, key = base[len("s3://"):].partition("/")
        path = entry if entry.startswith("/") else "/" + posixpath.join(posixpath.dirname(key), entry)
        return f"s3://{bucket}{posixpath.normpath(path)}"
    return urllib.parse.urljoin(base, entry)


def _entry_url(entry: str, base: str, where: str) -> str:
    """An index's entry (at ``where`` in it) as a URL or path: relative ones resolve against its location ``base``."""
    if is_remote(base):  # a remote index names remote shards only, never a file of this host
        return _remote_entry(entry, base, where)
    url = _local_path(entry)
    if not is_remote(url) and not os.path.isabs(url):
        url = os.path.join(os.path.dirname(base), url)
    return url


def parse_index(text: str, base: str) -> list[IndexEntry]:
    """Lines of ``url [sha256] [size]``; ``#`` starts a comment; relative entries resolve against ``base``.
    A JSON document is a wids shard index (``wids_index.py``): its entries carry their sample counts."""
    if wids_index.looks_like(text):
        try:
            listed = wids_index.parse(text)
        except ValueError as exc:
            raise ShardListError(f"index {redact(base)}: {exc}") from None
        return [IndexEntry(_entry_url(e.url, base, f"shardlist[{i}]"), "", e.size, e.samples)
                for i, e in enumerate(listed)]
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        url = _entry_url(parts[0], base, f"line {lineno}")
        sha, size = "", None
        for extra in parts[1:]:
            if re.fullmatch(r"[0-9a-fA-F]{64}", extra):
                sha = extra.lower()
            elif extra.isdigit():
                size = int(extra)
            else:
                raise ShardListError(f"index {redact(base)} line {lineno}: {extra!r} is neither a sha256 nor a size")
        entries.append(IndexEntry(url, sha, size))
    return entries


def local_shards(names: Sequence[str]) -> list[IndexEntry]:
    """The local shards that expanded names stand for: directories, globs, shard files, index files.

    Names that match nothing (yet) give nothing: a growing directory or glob is no error here.
    """
    found: list[IndexEntry] = []
    listed = _listed_names(names)
    for name in names:
        if is_remote(name):
            raise ShardListError(f"{redact(name)} is remote; only local names are listed here")
        if name in listed:  # its folder was read once: what it is comes with the entry
            entry = listed[name]
            if entry is None:
                continue  # not there (yet)
            if entry.is_dir():
                found.extend(IndexEntry(p) for p in _shards_in(os.path.join(glob.escape(name), "*")))
            elif not entry.is_file():
                raise ShardListError(f"{name} is not a regular file; a local shard must be one")
            else:
                found.append(IndexEntry(name))
            continue
        if os.path.isdir(name):
            found.extend(IndexEntry(p) for p in _shards_in(os.path.join(glob.escape(name), "*")))
        elif glob.has_magic(name):
            found.extend(IndexEntry(p) for p in _shards_in(name))
        elif is_index(name) and os.path.isfile(name):
            with open(name) as f:
                entries = parse_index(f.read(), os.path.abspath(name))
            _list_folders_of(entries)
            found.extend(entries)
        elif is_shard(name):
            if os.path.exists(name) and not os.path.isfile(name):  # a FIFO, a device, a folder: never read
                raise ShardListError(f"{name} is not a regular file; a local shard must be one")
            if os.path.exists(name):
                found.append(IndexEntry(name))
        elif os.path.exists(name):
            raise ShardListError(f"{name} is neither a shard nor an index file: {RULES}")
    unique = {os.path.abspath(e.url) if not is_remote(e.url) else e.url: e for e in found}
    return [IndexEntry(url, e.sha256, e.size, e.samples) for url, e in unique.items()]


LIST_AT = 32  # shard names given one by one in a folder from which it is read once, not a stat a name


def _listed_names(names: Sequence[str]) -> dict[str, os.DirEntry | None]:
    """Shard names given one by one (a brace list: ``train-{000000..099999}.tar``), many of them in one folder: that
    folder read once, each name's entry (None: not there). A stat a name is a round trip to a shared filesystem's
    metadata server, a directory read one for all of them."""
    by_folder: dict[str, list[str]] = {}
    for name in names:
        if not is_remote(name) and not glob.has_magic(name) and is_shard(name):
            by_folder.setdefault(os.path.dirname(name), []).append(name)
    out: dict[str, os.DirEntry | None] = {}
    for folder, mine in by_folder.items():
        if len(mine) < LIST_AT:
            continue
        seen = listing.read(folder)
        if seen is None:  # missing or unreadable: each name is asked for itself, as before
            continue
        out.update((name, seen.get(os.path.basename(name))) for name in mine)
    return out


def _list_folders_of(entries: Sequence[IndexEntry]) -> None:
    """An index file's many local shards in a folder: that folder read once, so that the index files beside them
    are known (``listing.index_absent``) and a rank reading its own shards' indexes pays no failed ``open`` each."""
    by_folder: dict[str, int] = {}
    for e in entries:
        if not is_remote(e.url):
            folder = os.path.dirname(e.url)
            by_folder[folder] = by_folder.get(folder, 0) + 1
    for folder, n in by_folder.items():
        if n >= LIST_AT:
            listing.read(folder)


def _shards_in(pattern: str) -> list[str]:
    """The regular shard files a pattern matches. Where only its last part has wildcards (a folder, ``dir/*.tar``),
    one directory read: the entries' types come with it, so 100,000 shards cost no ``stat`` each (a round trip
    to the metadata server on a shared filesystem); its index files are noted (``listing.py``)."""
    folder, name = os.path.split(pattern)
    if glob.has_magic(folder):
        return sorted(p for p in glob.glob(pattern) if is_shard(p) and os.path.isfile(p))
    seen = listing.read(folder)
    if seen is None:  # missing, not a folder, not readable: matches nothing, as glob's
        return []
    hidden = name.startswith(".")  # glob's rule: a wildcard matches no leading dot
    return sorted(os.path.join(folder, n) for n, e in seen.items()
                  if (hidden or not n.startswith(".")) and fnmatch.fnmatchcase(n, name) and is_shard(n) and e.is_file())

