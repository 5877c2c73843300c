"""Object stores by URL scheme: what the fetcher asks of each, and which module answers for a scheme.

A store lists the objects under a prefix, tells an object's size, reads a small object (an index) whole
and downloads a shard into a new file; S3 (``s3.py``), GCS and Azure (``cloud.py``) do it through their
clients. A store whose objects are plain HTTPS files behind an API (the Hugging Face Hub, ``hub.py``)
lists them and ``resolve``s each to a URL and the credential for that URL's origin; the fetcher's HTTP
transport then downloads it, redirects and all. Each module is imported when its scheme is first used,
so a missing client library is an error naming the package, not an import failure at start-up.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# scheme -> the module whose ``open_store(context, scheme)`` makes its store
MODULES = {"s3": "s3", "gs": "cloud", "gcs": "cloud", "az": "cloud", "abfs": "cloud", "hf": "hub"}
OBJECT_SCHEMES = tuple(f"{scheme}://" for scheme in MODULES)


class StoreError(Exception):
    """A store request that failed for a reason a person can act on; ``reason`` is its fetch-error label
    (``errors.FETCH_ERRORS``), ``retry`` whether trying again soon may help."""

    def __init__(self, reason: str, message: str, retry: bool):
        super().__init__(message)
        self.reason = reason
        self.retry = retry


MAX_LIST_BYTES = 256 << 20  # a listing's default bound: http.MAX_INDEX_BYTES, the sidecar's max_index_bytes
ENTRY_COST = 256  # bytes an object of a listing counts as, beside its path: about what an S3 page spends on one


class ListingBound:
    """What a listing may still take, for stores whose clients page for themselves (GCS and Azure through
    obstore, the Hub through huggingface_hub): each object counts its path and ``ENTRY_COST`` against
    ``max_list_bytes`` (the sidecar's ``max_index_bytes``: about a million objects by default), so a prefix of
    more objects than a sidecar should hold in memory is refused, as S3's pages are (``s3.py``)."""

    def __init__(self, what: str, limit: int):
        self.what, self.limit, self.left, self.count = what, limit, limit, 0

    def take(self, path: str) -> None:
        self.left -= len(path) + ENTRY_COST
        self.count += 1
        if self.left < 0:
            raise StoreError("too_large", f"{self.what}: past max_index_bytes={self.limit} bytes after {self.count} "
                                          f"objects (each counted as its path and {ENTRY_COST} bytes): list a narrower "
                                          f"prefix, give an index file, or raise max_index_bytes (--max-index-bytes / "
                                          f"FEEDLINE_MAX_INDEX_BYTES) if the store really holds that many shards",
                             retry=False)


@dataclass(frozen=True)
class StoreObject:
    """An object a listing found: its URL in the store's scheme and its size where the listing told it."""

    url: str
    size: int | None = None


@dataclass(frozen=True)
class StoreContext:
    """What every store is made with: the fetcher's timeout, retries and threads, and its HTTP transport
    (for stores that are HTTPS underneath)."""

    timeout: float
    retries: int
    threads: int
    http: Any  # http.HttpTransport (not imported: http.py imports the sources, which list through the stores)
    max_list_bytes: int = MAX_LIST_BYTES  # what a listing's pages may take in all (the sidecar's max_index_bytes)


class Store(Protocol):
    """What the fetcher asks of an object store's client (``s3.S3Client``, ``cloud.py``'s): a store of this shape
    is fetched through its own client; a ``ResolvingStore`` instead (``hub.HubStore``) through HTTP."""

    def list(self, url: str) -> list[StoreObject]:
        """Every object under a prefix (``scheme://bucket/prefix/``), recursively."""

    def size(self, url: str) -> int | None:
        """One object's size; StoreError when it is missing or the store refuses."""

    def text(self, url: str, max_bytes: int) -> str:
        """A small object (an index) whole; StoreError ``too_large`` past ``max_bytes``."""

    def download(self, url: str, dest: str, progress: Callable[[int], None]) -> int:
        """The object into a new file ``dest`` (``formats.files.create_new``); ``progress(bytes)`` may raise to
        stop. Returns the bytes written."""

    # optional (``cloud.CloudStore`` has them): a URL the fetcher's HTTP transport downloads instead of the client

    def presigned(self, url: str) -> str | None:
        """A signed URL of the object, or None: ``download`` fetches it."""

    def refused(self, url: str, status: int) -> None:
        """The store answered HTTP ``status`` to the signed URL (the object then comes through ``download``)."""


class ResolvingStore(Protocol):
    """A store read over HTTP (``hub.HubStore``): each object URL resolves to an HTTP URL and the credential to
    send there; a refusal there is explained in the store's own terms."""

    def list(self, url: str) -> list[StoreObject]:
        """Every object under a prefix."""

    def resolve(self, url: str) -> tuple[str, dict[str, str]]:
        """The HTTP URL of ``url`` and the headers to send to it; StoreError when it cannot be."""

    def status_error(self, url: str, status: int, reason: str = "") -> StoreError:
        """A refusal (HTTP ``status``) of ``url``'s resolved URL, with the store's fix (the Hub's: HF_TOKEN)."""


def resolves(store: Any) -> bool:
    """Whether ``store`` is a ``ResolvingStore`` (read over HTTP) rather than a ``Store`` (its own client)."""
    return callable(getattr(store, "resolve", None))


def scheme_of(url: str) -> str | None:
    """``s3``, ``gs``, ``az``, ``hf``... for an object-store URL, else None."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep and head.lower() in MODULES else None


class Stores:
    """One store per scheme for a fetcher, made when first asked for (thread-safe)."""

    def __init__(self, context: StoreContext):
        self.context = context
        self._made: dict[str, Any] = {}
        self._lock = threading.Lock()

    def for_url(self, url: str) -> Any:
        scheme = scheme_of(url)
        if scheme is None:
            raise StoreError("denied", f"{url.partition('://')[0]}:// is not an object store feedline reads", False)
        module = MODULES[scheme]
        with self._lock:
            store = self._made.get(module)
            if store is None:
                opener = importlib.import_module(f"{__package__}.{module}").open_store
                store = self._made[module] = opener(self.context)
            return store
