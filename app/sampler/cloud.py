"""Google Cloud Storage (``gs://``) and Azure Blob Storage (``az://``, ``abfs://``) through obstore.

obstore is the Python face of the Rust ``object_store`` crate (Apache Arrow's): one client for both clouds,
with its own retries (backoff on 429, 5xx and dropped connections) and connection pool, and every request
made without the GIL, so ranged GETs run in parallel in plain threads. One ``CloudStore`` answers for every
cloud scheme and keeps one obstore client per bucket or container.

Everything is each cloud's standard configuration, read from the environment:

GCS (``gs://bucket/key``, also ``gcs://``)
    ``GOOGLE_APPLICATION_CREDENTIALS`` (a service account JSON file, or an ``authorized_user`` file),
    ``gcloud auth application-default login``'s file, or the metadata server (GCE, GKE Workload Identity);
    ``STORAGE_EMULATOR_HOST`` (``host:port`` or a URL) sends every request to an emulator, unsigned.
Azure (``az://container/key``; ``abfs://container@account.dfs.core.windows.net/key``)
    ``AZURE_STORAGE_CONNECTION_STRING``, or ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY``
    or ``AZURE_STORAGE_SAS_TOKEN``, or Microsoft Entra ID (``AZURE_CLIENT_ID`` with ``AZURE_CLIENT_SECRET`` or
    ``AZURE_FEDERATED_TOKEN_FILE``: AKS workload identity; a managed identity). ``az://`` names the container
    only: the account comes from the environment (``az://account/container/...`` would read the same as a
    container with a folder, so it is not a form). ``abfs://`` names the account in the URL, fsspec's form.
    ``UseDevelopmentStorage=true`` or a connection string's ``BlobEndpoint`` reaches Azurite.

A large object is fetched with ranged GETs of ``PART`` bytes in parallel (``ranged.py``), each streamed into
its place in the new file in chunks of ``CHUNK``: no more than a chunk per part is ever held in memory. Every
error is a
``StoreError`` naming the object and what to do: no credentials (and which variables), access denied, no
such bucket / container / object, the endpoint unreachable, throttled.

Why this file is long: two clouds' configurations (credentials, endpoints, the account of an Azure URL) and
one error vocabulary for both share one client, one URL parser and one ranged download; split by cloud, the
download and the error mapping would be written twice.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..formats.files import create_new
from ..formats.urls import redact_text
from .ranged import CHUNK, in_parallel, stream_into
from .stores import StoreContext, StoreError, StoreObject

PART = 16 << 20  # ranged GETs of this size, in parallel, for objects larger than it (as s3.py)
_OURS = __name__.split(".")[0] + "."  # exceptions raised by feedline itself (a stop, a budget) pass through

GCS_SCHEMES = ("gs", "gcs")
AZURE_SCHEMES = ("az", "abfs")
GCS_VARIABLES = "GOOGLE_APPLICATION_CREDENTIALS (a service account JSON file), `gcloud auth application-default " \
                "login`, or Workload Identity on GKE; STORAGE_EMULATOR_HOST for an emulator"
AZURE_VARIABLES = "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY " \
                  "or AZURE_STORAGE_SAS_TOKEN (or AZURE_CLIENT_ID with AZURE_CLIENT_SECRET / " \
                  "AZURE_FEDERATED_TOKEN_FILE)"
DEV_ACCOUNT = "devstoreaccount1"  # Azurite's well-known account and key (UseDevelopmentStorage=true)
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_CLOUD_VARIABLES = ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "AZURE_STORAGE_CONNECTION_STRING",
                    "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN")


@dataclass(frozen=True)
class Location:
    """Where a URL points: the cloud, the bucket or container (and the Azure account it names, if any), the
    key or prefix, and how the URL spelled its scheme and bucket (listings answer in the same form)."""

    cloud: str  # "gcs" or "azure"
    bucket: str  # GCS bucket or Azure container
    key: str
    head: str  # "gs://bucket/" as the user wrote it: a listing's URLs are head + key
    account: str | None = None  # abfs:// names it; az:// takes it from the environment

    @property
    def what(self) -> str:
        return f"{'bucket' if self.cloud == 'gcs' else 'container'} {self.bucket!r}" + (
            f" of account {self.account!r}" if self.account else "")


def parse(url: str) -> Location:
    """``gs://bucket/key``, ``az://container/key`` or ``abfs://container@account.dfs.core.windows.net/key``."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in GCS_SCHEMES + AZURE_SCHEMES:
        raise StoreError("denied", f"{redact_text(url)} is not a gs://, az:// or abfs:// URL", retry=False)
    netloc, _, key = rest.partition("/")
    head = f"{url[:len(scheme) + 3]}{netloc}/"
    if scheme in GCS_SCHEMES:
        if not netloc:
            raise StoreError("denied", f"{url} names no bucket (gs://bucket/key)", retry=False)
        return Location("gcs", netloc, key, head)
    container, at, host = netloc.partition("@")
    account = None
    if at:  # abfs://container@account.dfs.core.windows.net/path (fsspec / Hadoop's form)
        account = host.split(".", 1)[0]
        if not account:
            raise StoreError("denied", f"{url} names no account (abfs://container@account.dfs.core.windows.net/key)",
                             retry=False)
    if not container:
        raise StoreError("denied", f"{url} names no container (az://container/key, "
                                   f"abfs://container@account.dfs.core.windows.net/key)", retry=False)
    return Location("azure", container, key, head, account)


