"""Hugging Face Hub datasets: ``hf://datasets/<org>/<name>[@<revision>]/<path or glob>``.

A dataset repository's files are plain HTTPS files behind the Hub's API, so this store does not download: it
lists (``list``), tells a size (``size``), reads an index (``text``) and ``resolve``s a file to its HTTPS URL and
the credential for the Hub's origin; the fetcher's HTTP transport downloads it, through the Hub's redirect to its
CDN (where the credential is dropped: the CDN URL is presigned and refuses a second one). It has no ``download``.

- The revision (a branch, a tag, a commit, ``refs/convert/parquet``, ``refs/pr/N``; ``main`` by default) of a
  listing is resolved once to its commit, and every URL the listing returns is pinned to it
  (``hf://datasets/org/name@<sha>/path``): all shards of a run come from one commit, even while the branch moves.
  ``pin(url)`` does the same for a URL not listed. A revision with a ``/`` other than those refs is written
  percent-encoded after the ``@`` (``@my%2Fbranch``), as huggingface_hub's own ``hf://`` URLs are.
- The token: ``HF_TOKEN``, else the login huggingface_hub saved (``huggingface-cli login``); sent as a bearer
  token to the endpoint only. ``HF_ENDPOINT`` names a mirror or a self-hosted Hub.
- huggingface_hub lists (its client: retries on 429 and 5xx with backoff, the Link header's pages); its requests
  that take no timeout of their own get the fetcher's (``fetch_timeout``) as long as nobody installed another
  client factory. It never downloads here: nothing is written to its cache, and no progress bar is drawn.
- Every error names the dataset and the fix: a private or gated dataset without a token (set ``HF_TOKEN``, accept
  its terms on its page), no such dataset, revision or file, throttling (tried again later), the endpoint
  unreachable (``HF_ENDPOINT``).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ..formats.urls import redact, redact_text
from .errors import FetchError
from .stores import ListingBound, StoreContext, StoreError, StoreObject

log = logging.getLogger("feedline.sampler")

SCHEME = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
URL_FORM = "hf://datasets/<org>/<name>[@<revision>]/<path>"
TOKEN_FIX = "set HF_TOKEN (or run `huggingface-cli login`) and accept its terms on its Hub page"
COMMIT = re.compile(r"[0-9a-f]{40}")
# refs whose name holds a '/', written as they are after the '@' (huggingface_hub's SPECIAL_REFS_REVISION_REGEX)
SPECIAL_REF = re.compile(r"(refs/convert/\w+|refs/pr/\d+)(?=/|$)")
NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")  # an org or a repository name
OTHER_TYPES = {"models": "a model", "spaces": "a Space", "buckets": "a bucket", "kernels": "a kernel"}
SINGULAR = {"dataset": "datasets", "model": "models", "space": "spaces", "bucket": "buckets"}


@dataclass(frozen=True)
class HubPath:
    """A file (or a prefix) of a dataset repository at a revision (None: the default, ``main``)."""

    repo_id: str
    revision: str | None
    path: str

    def url(self, revision: str | None = None) -> str:
        """As an ``hf://`` URL, at ``revision`` if given (a commit), else at its own."""
        rev = revision or self.revision
        at = "" if rev is None else "@" + (rev if SPECIAL_REF.fullmatch(rev) else urllib.parse.quote(rev, safe=""))
        return f"{SCHEME}datasets/{self.repo_id}{at}/{self.path}"


def parse_hf_url(url: str) -> tuple[str, str | None, str]:
    """``hf://datasets/org/name[@revision]/path`` -> (``org/name``, the revision or None, ``path``); a ValueError
    that says what is wrong and the form to write. The path may be empty (the whole repository) and may end
    mid-name (a prefix); it is kept as written (a trailing ``/`` too)."""
    p = _parse(url)
    return p.repo_id, p.revision, p.path


