"""Google Cloud Storage (``gs://``) and Azure Blob Storage (``az://``, ``abfs://``) through obstore.

obstore is the Python face of the Rust ``object_store`` crate (Apache Arrow's): one client for both clouds,
with its own retries (backoff on 429, 5xx and dropped connections) and connection pool, and every request
made without the GIL, so ranged GETs run in parallel in plain threads. One ``CloudStore`` answers for every
cloud scheme and keeps one client per bucket or container, made from each cloud's standard environment
(``cloudenv.py``).

A large object is fetched with ranged GETs of ``PART`` bytes in parallel (``ranged.py``), each streamed into
its place in the new file in chunks of ``CHUNK``: no more than a chunk per part is ever held in memory. Every
error is a ``StoreError`` naming the object and what to do: no credentials (and which variables), access
denied, no such bucket / container / object, the endpoint unreachable, throttled.

Where the credentials sign here (Azure with an account key or a SAS token), ``presigned`` gives the fetcher a
signed URL, and its HTTP transport downloads the object instead of the client: over loopback from Azurite, in
one process, it took 0.42-0.52 core-seconds a GB against obstore's 0.75-0.93 (``docs/sidecar.md``). A refusal
of a signed URL sends the object back to the client, whose answer names the fix.

Why one file for both clouds: one error vocabulary and one ranged download serve both; split by cloud, the
download and the error mapping would be written twice.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

from ..formats.files import create_new
from ..formats.urls import redact, redact_text
from .cloudenv import AZURE_VARIABLES, GCS_VARIABLES, Client, Location, make_client, parse, unset_empty_variables
from .ranged import CHUNK, in_parallel, stream_into
from .stores import MAX_LIST_BYTES, ListingBound, StoreContext, StoreError, StoreObject

log = logging.getLogger("feedline.sampler")

PART = 16 << 20  # ranged GETs of this size, in parallel, for objects larger than it (as s3.py)
_OURS = __name__.split(".")[0] + "."  # exceptions raised by feedline itself (a stop, a budget) pass through


class CloudStore:
    """GCS and Azure Blob Storage for a fetcher: list, size, text, download and presigned (``stores.Store``)."""

    def __init__(self, timeout: float = 30.0, retries: int = 3, threads: int = 4,
                 max_list_bytes: int = MAX_LIST_BYTES):
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise StoreError("denied", "gs:// and az:// sources need obstore (pip install obstore; the image has "
                                       "it)", retry=False) from None
        self.threads = max(1, threads)
        self.max_list_bytes = max_list_bytes  # a listing's objects, in all (stores.ListingBound)
        # object_store's timeout bounds a whole request; a request moves at most PART bytes (a part, or an object
        # no larger), so this is a floor of PART / (4 x timeout) bytes/s, 0.14 MB/s at 30 s.
        self._client_options = {"connect_timeout": timedelta(seconds=min(timeout, 10.0)),
                                "timeout": timedelta(seconds=4 * max(timeout, 30.0)),
                                "pool_max_idle_per_host": str(threads * (threads + 1))}
        self._retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=max(60.0, 4 * timeout)),
                       "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15),
                                   "base": 2}}
        self._clients: dict[tuple[str, str, str | None], Client] = {}
        self._lock = threading.Lock()
        unset_empty_variables()

    # -- clients ---------------------------------------------------------------------------------------

    def _client(self, loc: Location) -> Client:
        """The client for ``loc``'s bucket or container, made at its first use."""
        with self._lock:
            made = self._clients.get(loc.ident)
            if made is None:
                made = self._clients[loc.ident] = make_client(loc, self._client_options, self._retry)
            return made

    # -- errors -----------------------------------------------------------------------------------

    def _explain(self, exc: BaseException, loc: Location, what: str, endpoint: str) -> StoreError:
        """``exc`` as a person can act on it; ``what`` names the request (a URL, "listing URL")."""
        if isinstance(exc, StoreError):
            return exc
        from obstore import exceptions as oe

        said = redact_text(str(exc)).strip()
        brief = said.splitlines()[0][:300] if said else type(exc).__name__
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreError("no_space", f"{what}: the cache filesystem is full ({exc.strerror}); it is tried "
                                          f"again later", retry=False)
        if isinstance(exc, OSError) and exc.filename is not None:  # the cache's own file, not the store's answer
            return StoreError("connection", f"{what}: {exc.strerror}: {exc.filename}", retry=True)
        fix = GCS_VARIABLES if loc.cloud == "gcs" else AZURE_VARIABLES
        if isinstance(exc, oe.UnauthenticatedError) or _status(said) == 401:
            return StoreError("denied", f"{what}: access denied (not authenticated): check the credentials "
                                        f"({fix})", retry=False)
        if isinstance(exc, oe.PermissionDeniedError) or _status(said) == 403:
            return StoreError("denied", f"{what}: access denied: check the credentials and the {loc.what}'s "
                                        f"permissions ({fix})", retry=False)
        if _NO_BUCKET.search(said):  # GCS: 404 NoSuchBucket (fake-gcs-server: 500 "no bucket named"); Azure's
            return self._no_bucket(loc, endpoint)
        if isinstance(exc, oe.NotFoundError) or _status(said) == 404:
            return StoreError("http_status", f"{what}: no such object in {loc.what}", retry=False)
        if re.search(r"[Cc]redential|metadata|token", said) and not _status(said):
            return StoreError("denied", f"{what}: no usable {'GCS' if loc.cloud == 'gcs' else 'Azure'} credentials "
                                        f"({brief}): set {fix}", retry=False)
        status = _status(said)
        if status in (429, 503) or (status or 0) >= 500:
            return StoreError("http_status", f"{what}: the store answered {status} (throttled or unavailable) "
                                             f"after retries; it is tried again later", retry=True)
        if status:
            return StoreError("http_status", f"{what}: {status} {brief}", retry=False)
        if re.search(r"error sending request|kind: (?:Connect|Timeout|Request)|[Cc]onnection|dns error|timed out",
                     said):
            where = "STORAGE_EMULATOR_HOST" if loc.cloud == "gcs" else "AZURE_STORAGE_CONNECTION_STRING's BlobEndpoint"
            # not "retry_timeout: 180s", which every retried error quotes
            timeout = re.search(r"kind: Timeout|timed out|deadline has elapsed", said) is not None
            return StoreError("timeout" if timeout else "connection",
                              f"{what}: the endpoint {endpoint} is unreachable ({brief}); check the network, or "
                              f"{where} for an emulator", retry=True)
        return StoreError("connection", f"{what}: {type(exc).__name__}: {brief}", retry=True)

    @staticmethod
    def _no_bucket(loc: Location, endpoint: str) -> StoreError:
        return StoreError("http_status", f"{loc.head}: no such {loc.what} at {endpoint}", retry=False)

    def _bucket_missing(self, store: Any, loc: Location) -> bool:
        """After a 404 for an object: is it the whole bucket or container that is missing?"""
        import obstore

        try:
            for _ in obstore.list(store, prefix=loc.key.rsplit("/", 1)[0] if "/" in loc.key else None,
                                  chunk_size=1):
                break
        except Exception as exc:  # a listing's 404 (or fake-gcs-server's 500 "no bucket named") is the bucket's
            said = str(exc)
            return _NO_BUCKET.search(said) is not None or _status(said) == 404
        return False

    def _call(self, url: str, what: str, fn: Callable[[Any, Location], Any]) -> Any:
        loc = parse(url)
        client = self._client(loc)
        store, endpoint = client.store, client.endpoint
        try:
            return fn(store, loc)
        except Exception as exc:
            if type(exc).__module__.startswith(_OURS) and not isinstance(exc, StoreError):
                raise  # the progress callback's own (a stop, a budget)
            error = self._explain(exc, loc, what, endpoint)
        if "no such object" in str(error) and self._bucket_missing(store, loc):
            error = self._no_bucket(loc, endpoint)
        raise error

    # -- requests -----------------------------------------------------------------------------------

    def list(self, url: str) -> list[StoreObject]:
        """Every object under a prefix (``gs://bucket/prefix``, recursively); the prefix may end mid-name."""
        import obstore

        def run(store: Any, loc: Location) -> list[StoreObject]:
            # object_store lists by whole path segments: list the folder, keep what starts with the prefix
            folder = loc.key.rsplit("/", 1)[0] if "/" in loc.key else ""
            out = []
            bound = ListingBound(f"listing {redact(url)}", self.max_list_bytes)  # paged, and bounded in all
            for page in obstore.list(store, prefix=folder or None, chunk_size=1000):
                for meta in page:
                    path = meta["path"]
                    bound.take(path)
                    if path.startswith(loc.key) and not path.endswith("/"):
                        out.append(StoreObject(loc.head + path, int(meta["size"])))
            return out

        objects = self._call(url, f"listing {url}", run)
        if not objects:  # an empty listing of a missing bucket is a 404 on GCS, but say so either way
            loc = parse(url)
            client = self._client(loc)
            if self._bucket_missing(client.store, loc):
                raise self._no_bucket(loc, client.endpoint)
        return objects

    def size(self, url: str) -> int:
        import obstore

        return self._call(url, url, lambda store, loc: int(obstore.head(store, _key(loc, url))["size"]))

    def text(self, url: str, max_bytes: int) -> str:
        """An object's text (an index), at most ``max_bytes`` of it: one larger is StoreError ``too_large``."""
        import obstore

        def run(store: Any, loc: Location) -> str:
            result = obstore.get(store, _key(loc, url))
            size = int(result.meta["size"])
            if size > max_bytes:
                raise StoreError("too_large", f"{url}: {size} bytes, over {max_bytes}", retry=False)
            data = bytearray()
            for chunk in result.stream(min_chunk_size=CHUNK):
                data += chunk
                if len(data) > max_bytes:
                    raise StoreError("too_large", f"{url}: over {max_bytes} bytes", retry=False)
            return data.decode()

        return self._call(url, url, run)

    def presigned(self, url: str) -> str | None:
        """A signed URL the fetcher's HTTP transport may GET ``url``'s object at, or None: the client downloads it
        (GCS; Azure with an Entra ID token; a container that refused a signed URL)."""
        loc = parse(url)
        sign = self._client(loc).sign
        return None if sign is None else sign(_key(loc, url))

    def refused(self, url: str, status: int) -> None:
        """The store answered ``status`` to ``url``'s signed URL: after a 401 or 403 (a clock ahead of the
        store's, where an account key signs; a SAS without read permission) its container's objects come
        through the client from now on."""
        if status not in (401, 403):
            return
        loc = parse(url)
        with self._lock:  # the container's client signs no more
            client = self._clients.get(loc.ident)
            if client is None or client.sign is None:
                return
            self._clients[loc.ident] = replace(client, sign=None)
        log.warning("%s: the store refused a signed URL (HTTP %d); its objects come through the client from now on",
                    loc.head, status)

    def download(self, url: str, dest: str, progress: Callable[[int], None]) -> int:
        """Fetch an object into the new file ``dest``; ``progress(bytes)`` is called per chunk, from several
        threads, and may raise to stop. Returns the bytes written.

        No HEAD first: the first part's GET answers with the object's size (``Content-Range``), so the other
        parts start as soon as its headers arrive, up to ``threads`` of them at once (boto3 and s5cmd split an
        object the same way: across a network one stream seldom fills the link). Every later part must answer
        with the first one's ETag, so an object replaced meanwhile is fetched again, never spliced."""
        import obstore

        def run(store: Any, loc: Location) -> int:
            key = _key(loc, url)
            with create_new(dest) as f:  # never a file that was there, never through a link
                try:
                    first = obstore.get(store, key, options={"range": (0, PART)})
                except Exception as exc:
                    # an empty object (no range of it is satisfiable), or a server that ignores ranges (GCS
                    # serving a gzip-encoded object decompressed): the whole object in one plain GET
                    if _status(str(exc)) != 416 and _NOT_PARTIAL not in str(exc):
                        raise
                    return stream_into(obstore.get(store, key), f.fileno(), 0, progress)
                size = int(first.meta["size"])
                if size <= PART:
                    return stream_into(first, f.fileno(), 0, progress)
                os.ftruncate(f.fileno(), size)  # each part is written at its place
                spans = [(start, min(start + PART, size)) for start in range(0, size, PART)]

                def part(span: tuple[int, int], stop: threading.Event) -> int:
                    got = first if span[0] == 0 else obstore.get(store, key, options={"range": span})
                    if got.meta.get("e_tag") != first.meta.get("e_tag"):
                        raise StoreError("truncated", f"{url}: the object was replaced while it was fetched; it is "
                                                      f"fetched again", retry=True)
                    n = stream_into(got, f.fileno(), span[0], progress, stop)
                    if n != span[1] - span[0] and not stop.is_set():
                        raise StoreError("truncated", f"{url}: bytes {span[0]}-{span[1]} came back as {n} bytes",
                                         retry=True)
                    return n

                return in_parallel(part, spans, min(self.threads, len(spans)))

        return self._call(url, url, run)


def _key(loc: Location, url: str) -> str:
    if not loc.key or loc.key.endswith("/"):
        raise StoreError("http_status", f"{url} names no object ({loc.head}key)", retry=False)
    return loc.key


_NOT_PARTIAL = "non-partial response"  # object_store: a 200 where a range was asked for
_NO_BUCKET = re.compile(r"NoSuchBucket|ContainerNotFound|no bucket named|The specified bucket does not exist")


def _status(text: str) -> int | None:
    """The HTTP status an obstore error's text quotes (``Server returned non-2xx status code: 503``...)."""
    m = re.search(r"(?:status(?: code)?:?|returned) (\d{3})\b", text) or re.search(r"\b(4\d\d|5\d\d) [A-Z][a-z]", text)
    return int(m.group(1)) if m else None


def open_store(context: StoreContext, scheme: str | None = None) -> CloudStore:
    """The store for every gs://, gcs://, az:// and abfs:// URL of a fetcher (``stores.Stores``)."""
    return CloudStore(timeout=context.timeout, retries=context.retries, threads=context.threads,
                      max_list_bytes=context.max_list_bytes)
