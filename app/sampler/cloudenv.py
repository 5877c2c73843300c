"""Which client a ``gs://``, ``az://`` or ``abfs://`` URL gets: its bucket or container, its cloud's standard
credentials and endpoint read from the environment, and, where those credentials can sign locally, Azure's
signed (SAS) URLs.

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

An account key signs a read-only SAS URL for one blob here, with no request (``obstore.sign``); a SAS token is
the URL's query as it is. Entra ID tokens sign nothing here (a user delegation key would need a role many
identities lack): their objects come through the client.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..formats.urls import redact_text
from .stores import StoreError

GCS_SCHEMES = ("gs", "gcs")
AZURE_SCHEMES = ("az", "abfs")
GCS_VARIABLES = "GOOGLE_APPLICATION_CREDENTIALS (a service account JSON file), `gcloud auth application-default " \
                "login`, or Workload Identity on GKE; STORAGE_EMULATOR_HOST for an emulator"
AZURE_VARIABLES = "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY " \
                  "or AZURE_STORAGE_SAS_TOKEN (or AZURE_CLIENT_ID with AZURE_CLIENT_SECRET / " \
                  "AZURE_FEDERATED_TOKEN_FILE)"
DEV_ACCOUNT = "devstoreaccount1"  # Azurite's well-known account and key (UseDevelopmentStorage=true)
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CLOUD_VARIABLES = ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "AZURE_STORAGE_CONNECTION_STRING",
                   "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN")
SAS_LIFETIME = timedelta(hours=1)  # Azure checks a SAS when a request starts: a longer download is not cut


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

    @property
    def ident(self) -> tuple[str, str, str | None]:
        """What one client serves: a bucket, or a container of an account."""
        return self.cloud, self.bucket, self.account


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


def unset_empty_variables() -> None:
    """compose's ``${X:-}`` gives "": unset, not a value."""
    for name in CLOUD_VARIABLES:
        if os.environ.get(name) == "":
            del os.environ[name]


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


@dataclass(frozen=True)
class Client:
    """One bucket's or container's obstore client, the endpoint it talks to (for messages), and ``sign``: an
    object key's signed URL, where the credentials sign here (None: the client alone reads the objects)."""

    store: Any
    endpoint: str
    sign: Callable[[str], str] | None = None


def make_client(loc: Location, options: dict[str, Any], retry: dict[str, Any]) -> Client:
    """The client for ``loc``'s bucket or container, from its cloud's standard environment; StoreError naming
    the variables when there are no credentials."""
    return _gcs(loc, dict(options), retry) if loc.cloud == "gcs" else _azure(loc, dict(options), retry)


def _gcs(loc: Location, options: dict[str, Any], retry: dict[str, Any]) -> Client:
    from obstore.store import GCSStore

    emulator = _env("STORAGE_EMULATOR_HOST")
    if emulator:  # an emulator: its URL as the service's, no OAuth (what google-cloud-storage does with it)
        base = _emulator_url(emulator)
        options["allow_http"] = base.startswith("http://")
        key = json.dumps({"gcs_base_url": base, "disable_oauth": True, "client_email": "", "private_key": "",
                          "private_key_id": ""})
        return Client(GCSStore(loc.bucket, service_account_key=key, client_options=options, retry_config=retry),
                      base)
    path = _env("GOOGLE_APPLICATION_CREDENTIALS")
    if path and not os.path.isfile(path):
        raise StoreError("denied", f"{loc.head}: GOOGLE_APPLICATION_CREDENTIALS names {path}, which is no "
                                   f"readable file", retry=False)
    if not (path or _env("GOOGLE_SERVICE_ACCOUNT") or _env("GOOGLE_SERVICE_ACCOUNT_PATH")
            or _env("GOOGLE_SERVICE_ACCOUNT_KEY") or os.path.isfile(_adc_file())
            or _env("GCE_METADATA_HOST") or _resolves("metadata.google.internal")):
        raise StoreError("denied", f"{loc.head}: no GCS credentials: set {GCS_VARIABLES}", retry=False)
    return Client(GCSStore(loc.bucket, client_options=options, retry_config=retry), "https://storage.googleapis.com")


def _adc_file() -> str:
    config = _env("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    return os.path.join(config, "application_default_credentials.json")


def _azure(loc: Location, options: dict[str, Any], retry: dict[str, Any]) -> Client:
    from obstore.store import AzureStore

    cfg: dict[str, Any] = {}
    conn = connection_string(_env("AZURE_STORAGE_CONNECTION_STRING"))
    if conn.get("UseDevelopmentStorage", "").lower() == "true":
        proxy = conn.get("DevelopmentStorageProxyUri", "http://127.0.0.1")
        conn = {"AccountName": DEV_ACCOUNT, "AccountKey": DEV_KEY,
                "BlobEndpoint": f"{proxy.rstrip('/')}:10000/{DEV_ACCOUNT}"}
    account = conn.get("AccountName") or _env("AZURE_STORAGE_ACCOUNT_NAME") or _endpoint_account(conn) or None
    # a connection string's own key or SAS wins; the variables fill in what it leaves out (an emulator's
    # BlobEndpoint with the account's key in AZURE_STORAGE_ACCOUNT_KEY)
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
        cfg["sas_key"] = sas = sas.lstrip("?")
    if not endpoint and conn:
        suffix = conn.get("EndpointSuffix", "core.windows.net")
        endpoint = f"{conn.get('DefaultEndpointsProtocol', 'https')}://{account}.blob.{suffix}"
    if endpoint:
        cfg["endpoint"] = endpoint.rstrip("/")
        options["allow_http"] = endpoint.startswith("http://")
    store = AzureStore(loc.bucket, client_options=options, retry_config=retry, **cfg)
    base = cfg.get("endpoint", f"https://{account}.blob.core.windows.net")
    return Client(store, base, _key_signer(store) if key else _sas_signer(base, loc.bucket, sas) if sas else None)


def _endpoint_account(conn: dict[str, str]) -> str:
    """The account a connection string's ``BlobEndpoint`` names, for one without ``AccountName`` (the portal's SAS
    connection strings): ``https://ACCOUNT.blob.core.windows.net``, or an emulator's ``http://host:port/ACCOUNT``."""
    u = urllib.parse.urlsplit(conn.get("BlobEndpoint", ""))
    host = u.hostname or ""
    if ".blob." in host:
        return host.split(".", 1)[0]
    return u.path.strip("/").split("/", 1)[0]


def _key_signer(store: Any) -> Callable[[str], str]:
    """A blob's read-only service SAS URL, signed with the account key here (HMAC: ~5 µs, no request)."""
    import obstore

    return lambda key: obstore.sign(store, "GET", key, SAS_LIFETIME)


def _sas_signer(base: str, container: str, sas: str) -> Callable[[str], str]:
    """A blob's URL with the SAS token the user gave as its query (a container or account SAS reads it)."""
    quoted = urllib.parse.quote(container, safe="")
    return lambda key: f"{base}/{quoted}/{urllib.parse.quote(key, safe='/')}?{sas}"
