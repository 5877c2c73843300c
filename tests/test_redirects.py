"""Shards, index files and sizes behind HTTP redirects (issue 51): followed to where they lead, at most 10 hops, to
http: and https: only and never down from https:; the auth header to the origins the user configured at each hop, a
caller's credential (a Hub token) to the origin first asked only; every hop's presigned query redacted.

Real HTTP servers on 127.0.0.1, and on 127.0.0.2 for "another host" (Linux routes all of 127/8 to lo: the origin
differs by host, not only by port), a real TLS server, the real transport and the real sidecar.
"""

import datetime
import http.server
import ipaddress
import logging
import os
import ssl
import threading
import urllib.parse

import pytest
from helpers import Sampler, id_shards, within

from feedline.cache.manifest import shard_path
from feedline.sampler.auth import auth_origins
from feedline.sampler.fetch import Fetcher, FetchError, RateLimiter
from feedline.sampler.http import MAX_REDIRECTS
from feedline.sampler.sources import SourceShard

SECRET = "SECRETc41d"  # in presigned queries and credentials below: it must show in no log or error
DATA = os.urandom(300_000)  # a shard's bytes (the transport checks sizes and digests, not tars)
TOKEN = {"Authorization": "Bearer hf_" + SECRET}


class Store(http.server.ThreadingHTTPServer):
    """An HTTP/1.1 server on ``host`` whose answer to each request is ``answer(method, path, headers)``: (status,
    headers, body). It keeps (method, path, headers, client port) of every request. An answer whose
    ``Content-Length`` says more than its body sends the body and then holds the connection until ``close``: a
    client that reads it waits."""

    def __init__(self, answer, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        self.seen: list[tuple[str, str, dict[str, str], int]] = []
        self.closing = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                self._serve(body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(body=False)

            def _serve(self, body: bool) -> None:
                server.seen.append((self.command, self.path, dict(self.headers), self.client_address[1]))
                status, headers, data = answer(self.command, self.path, self.headers)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                declared = int(headers.get("Content-Length", len(data)))
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)
                    self.wfile.flush()
                    if declared > len(data):
                        server.closing.wait()
                        self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        super().__init__((host, 0), Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.daemon_threads = True
        self.scheme = "https" if tls else "http"
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{self.scheme}://{host}:{port}"

    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.seen]

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        self.shutdown()
        self.server_close()


def files(content: dict[str, bytes], refuse_auth: bool = False, need: dict[str, str] | None = None):
    """An answer serving ``content`` by path (the query ignored); 400 to a request carrying an Authorization header
    where ``refuse_auth`` (as the Hub's CDN does: its URLs are presigned), 401 to one without the ``need`` headers."""

    def answer(method, path, headers):
        if refuse_auth and "Authorization" in headers:
            return 400, {}, b"Only one auth mechanism allowed\n"
        if need and any(headers.get(k) != v for k, v in need.items()):
            return 401, {}, b"401\n"
        data = content.get(urllib.parse.urlsplit(path).path)
        return (404, {}, b"404\n") if data is None else (200, {"Content-Type": "application/x-tar"}, data)

    return answer


def redirect(to, status: int = 302, need: dict[str, str] | None = None):
    """An answer redirecting every request to ``to(path)``, declaring an endless body it never sends (read, it would
    hold the client until the test ends); 401 to one without the ``need`` headers."""

    def answer(method, path, headers):
        if need and any(headers.get(k) != v for k, v in need.items()):
            return 401, {}, b"401\n"
        return status, {"Location": to(path), "Content-Length": str(1 << 40)}, b"<a>moved</a>"

    return answer


def fetcher(retries: int = 0, **kw) -> Fetcher:
    return Fetcher(5.0, retries, threading.Event(), RateLimiter(0), backoff=0.01, **kw)


def fetch(f: Fetcher, url: str, tmp_path, size: int | None = len(DATA)) -> bytes:
    dest = str(tmp_path / "x.partial")
    f.fetch(SourceShard(url, "x", size=size), dest, 1 << 30)
    with open(dest, "rb") as got:
        return got.read()


def refused(f: Fetcher, url: str, tmp_path) -> FetchError:
    dest = tmp_path / "x.partial"
    with pytest.raises(FetchError) as caught:
        f.fetch(SourceShard(url, "x"), str(dest), 1 << 30)
    assert not dest.exists()
    return caught.value


# -- followed ------------------------------------------------------------------------------------------------------

def test_a_shard_behind_a_302_to_another_host_arrives_whole_through_the_sidecar_into_the_cache(
        tmp_path, cache, samplers):
    paths = id_shards(str(tmp_path / "src"), shards=2, per_shard=5)
    content = {f"/data/{os.path.basename(p)}": open(p, "rb").read() for p in paths}
    with Store(files(content), host="127.0.0.2") as cdn, \
            Store(redirect(lambda path: f"{cdn.url}/data{path}?X-Amz-Signature={SECRET}")) as origin:
        s = Sampler(None, cache, "--policy", "fill", "--budget", "16MiB", "--min-shards", "2",
                    source=f"{origin.url}/ids-{{0000..0001}}.tar")
        samplers.append(s)
        s.wait_ready()
        for path in paths:
            name = os.path.basename(path).removesuffix(".tar")
            assert open(shard_path(cache, name), "rb").read() == open(path, "rb").read()
        out = s.stop()
    signed = [f"{path}?X-Amz-Signature={SECRET}" for path in sorted(content)]
    assert sorted(p for m, p, *_ in cdn.seen if m == "GET") == signed
    assert SECRET not in out


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_every_redirect_status_is_followed_without_reading_the_redirects_body(tmp_path, status):
    with Store(files({"/x.tar": DATA}), host="127.0.0.2") as cdn, \
            Store(redirect(lambda path: f"{cdn.url}{path}", status)) as origin:
        got = within_value(10, lambda: fetch(fetcher(), f"{origin.url}/x.tar", tmp_path))
    assert got == DATA and cdn.paths() == ["/x.tar"]


@pytest.mark.parametrize("location, arrives_at", [("../moved/x.tar?v=2", "/a/moved/x.tar?v=2"),
                                                  ("/elsewhere/x.tar", "/elsewhere/x.tar"),
                                                  ("y.tar", "/a/b/y.tar")])
def test_a_relative_location_is_resolved_against_the_url_that_answered(tmp_path, location, arrives_at):
    def answer(method, path, headers):
        if path == "/a/b/x.tar":
            return 302, {"Location": location}, b""
        return files({urllib.parse.urlsplit(arrives_at).path: DATA})(method, path, headers)

    with Store(answer) as store:
        assert fetch(fetcher(), f"{store.url}/a/b/x.tar", tmp_path) == DATA
    assert store.paths() == ["/a/b/x.tar", arrives_at]


def test_the_host_a_redirect_leads_to_keeps_its_connection_alive_for_the_next_shard(tmp_path):
    with Store(files({"/x.tar": DATA, "/y.tar": DATA}), host="127.0.0.2") as cdn, \
            Store(redirect(lambda path: f"{cdn.url}{path}")) as origin:
        f = fetcher()
        fetch(f, f"{origin.url}/x.tar", tmp_path)
        os.unlink(tmp_path / "x.partial")
        fetch(f, f"{origin.url}/y.tar", tmp_path)
    assert cdn.paths() == ["/x.tar", "/y.tar"]
    assert len({port for *_, port in cdn.seen}) == 1  # one connection, kept alive


def test_an_index_file_behind_a_redirect_is_read(tmp_path):
    index = b"a.tar\nb.tar\n"
    with Store(files({"/index.txt": index}), host="127.0.0.2") as cdn, \
            Store(redirect(lambda path: f"{cdn.url}{path}")) as origin:
        assert fetcher().text(f"{origin.url}/index.txt") == index.decode()


def test_the_size_of_a_shard_behind_a_redirect_is_the_final_answers(tmp_path):
    with Store(files({"/x.tar": DATA}), host="127.0.0.2") as cdn, \
            Store(redirect(lambda path: f"{cdn.url}{path}")) as origin:
        assert fetcher().size(f"{origin.url}/x.tar", 5.0) == len(DATA)
    assert [m for m, *_ in cdn.seen] == ["HEAD"]


def test_each_hop_takes_its_own_route_through_the_proxy_or_around_it(tmp_path, monkeypatch):
    with Store(files({"/x.tar": DATA}), host="127.0.0.2") as cdn, \
            Store(redirect(lambda path: f"{cdn.url}/x.tar")) as proxy:  # answers what it is asked to forward
        for name in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", "127.0.0.2")
        assert fetch(fetcher(), "http://origin.example/x.tar", tmp_path) == DATA
    assert proxy.paths() == ["http://origin.example/x.tar"] and cdn.paths() == ["/x.tar"]


# -- refused -------------------------------------------------------------------------------------------------------

def test_a_redirect_loop_stops_after_10_hops_with_a_clear_error_and_no_retry(tmp_path):
    with Store(redirect(lambda path: path)) as store:
        error = refused(fetcher(retries=3), f"{store.url}/x.tar", tmp_path)
    assert error.reason == "http_status" and not error.retry
    assert f"stopped after {MAX_REDIRECTS} redirects" in str(error) and "loop" in str(error)
    assert len(store.seen) == MAX_REDIRECTS + 1  # the first request and 10 hops, never tried again


@pytest.mark.parametrize("location", ["file:///etc/passwd", "ftp://127.0.0.2/x.tar", "s3://bucket/x.tar",
                                      "pipe:cat /etc/passwd"])
def test_a_location_to_a_non_http_url_is_refused_and_nothing_is_read(tmp_path, location):
    with Store(redirect(lambda path: location)) as store:
        error = refused(fetcher(retries=3), f"{store.url}/x.tar", tmp_path)
    assert error.reason == "http_status" and not error.retry, error
    assert "refused" in str(error) and "http: or https: URL only" in str(error), error
    assert len(store.seen) == 1


def test_a_redirect_without_a_location_fails_saying_so(tmp_path):
    with Store(lambda method, path, headers: (302, {}, b"")) as store:
        error = refused(fetcher(), f"{store.url}/x.tar", tmp_path)
    assert error.reason == "http_status" and "names no Location" in str(error)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A server context with a certificate for 127.0.0.1, and the file a client trusts it by."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    d = tmp_path_factory.mktemp("tls")
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    return ctx, str(d / "cert.pem")


def test_an_https_to_https_redirect_is_followed(tmp_path, tls):
    ctx, ca = tls

    def answer(method, path, headers):
        if path == "/x.tar":
            return 302, {"Location": "/y.tar"}, b""
        return files({"/y.tar": DATA})(method, path, headers)

    with Store(answer, tls=ctx) as store:
        assert fetch(fetcher(ca_file=ca), f"{store.url}/x.tar", tmp_path) == DATA
    assert store.paths() == ["/x.tar", "/y.tar"]


def test_an_https_to_http_downgrade_is_refused_before_the_http_host_is_asked(tmp_path, tls):
    ctx, ca = tls
    with Store(files({"/x.tar": DATA}), host="127.0.0.2") as plain, \
            Store(redirect(lambda path: f"{plain.url}{path}"), tls=ctx) as store:
        error = refused(fetcher(retries=3, ca_file=ca), f"{store.url}/x.tar", tmp_path)
    assert error.reason == "http_status" and not error.retry
    assert "https: down to http:" in str(error) and "in the clear" in str(error), error
    assert plain.seen == [] and len(store.seen) == 1


# -- credentials ---------------------------------------------------------------------------------------------------

def test_the_auth_header_reaches_the_origin_but_not_the_other_host(tmp_path):
    with Store(files({"/x.tar": DATA}), host="127.0.0.2") as cdn, \
            Store(redirect(lambda path: f"{cdn.url}{path}")) as origin:
        f = fetcher(auth=lambda: TOKEN, auth_origins=auth_origins(f"{origin.url}/x.tar"))
        assert fetch(f, f"{origin.url}/x.tar", tmp_path) == DATA
    assert origin.seen[0][2].get("Authorization") == TOKEN["Authorization"]
    assert cdn.seen and all("Authorization" not in h for _, _, h, _ in cdn.seen), cdn.seen


def test_a_redirect_to_a_host_listed_in_auth_extra_hosts_carries_the_auth_header(tmp_path):
    with Store(files({"/x.tar": DATA}, need=TOKEN), host="127.0.0.2") as mirror, \
            Store(redirect(lambda path: f"{mirror.url}{path}")) as origin:
        f = fetcher(auth=lambda: TOKEN, auth_origins=auth_origins(f"{origin.url}/x.tar", mirror.url))
        assert fetch(f, f"{origin.url}/x.tar", tmp_path) == DATA


@pytest.mark.parametrize("call", ["shard", "index", "size"])
def test_a_credential_reaches_the_first_origin_only_and_the_cdn_that_refuses_a_second_one_serves(tmp_path, call):
    with Store(files({"/x.tar": DATA}, refuse_auth=True), host="127.0.0.2") as cdn, \
            Store(redirect(lambda path: f"{cdn.url}{path}?X-Amz-Signature={SECRET}", need=TOKEN)) as hub:
        http = fetcher().http
        url = f"{hub.url}/x.tar"
        if call == "shard":
            dest = str(tmp_path / "x.partial")
            assert http.get(SourceShard(url, "x", size=len(DATA)), dest, 1 << 30, credential=TOKEN) == len(DATA)
            assert open(dest, "rb").read() == DATA
        else:
            status, _, length, body = http.request("GET" if call == "index" else "HEAD", url, max_body=1 << 20,
                                                   credential=TOKEN)
            assert (status, length) == (200, str(len(DATA))) and body == (DATA if call == "index" else b"")
    assert hub.seen[0][2].get("Authorization") == TOKEN["Authorization"]
    assert len(cdn.seen) == 1 and "Authorization" not in cdn.seen[0][2]


def test_a_credential_follows_a_redirect_within_its_own_origin(tmp_path):
    def answer(method, path, headers):
        if path == "/resolve/x.tar":
            return 302, {"Location": "/blobs/x.tar"}, b""
        return files({"/blobs/x.tar": DATA}, need=TOKEN)(method, path, headers)

    with Store(answer) as hub:
        dest = str(tmp_path / "x.partial")
        assert fetcher().http.get(SourceShard(f"{hub.url}/resolve/x.tar", "x"), dest, 1 << 30,
                                  credential=TOKEN) == len(DATA)
    assert [h.get("Authorization") for _, _, h, _ in hub.seen] == [TOKEN["Authorization"]] * 2


# -- what is said --------------------------------------------------------------------------------------------------

def test_each_hop_is_logged_at_debug_only_with_its_presigned_query_redacted(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="feedline.sampler")
    with Store(files({"/x.tar": DATA}), host="127.0.0.2") as cdn, \
            Store(redirect(lambda path: f"{cdn.url}{path}?X-Amz-Signature={SECRET}")) as origin:
        assert fetch(fetcher(), f"{origin.url}/x.tar", tmp_path) == DATA
    hops = [r for r in caplog.records if "302" in r.getMessage()]
    assert hops and all(r.levelno == logging.DEBUG for r in hops), caplog.text
    assert f"{cdn.url}/x.tar?X-Amz-Signature=REDACTED" in caplog.text and SECRET not in caplog.text


def test_an_error_naming_a_presigned_hop_shows_it_redacted(tmp_path):
    with Store(redirect(lambda path: f"/x.tar?sig={SECRET}")) as store:
        error = refused(fetcher(), f"{store.url}/x.tar", tmp_path)
    assert f"{store.url}/x.tar?sig=REDACTED" in str(error) and SECRET not in str(error)


def within_value(seconds: float, call):
    """``call()``'s result from a thread given ``seconds`` (its exception raised): a client reading a redirect's
    endless body would hang."""
    out = within(seconds, call)
    if "error" in out:
        raise out["error"]
    return out["value"]