def _parse(url: str) -> HubPath:
    shown = redact(url)
    if not url.startswith(SCHEME):
        raise ValueError(f"{shown!r} is not an hf:// URL: write {URL_FORM}")
    body = url[len(SCHEME):]
    kind, _, rest = body.partition("/")
    if kind in OTHER_TYPES:
        raise ValueError(f"{shown!r} names {OTHER_TYPES[kind]}: feedline reads dataset repositories only "
                         f"({URL_FORM})")
    if kind in SINGULAR:
        raise ValueError(f"{shown!r}: the type is plural: write hf://{SINGULAR[kind]}/... ({URL_FORM})")
    if kind != "datasets":
        raise ValueError(f"{shown!r}: write hf://datasets/ before the dataset's <org>/<name> (feedline reads dataset "
                         f"repositories only: {URL_FORM})")
    org, _, rest = rest.partition("/")
    name_rev, slash, path = rest.partition("/")
    name, at, raw_rev = name_rev.partition("@")
    if "@" in org:
        raise ValueError(f"{shown!r} names no dataset: the repository is <org>/<name>, then @<revision> ({URL_FORM})")
    if not org or not name:
        raise ValueError(f"{shown!r} names no dataset: give both its org and its name ({URL_FORM})")
    for part in (org, name):
        if not NAME.fullmatch(part) or ".." in part or "--" in part:
            raise ValueError(f"{shown!r}: {part!r} is not a Hub name (letters, digits, '-', '_', '.')")
    revision: str | None = None
    if at:
        special = SPECIAL_REF.match(raw_rev + slash + path)
        if special:
            revision = special.group(1)
            path = (raw_rev + slash + path)[len(revision):].removeprefix("/")
        else:
            revision = urllib.parse.unquote(raw_rev)
        if not revision:
            raise ValueError(f"{shown!r}: nothing after the '@': name a branch, a tag or a commit ({URL_FORM})")
    if path.startswith("/") or any(part in (".", "..") for part in path.split("/")):
        raise ValueError(f"{shown!r}: the path in the repository has an empty, '.' or '..' part")
    return HubPath(f"{org}/{name}", revision, path)


def unpinned(url: str) -> str:
    """``url`` without its revision (``hf://datasets/org/name/path``): what a glob of the source is matched
    against, as a listing's URLs are pinned to a commit the source did not name."""
    p = _parse(url)
    return f"{SCHEME}datasets/{p.repo_id}/{p.path}"


def _token() -> str | None:
    """``HF_TOKEN``, else huggingface_hub's saved login; None when there is neither."""
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        return token
    from huggingface_hub import get_token

    return (get_token() or "").strip() or None


def _bound_client(timeout: float) -> None:
    """huggingface_hub's shared HTTP client with ``timeout`` on the requests that take none of their own (the tree
    listing's pages, paths-info), so a stalled Hub cannot hang the start-up; left alone when someone installed a
    factory of their own (or this huggingface_hub keeps it elsewhere)."""
    try:
        import httpx2
        from huggingface_hub.utils import _http
    except ImportError:
        return
    default = getattr(_http, "default_client_factory", None)
    current = getattr(_http, "_GLOBAL_CLIENT_FACTORY", None)
    if default is None or (current is not default and not getattr(current, "feedline_timeout", None)):
        return
    if getattr(current, "feedline_timeout", None) == timeout:
        return

    def factory() -> Any:
        client = default()
        client.timeout = httpx2.Timeout(timeout)
        return client

    factory.feedline_timeout = timeout  # type: ignore[attr-defined]  # ours: a later store may set its own
    _http.set_client_factory(factory)