def connection_string(text: str) -> dict[str, str]:
    """An Azure storage connection string's ``Key=Value;`` pairs (keys as Azure spells them)."""
    out = {}
    for part in text.split(";"):
        name, eq, value = part.strip().partition("=")
        if eq and name:
            out[name.strip()] = value.strip()
    return out


def _env(name: str) -> str:
    """A variable's value; compose's ``${X:-}`` gives "", which means unset."""
    return os.environ.get(name, "").strip()


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 80)
        return True
    except OSError:
        return False


def _emulator_url(host: str) -> str:
    """``STORAGE_EMULATOR_HOST`` as a base URL: the Go and Java clients take ``host:port``, Python's a URL."""
    return (host if "://" in host else f"http://{host}").rstrip("/")


class CloudStore:
    """GCS and Azure Blob Storage for a fetcher: list, size, text and download (``stores.Store``)."""

    def __init__(self, timeout: float = 30.0, retries: int = 3, threads: int = 4):
        try:
            import obstore  # noqa: F401
        except ImportError:
            raise StoreError("denied", "gs:// and az:// sources need obstore (pip install obstore; the image has "
                                       "it)", retry=False) from None
        self.threads = max(1, threads)
        # object_store's timeout bounds a whole request; a request moves at most PART bytes (a part, or an object
        # no larger), so this is a floor of PART / (4 x timeout) bytes/s, 0.14 MB/s at 30 s.
        self._client_options = {"connect_timeout": timedelta(seconds=min(timeout, 10.0)),
                                "timeout": timedelta(seconds=4 * max(timeout, 30.0)),
                                "pool_max_idle_per_host": str(threads * (threads + 1))}
        self._retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=max(60.0, 4 * timeout)),
                       "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15),
                                   "base": 2}}
        self._stores: dict[tuple[str, str, str | None], tuple[Any, str]] = {}
        self._lock = threading.Lock()
        for name in _CLOUD_VARIABLES:  # compose's ${X:-} gives "": unset, not a value
            if os.environ.get(name) == "":
                del os.environ[name]

    # -- clients ---------------------------------------------------------------------------------------

    def _client(self, loc: Location) -> tuple[Any, str]:
        """The obstore client for ``loc``'s bucket or container, and the endpoint it talks to (for messages)."""
        ident = (loc.cloud, loc.bucket, loc.account)
        with self._lock:
            made = self._stores.get(ident)
            if made is None:
                made = self._stores[ident] = self._gcs(loc) if loc.cloud == "gcs" else self._azure(loc)
            return made

    def _gcs(self, loc: Location) -> tuple[Any, str]:
        from obstore.store import GCSStore

        options = dict(self._client_options)
        emulator = _env("STORAGE_EMULATOR_HOST")
        if emulator:  # an emulator: its URL as the service's, no OAuth (what google-cloud-storage does with it)
            base = _emulator_url(emulator)
            options["allow_http"] = base.startswith("http://")
            key = json.dumps({"gcs_base_url": base, "disable_oauth": True, "client_email": "", "private_key": "",
                              "private_key_id": ""})
            store = GCSStore(loc.bucket, service_account_key=key, client_options=options,
                             retry_config=self._retry)
            return store, base
        path = _env("GOOGLE_APPLICATION_CREDENTIALS")
        if path and not os.path.isfile(path):
            raise StoreError("denied", f"{loc.head}: GOOGLE_APPLICATION_CREDENTIALS names {path}, which is no "
                                       f"readable file", retry=False)
        if not (path or _env("GOOGLE_SERVICE_ACCOUNT") or _env("GOOGLE_SERVICE_ACCOUNT_PATH")
                or _env("GOOGLE_SERVICE_ACCOUNT_KEY") or os.path.isfile(self._adc_file())
                or _env("GCE_METADATA_HOST") or _resolves("metadata.google.internal")):
            raise StoreError("denied", f"{loc.head}: no GCS credentials: set {GCS_VARIABLES}", retry=False)
        store = GCSStore(loc.bucket, client_options=options, retry_config=self._retry)
        return store, "https://storage.googleapis.com"

    @staticmethod
    def _adc_file() -> str:
        config = _env("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
        return os.path.join(config, "application_default_credentials.json")

    def _azure(self, loc: Location) -> tuple[Any, str]:
        from obstore.store import AzureStore

        options = dict(self._client_options)
        cfg: dict[str, Any] = {}
        conn = connection_string(_env("AZURE_STORAGE_CONNECTION_STRING"))
        if conn.get("UseDevelopmentStorage", "").lower() == "true":
            proxy = conn.get("DevelopmentStorageProxyUri", "http://127.0.0.1")
            conn = {"AccountName": DEV_ACCOUNT, "AccountKey": DEV_KEY,
                    "BlobEndpoint": f"{proxy.rstrip('/')}:10000/{DEV_ACCOUNT}"}
        account = conn.get("AccountName") or _env("AZURE_STORAGE_ACCOUNT_NAME") or None
        # a connection string's own key or SAS wins; the variables fill in what it leaves out (an emulator's
        # BlobEndpoint with the account's key in AZURE_STORAGE_ACCOUNT_KEY)
        key = sas = None
        if conn.get("AccountKey") or conn.get("SharedAccessSignature"):
            key, sas = conn.get("AccountKey") or None, conn.get("SharedAccessSignature") or None
        else:
            key, sas = _env("AZURE_STORAGE_ACCOUNT_KEY") or None, _env("AZURE_STORAGE_SAS_TOKEN") or None
        endpoint = conn.get("BlobEndpoint")
        if loc.account and account and loc.account != account and (key or sas):
            # a key or SAS signs for one account: never send its requests to another the URL names
            raise StoreError("denied", f"{loc.head}: the URL names account {loc.account!r}, but the credentials "
                                       f"set are for account {account!r}; use an az://container/... URL or set "
                                       f"the credentials of {loc.account!r}", retry=False)
        account = loc.account or account
        if not account:
            raise StoreError("denied", f"{loc.head}: no Azure storage account: az:// URLs take it from "
                                       f"AZURE_STORAGE_ACCOUNT_NAME or AZURE_STORAGE_CONNECTION_STRING (or name it: "
                                       f"abfs://{loc.bucket}@ACCOUNT.dfs.core.windows.net/...); credentials: "
                                       f"{AZURE_VARIABLES}", retry=False)
        token = (_env("AZURE_CLIENT_ID") or _env("AZURE_FEDERATED_TOKEN_FILE") or _env("IDENTITY_ENDPOINT")
                 or _env("MSI_ENDPOINT") or _env("AZURE_MSI_ENDPOINT"))
        if not (key or sas or token):
            raise StoreError("denied", f"{loc.head}: no Azure credentials for account {account!r}: set "
                                       f"{AZURE_VARIABLES}", retry=False)
        cfg["account_name"] = account
        if key:
            cfg["account_key"] = key
        elif sas:
            cfg["sas_key"] = sas.lstrip("?")
        if not endpoint and conn:
            suffix = conn.get("EndpointSuffix", "core.windows.net")
            endpoint = f"{conn.get('DefaultEndpointsProtocol', 'https')}://{account}.blob.{suffix}"
        if endpoint:
            cfg["endpoint"] = endpoint.rstrip("/")
            options["allow_http"] = endpoint.startswith("http://")
        store = AzureStore(loc.bucket, client_options=options, retry_config=self._retry, **cfg)
        return store, cfg.get("endpoint", f"https://{account}.blob.core.windows.net")

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
        store, endpoint = self._client(loc)
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
            for page in obstore.list(store, prefix=folder or None, chunk_size=1000):
                for meta in page:
                    path = meta["path"]
                    if path.startswith(loc.key) and not path.endswith("/"):
                        out.append(StoreObject(loc.head + path, int(meta["size"])))
            return out

        objects = self._call(url, f"listing {url}", run)
        if not objects:  # an empty listing of a missing bucket is a 404 on GCS, but say so either way
            loc = parse(url)
            store, endpoint = self._client(loc)
            if self._bucket_missing(store, loc):
                raise self._no_bucket(loc, endpoint)
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
    return CloudStore(timeout=context.timeout, retries=context.retries, threads=context.threads)
