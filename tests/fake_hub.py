"""A stand-in for the Hugging Face Hub on 127.0.0.1 and its CDN on 127.0.0.2 (another host), real sockets both.

The Hub serves what huggingface_hub 2.4 asks for and what a download follows:

- ``GET /api/datasets/{org}/{name}`` and ``GET /api/datasets/{org}/{name}/revision/{rev}`` (the revision
  percent-encoded whole: ``refs%2Fconvert%2Fparquet``): the dataset's info, its ``sha`` the revision's commit;
- ``GET /api/datasets/{org}/{name}/tree/{rev}[/{path}]?recursive=...&expand=...[&cursor=N]``: a page of at most
  ``page_size`` entries, the next page named by a ``Link: <...>; rel="next"`` header, as the Hub paginates;
- ``POST /api/datasets/{org}/{name}/paths-info/{rev}`` (a form of ``paths``): those paths' entries;
- ``GET|HEAD /datasets/{org}/{name}/resolve/{rev}/{path}``: a small file's bytes (200), an LFS file's a 302 to
  the CDN with a presigned-looking query (``X-Amz-Signature``), ``X-Repo-Commit`` and ``X-Linked-Size``.

Errors as the Hub answers them (``X-Error-Code``): a private dataset without the token, or a wrong token, 401
``RepoNotFound``; a gated one whose terms the token's user did not accept, 403 ``GatedRepo``; 404
``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``. The CDN answers 400 to a request that carries an
``Authorization`` header (S3 refuses a second credential beside a presigned query) and 403 to a wrong signature.
``fail(where, status, times)`` makes the next requests to ``api``, ``resolve`` or ``cdn`` answer ``status``;
``stall_api`` holds API answers back. Every request is logged (``requests``): host, method, raw path, its auth.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "hf_feedline_test_token"
OTHER_TOKEN = "hf_someone_else"  # a valid token whose user has not accepted a gated dataset's terms
LFS_FROM = 1024  # files this large or larger are LFS files, fetched through the CDN
SECRET = b"cdn-signing-key"


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """A dataset repository: commits (sha -> files) and refs (branch or tag -> sha)."""

    private: bool = False
    gated: bool = False
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)

    def commit(self, files: dict[str, bytes], ref: str = "main", keep: bool = True) -> str:
        """A new commit on ``ref`` holding ``files`` (over the ref's files when ``keep``); its sha."""
        base = dict(self.commits.get(self.refs.get(ref, ""), {})) if keep else {}
        base.update(files)
        sha = hashlib.sha1(f"{len(self.commits)}:{ref}:{sorted(base)}".encode()).hexdigest()
        self.commits[sha] = base
        self.refs[ref] = sha
        return sha

    def at(self, rev: str) -> str | None:
        if rev in self.refs:
            return self.refs[rev]
        return rev if rev in self.commits else None


class FakeHub:
    """The Hub on 127.0.0.1 and its CDN on 127.0.0.2, until ``close()`` (a context manager)."""

    def __init__(self, page_size: int = 1000, token: str = TOKEN):
        self.page_size = page_size
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 -> bytes: what the CDN holds
        self.requests: list[dict] = []
        self.failures: dict[str, list] = {}  # where -> [status, times]
        self.stall_api = 0.0
        self._lock = threading.Lock()
        self.hub = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, "hub"))
        self.cdn = ThreadingHTTPServer(("127.0.0.2", 0), _handler(self, "cdn"))
        for server in (self.hub, self.cdn):
            server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.2:{self.cdn.server_address[1]}"
        self._threads = [threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True) for s in (self.hub, self.cdn)]
        for t in self._threads:
            t.start()

    def __enter__(self) -> "FakeHub":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()

    # -- what tests set up ------------------------------------------------------------------------

    def dataset(self, repo_id: str, files: dict[str, bytes] | None = None, private: bool = False,
                gated: bool = False) -> Repo:
        repo = self.repos[repo_id] = Repo(private=private, gated=gated)
        if files is not None:
            self.commit(repo_id, files)
        return repo

    def commit(self, repo_id: str, files: dict[str, bytes], ref: str = "main", keep: bool = True) -> str:
        for data in files.values():
            self.blobs[hashlib.sha256(data).hexdigest()] = data
        return self.repos[repo_id].commit(files, ref, keep)

    def fail(self, where: str, status: int, times: int = 1) -> None:
        """The next ``times`` requests to ``api``, ``resolve`` or ``cdn`` answer ``status``."""
        with self._lock:
            self.failures[where] = [status, times]

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a sidecar reads this Hub with (its own HF_HOME: no saved login of the user's)."""
        return {"HF_ENDPOINT": self.url, "HF_TOKEN": self.token, "NO_PROXY": "127.0.0.1,127.0.0.2",
                "no_proxy": "127.0.0.1,127.0.0.2", "HF_HUB_DISABLE_TELEMETRY": "1", **extra}

    def seen(self, host: str, contains: str = "") -> list[dict]:
        with self._lock:
            return [r for r in self.requests if r["host"] == host and contains in r["path"]]

    def _failure(self, where: str) -> int:
        with self._lock:
            f = self.failures.get(where)
            if f and f[1] > 0:
                f[1] -= 1
                return f[0]
        return 0

    # -- the Hub's answers ----------------------------------------------------------------------------

    def sign(self, sha256: str) -> str:
        return hmac.new(SECRET, sha256.encode(), hashlib.sha256).hexdigest()

    def entries(self, files: dict[str, bytes], folder: str, recursive: bool) -> list[dict]:
        """The tree under ``folder`` as the Hub lists it: folders, then files, each with its oid and size."""
        prefix = f"{folder}/" if folder else ""
        dirs, out = set(), []
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):].split("/")
            for depth in range(1, len(rest)):
                if recursive or depth == 1:
                    dirs.add(prefix + "/".join(rest[:depth]))
            if recursive or len(rest) == 1:
                out.append(self.file_entry(path, files[path]))
        return [{"type": "directory", "oid": git_oid(d.encode()), "size": 0, "path": d} for d in sorted(dirs)] + out

    @staticmethod
    def file_entry(path: str, data: bytes) -> dict:
        entry = {"type": "file", "oid": git_oid(data), "size": len(data), "path": path}
        if len(data) >= LFS_FROM:
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry


def _handler(hub: FakeHub, host: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 20

        def log_message(self, *args) -> None:
            pass

        def answer(self, status: int, body: bytes = b"", headers: dict | None = None, code: str = "",
                   message: str = "") -> None:
            if status >= 400 and not body:
                body = json.dumps({"error": message or code or str(status)}).encode()
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if code:
                self.send_header("X-Error-Code", code)
            if message:
                self.send_header("X-Error-Message", message)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def json(self, obj, headers: dict | None = None) -> None:
            self.answer(200, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

        def do_HEAD(self) -> None:
            self.route()

        def do_GET(self) -> None:
            self.route()

        def do_POST(self) -> None:
            self.route()

        def route(self) -> None:
            auth = self.headers.get("Authorization")
            with hub._lock:
                hub.requests.append({"host": host, "method": self.command, "path": self.path, "auth": auth})
            body = b""
            if self.command == "POST":
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if host == "cdn":
                return self.cdn(auth)
            raw, _, query = self.path.partition("?")
            parts = raw.split("/")
            if parts[1:3] == ["api", "datasets"] and len(parts) >= 5:
                if hub.stall_api:
                    time.sleep(hub.stall_api)
                if status := hub._failure("api"):
                    return self.answer(status, headers={"Retry-After": "1"})
                return self.api(parts, urllib.parse.parse_qs(query), auth, body)
            if parts[1:2] == ["datasets"] and len(parts) >= 7 and parts[4] == "resolve":
                if status := hub._failure("resolve"):
                    return self.answer(status, headers={"Retry-After": "1"})
                return self.resolve(parts, auth)
            return self.answer(404, message="no such route")

        def repo(self, org: str, name: str, auth: str | None) -> Repo | None:
            """The repository, or None with the Hub's answer sent (401, 403, 404)."""
            if auth is not None and auth not in (f"Bearer {hub.token}", f"Bearer {OTHER_TOKEN}"):
                self.answer(401, code="RepoNotFound", message="Invalid credentials in Authorization header")
                return None
            repo = hub.repos.get(f"{org}/{name}")
            if repo is None or (repo.private and auth != f"Bearer {hub.token}"):
                self.answer(401 if auth is None else 404, code="RepoNotFound",
                            message="Invalid username or password." if auth is None else "Repository not found")
                return None
            if repo.gated and auth is None:
                self.answer(401, code="GatedRepo", message="Access to this dataset is restricted: log in")
                return None
            if repo.gated and auth != f"Bearer {hub.token}":
                self.answer(403, code="GatedRepo", message=f"Access to dataset {org}/{name} is restricted and you "
                                                           f"are not in the authorized list")
                return None
            return repo

        def api(self, parts: list[str], query: dict, auth: str | None, body: bytes) -> None:
            org, name, rest = parts[3], parts[4], parts[5:]
            repo = self.repo(org, name, auth)
            if repo is None:
                return
            rev = urllib.parse.unquote(rest[1]) if len(rest) >= 2 else "main"
            sha = repo.at(rev)
            if sha is None:
                return self.answer(404, code="RevisionNotFound", message=f"Invalid rev id: {rev}")
            files = repo.commits[sha]
            if not rest or rest[0] == "revision":
                return self.json({"_id": "x", "id": f"{org}/{name}", "sha": sha, "private": repo.private,
                                  "gated": "auto" if repo.gated else False, "disabled": False, "tags": []})
            if rest[0] == "tree":
                folder = urllib.parse.unquote("/".join(rest[2:])).strip("/")
                if folder and folder in files:
                    return self.json([hub.file_entry(folder, files[folder])])
                if folder and not any(p.startswith(folder + "/") for p in files):
                    return self.answer(404, code="EntryNotFound", message=f"{folder} does not exist on \"{rev}\"")
                entries = hub.entries(files, folder, query.get("recursive", ["false"])[0] == "true")
                start = int(query.get("cursor", ["0"])[0])
                page = entries[start:start + hub.page_size]
                headers = {}
                if start + hub.page_size < len(entries):
                    nxt = dict((k, v[0]) for k, v in query.items() if k != "cursor")
                    nxt["cursor"] = str(start + hub.page_size)
                    where = hub.url + "/".join(parts) + "?" + urllib.parse.urlencode(nxt)
                    headers["Link"] = f'<{where}>; rel="next"'
                return self.json(page, headers)
            if rest[0] == "paths-info" and self.command == "POST":
                asked = urllib.parse.parse_qs(body.decode()).get("paths", [])
                out = []
                for path in asked:
                    if path in files:
                        out.append(hub.file_entry(path, files[path]))
                    elif any(p.startswith(path.rstrip("/") + "/") for p in files):
                        out.append({"type": "directory", "oid": git_oid(path.encode()), "size": 0, "path": path})
                return self.json(out)
            return self.answer(404, message="no such route")

        def resolve(self, parts: list[str], auth: str | None) -> None:
            org, name = parts[2], parts[3]
            repo = self.repo(org, name, auth)
            if repo is None:
                return
            rev = urllib.parse.unquote(parts[5])
            sha = repo.at(rev)
            if sha is None:
                return self.answer(404, code="RevisionNotFound", message=f"Invalid rev id: {rev}")
            path = urllib.parse.unquote("/".join(parts[6:]))
            data = repo.commits[sha].get(path)
            if data is None:
                return self.answer(404, code="EntryNotFound", message=f"{path} does not exist on \"{rev}\"")
            headers = {"X-Repo-Commit": sha, "ETag": f'"{git_oid(data)}"'}
            if len(data) < LFS_FROM:
                return self.answer(200, data, headers)
            digest = hashlib.sha256(data).hexdigest()
            query = urllib.parse.urlencode({"X-Amz-Algorithm": "AWS4-HMAC-SHA256", "X-Amz-Expires": "3600",
                                            "X-Amz-Signature": hub.sign(digest)})
            headers.update({"Location": f"{hub.cdn_url}/repos/{digest[:2]}/{digest}?{query}",
                            "X-Linked-Size": str(len(data)), "X-Linked-ETag": f'"{digest}"'})
            return self.answer(302, b"", headers)

        def cdn(self, auth: str | None) -> None:
            if status := hub._failure("cdn"):
                return self.answer(status)
            if auth is not None:
                return self.answer(400, b"<Error><Code>InvalidArgument</Code><Message>Only one auth mechanism "
                                        b"allowed</Message></Error>")
            raw, _, query = self.path.partition("?")
            digest = raw.rsplit("/", 1)[-1]
            signature = urllib.parse.parse_qs(query).get("X-Amz-Signature", [""])[0]
            if not hmac.compare_digest(signature, hub.sign(digest)):
                return self.answer(403, b"<Error><Code>SignatureDoesNotMatch</Code></Error>")
            data = hub.blobs.get(digest)
            if data is None:
                return self.answer(404)
            return self.answer(200, data, {"Content-Type": "application/octet-stream"})

    return Handler