class HubStore:
    """Dataset repositories of one Hub endpoint, read with one token, for every fetch thread of a sidecar."""

    def __init__(self, context: StoreContext, endpoint: str | None = None, token: str | None = None):
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is first imported
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise StoreError("denied", "hf:// sources need huggingface_hub (pip install huggingface_hub)",
                             retry=False) from None
        try:
            version = importlib.metadata.version("feedline")
        except importlib.metadata.PackageNotFoundError:
            version = "0+unknown"

        self.context = context
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT", "").strip() or DEFAULT_ENDPOINT).rstrip("/")
        self.token = token if token is not None else _token()
        self.credential = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        _bound_client(context.timeout)
        quiet = logging.getLogger("httpx2")  # a line per API request at INFO: the sidecar's log is not for that
        if quiet.level == logging.NOTSET:
            quiet.setLevel(logging.WARNING)
        self.api = HfApi(endpoint=self.endpoint, token=self.token or False, library_name="feedline",
                         library_version=version)
        self._commits: dict[tuple[str, str], str] = {}  # (repo, revision) -> its commit, resolved once
        self._sizes: dict[str, int] = {}  # sizes of the files listings found, by pinned URL
        self._lock = threading.Lock()

    # -- URLs -----------------------------------------------------------------------------------------

    def resolve(self, url: str) -> tuple[str, dict[str, str]]:
        """(the file's HTTPS URL on the endpoint, the headers for that origin only): ``{endpoint}/datasets/{org}/
        {name}/resolve/{revision}/{path}``, the revision and path quoted as huggingface_hub quotes them."""
        p = self._path(url)
        if not p.path or p.path.endswith("/"):
            raise StoreError("http_status", f"{redact(url)} names a folder, not a file", retry=False)
        return self._resolve_url(p), dict(self.credential)

    def _resolve_url(self, p: HubPath) -> str:
        rev = urllib.parse.quote(p.revision or DEFAULT_REVISION, safe="")
        return f"{self.endpoint}/datasets/{p.repo_id}/resolve/{rev}/{urllib.parse.quote(p.path)}"

    def page(self, repo_id: str) -> str:
        """The dataset's page on the Hub, where its terms are accepted."""
        return f"{redact(self.endpoint)}/datasets/{repo_id}"

    def commit(self, repo_id: str, revision: str | None) -> str:
        """The commit ``revision`` (None: ``main``) of the dataset points at, asked once per store."""
        rev = revision or DEFAULT_REVISION
        with self._lock:
            known = self._commits.get((repo_id, rev))
        if known:
            return known
        what = f"hf://datasets/{repo_id}@{rev}"
        try:
            info = self.api.dataset_info(repo_id, revision=rev, timeout=self.context.timeout)
        except Exception as exc:
            raise self._explain(exc, what, repo_id, rev) from None
        sha = str(info.sha or "")
        if not COMMIT.fullmatch(sha):
            raise StoreError("http_status", f"{what}: the Hub at {redact(self.endpoint)} named no commit for it "
                                            f"({sha!r})", retry=True)
        with self._lock:
            return self._commits.setdefault((repo_id, rev), sha)

    def pin(self, url: str) -> str:
        """``url`` at the commit its revision points at now (``hf://datasets/org/name@<sha>/path``)."""
        p = self._path(url)
        return p.url(self.commit(p.repo_id, p.revision))

    # -- the store ------------------------------------------------------------------------------------

    def list(self, url: str) -> list[StoreObject]:
        """Every file of the dataset whose path starts with the URL's path (a folder ``data/`` or a prefix that
        ends mid-name, ``data/train-``), recursively, with its size (an LFS file's own), each URL pinned to the
        commit the revision points at now. A prefix no file starts with lists nothing."""
        p = self._path(url)
        sha = self.commit(p.repo_id, p.revision)
        folder = p.path.rpartition("/")[0]  # the deepest folder that holds every match
        from huggingface_hub.hf_api import RepoFile

        what = redact(url)
        found = []
        bound = ListingBound(f"listing {what}", self.context.max_list_bytes)  # the Link header's pages, bounded
        try:
            for entry in self.api.list_repo_tree(p.repo_id, folder or None, recursive=True, revision=sha,
                                                 repo_type="dataset"):
                bound.take(entry.path)
                if not isinstance(entry, RepoFile) or not entry.path.startswith(p.path):
                    continue
                if entry.path.startswith("/") or any(part in ("", ".", "..") for part in entry.path.split("/")):
                    log.warning("%s: skipping %r of the Hub's listing: not a plain path", what, entry.path)
                    continue
                size = entry.lfs.size if entry.lfs is not None else entry.size
                found.append(StoreObject(HubPath(p.repo_id, sha, entry.path).url(), int(size)))
        except StoreError:
            raise
        except Exception as exc:
            response = getattr(exc, "response", None)
            if response is not None and response.status_code == 404 and \
                    response.headers.get("X-Error-Code") == "EntryNotFound":
                return []  # no such folder: nothing under the prefix, as an S3 prefix with no key
            raise self._explain(exc, f"listing {what}", p.repo_id, sha, folder) from None
        with self._lock:
            self._sizes.update((o.url, o.size) for o in found if o.size is not None)
        return found

    def size(self, url: str) -> int | None:
        """A file's size: from the listing that found it, else from the Hub's paths-info; StoreError when the
        dataset, the revision or the file is not there, or the Hub refuses."""
        p = self._path(url)
        with self._lock:
            known = self._sizes.get(p.url())
        if known is not None:
            return known
        from huggingface_hub.hf_api import RepoFile

        rev = p.revision or DEFAULT_REVISION
        try:
            infos = self.api.get_paths_info(p.repo_id, [p.path], revision=rev, repo_type="dataset")
        except Exception as exc:
            raise self._explain(exc, redact(url), p.repo_id, rev, p.path) from None
        for info in infos:
            if info.path == p.path:
                if not isinstance(info, RepoFile):
                    raise StoreError("http_status", f"{redact(url)} is a folder, not a file", retry=False)
                return int(info.lfs.size if info.lfs is not None else info.size)
        raise StoreError("http_status", f"{redact(url)}: no file {p.path} in dataset {p.repo_id} at {rev}",
                         retry=False)

    def text(self, url: str, max_bytes: int) -> str:
        """A small file (an index) whole, through the Hub's redirect; StoreError ``too_large`` past ``max_bytes``."""
        https_url, credential = self.resolve(url)
        try:
            status, reason, _, body = self.context.http.request("GET", https_url, max_body=max_bytes,
                                                                credential=credential)
        except FetchError as exc:
            raise StoreError(exc.reason, f"{redact(url)}: {exc}", exc.retry) from None
        except TimeoutError:
            raise StoreError("timeout", f"{redact(url)}: no answer within {self.context.timeout:.0f} s",
                             retry=True) from None
        except OSError as exc:
            raise self._unreachable(redact(url), exc) from None
        if status != 200:
            raise self.status_error(url, status, reason)
        try:
            return body.decode()
        except UnicodeDecodeError:
            raise StoreError("http_status", f"{redact(url)} is not UTF-8 text", retry=False) from None

    # -- errors -----------------------------------------------------------------------------------------

    def status_error(self, url: str, status: int, reason: str = "") -> StoreError:
        """What an HTTP ``status`` the Hub answered for ``url`` (a file) means, and its fix."""
        p = self._path(url)
        return self._by_status(redact(url), status, reason, p.repo_id, p.revision or DEFAULT_REVISION, p.path)

    def _by_status(self, what: str, status: int, reason: str, repo_id: str, rev: str, path: str = "",
                   code: str = "") -> StoreError:
        said = f"HTTP {status}" + (f" {reason}" if reason else "")
        if status == 401:
            if self.token:
                return StoreError("denied", f"{what}: {said}: the Hub refuses the token (HF_TOKEN or the saved login) "
                                            f"for dataset {repo_id}: it is invalid, expired or has no access to it; "
                                            f"a gated dataset: accept its terms on {self.page(repo_id)}", retry=False)
            return StoreError("denied", f"{what}: {said}: dataset {repo_id} is gated or private (or does not "
                                        f"exist), and no token is given: {TOKEN_FIX} ({self.page(repo_id)})",
                              retry=False)
        if status == 403:
            return StoreError("denied", f"{what}: {said}: access to dataset {repo_id} is refused: it is gated or "
                                        f"private: {TOKEN_FIX} ({self.page(repo_id)}), with a token that may read it",
                              retry=False)
        if status in (404, 410):
            if code == "RevisionNotFound":
                return StoreError("http_status", f"{what}: dataset {repo_id} has no revision {rev!r} (a branch, a "
                                                 f"tag or a commit)", retry=False)
            if code == "EntryNotFound" or (path and code != "RepoNotFound"):
                return StoreError("http_status", f"{what}: no file or folder {path or '/'} in dataset {repo_id} at "
                                                 f"{rev}", retry=False)
            hint = "" if self.token else f"; if it is private or gated, {TOKEN_FIX}"
            return StoreError("http_status", f"{what}: no dataset {repo_id} at {redact(self.endpoint)}{hint}",
                              retry=False)
        if status == 429:
            return StoreError("http_status", f"{what}: {said}: the Hub throttles us; it is tried again later"
                              + ("" if self.token else " (a token, HF_TOKEN, raises the limit)"), retry=True)
        return StoreError("http_status", f"{what}: {said}", retry=status >= 500 or status == 408)

    def _unreachable(self, what: str, exc: BaseException) -> StoreError:
        return StoreError("connection", f"{what}: the Hub endpoint {redact(self.endpoint)} is unreachable "
                                        f"({redact_text(str(exc)) or type(exc).__name__}); set HF_ENDPOINT for a "
                                        f"mirror or a self-hosted Hub", retry=True)

    def _explain(self, exc: BaseException, what: str, repo_id: str, rev: str, path: str = "") -> StoreError:
        """A huggingface_hub (or httpx2) exception as a person can act on it."""
        from huggingface_hub.errors import HfHubHTTPError

        try:
            import httpx2
            timeouts: tuple[type[BaseException], ...] = (httpx2.TimeoutException, TimeoutError)
            network: tuple[type[BaseException], ...] = (httpx2.TransportError, OSError)
        except ImportError:
            timeouts, network = (TimeoutError,), (OSError,)
        if isinstance(exc, StoreError):
            return exc
        if type(exc).__name__ == "OfflineModeIsEnabled":
            return StoreError("connection", f"{what}: HF_HUB_OFFLINE is set: unset it to read hf:// sources",
                              retry=False)
        if isinstance(exc, HfHubHTTPError) and getattr(exc, "response", None) is not None:
            response = exc.response
            return self._by_status(what, response.status_code, response.reason_phrase or "", repo_id, rev, path,
                                   response.headers.get("X-Error-Code", ""))
        if isinstance(exc, timeouts):
            return StoreError("timeout", f"{what}: the Hub at {redact(self.endpoint)} did not answer within "
                                         f"{self.context.timeout:.0f} s", retry=True)
        if isinstance(exc, network):
            return self._unreachable(what, exc)
        return StoreError("connection", f"{what}: {type(exc).__name__}: {redact_text(str(exc))}", retry=True)

    def _path(self, url: str) -> HubPath:
        try:
            return _parse(url)
        except ValueError as exc:
            raise StoreError("http_status", str(exc), retry=False) from None


def open_store(context: StoreContext, scheme: str | None = None) -> HubStore:
    """The store of ``hf://`` URLs (``stores.Stores`` calls it when the scheme is first used)."""
    return HubStore(context)
