"""Hostile sources, stores and neighbours, part two (issue 49): presigned queries and tokens stay out of what
feedline writes and says, the credential goes only where the user said, what a store answers is bounded before it
is held, and a manifest's ids become paths only once they are ids the sampler makes.

Real HTTP servers on 127.0.0.1 (the demo store, and small hostile ones here), a real S3 server (moto), the real
sidecar and loader.
"""

import http.server
import json
import logging
import os
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest
from helpers import ROOT, id_shards, wait_for, within, write_tar
from prometheus_client import generate_latest

from feedline.formats.urls import redact
from feedline import StagingLoader
from feedline.api.config import Config
from feedline.cache.manifest import ID_MAX, MANIFEST, check_id, read_manifest
from feedline.cache.store import CacheStore
from feedline.demo.store import FileStore, Fault
from feedline.errors import SettingError
from feedline.metrics.catalog import SAMPLER
from feedline.metrics.sink import PrometheusSink
from feedline.sampler.fetch import Fetcher, FetchError, RateLimiter
from feedline.sampler.settings import SidecarSettings
from feedline.sampler.sidecar import Sidecar
from feedline.sampler.sources import SourceShard, list_shards

SECRET = "SECRETb7f3"  # in every presigned query and token below: it must show nowhere
TOKEN = "Authorization: Bearer s3cr3t"


class Hostile(http.server.ThreadingHTTPServer):
    """A store that answers every GET with ``status`` and a body that never ends (chunked, or under a huge
    Content-Length), and keeps the headers of every request; ``close()`` ends the bodies in flight."""

    def __init__(self, status: int = 200, chunked: bool = True) -> None:
        self.seen: list[dict[str, str]] = []
        self.sent = 0
        self.stopping = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self) -> None:  # noqa: N802
                server.seen.append(dict(self.headers))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                server.seen.append(dict(self.headers))
                self.send_response(status)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", str(1 << 40))
                self.end_headers()
                line = b"https://elsewhere.example/x.tar\n" * 2048
                chunk = b"%x\r\n%s\r\n" % (len(line), line) if chunked else line
                try:
                    while not server.stopping.is_set():
                        self.wfile.write(chunk)
                        server.sent += len(chunk)
                        time.sleep(0.005)  # ~13 MB/s: a client that reads it all cannot eat the test machine
                except OSError:
                    pass
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.daemon_threads = True
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> "Hostile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()


# -- (a) presigned queries and tokens, redacted -------------------------------------------------------------------

def test_a_presigned_query_or_a_password_reaches_no_log_manifest_or_metric_while_the_shard_stays_recognisable(
        tmp_path, cache, caplog):
    id_shards(str(tmp_path / "a"), shards=2, per_shard=4)
    caplog.set_level(logging.DEBUG)
    sink = PrometheusSink(SAMPLER)
    with FileStore(str(tmp_path / "a")) as store:
        host = store.url.removeprefix("http://")
        (tmp_path / "a" / "index.txt").write_text(
            f"ids-0000.tar?X-Amz-Signature={SECRET}&X-Amz-Credential=AKIA%2F{SECRET}&X-Amz-Security-Token={SECRET}\n"
            f"http://user:{SECRET}@{host}/ids-0001.tar?sv=2024-01-01&sig={SECRET}\n")
        store.faults["ids-0001.tar"] = Fault(status=500)  # fails every time: its URL is logged
        sidecar = Sidecar(SidecarSettings(source=f"{store.url}/index.txt?token={SECRET}", cache=cache,
                                          budget=16 << 20, retries=1, policy="fill"), sink)
        runner = threading.Thread(target=sidecar.run)
        runner.start()
        try:
            assert wait_for(lambda: "ids-0001.tar" in caplog.text and "trying it again" in caplog.text
                            and sidecar.store.ids() == {"ids-0000"}, 20), caplog.text
        finally:
            sidecar.stop()
            runner.join()
    manifest = open(os.path.join(cache, MANIFEST)).read()
    said = caplog.text + manifest + generate_latest(sink.registry).decode()
    assert SECRET not in said
    assert f"http://REDACTED@{host}/ids-0001.tar?sv=REDACTED&sig=REDACTED" in caplog.text
    assert read_manifest(cache).shards[0].source == (f"{store.url}/ids-0000.tar?X-Amz-Signature=REDACTED&"
                                                     f"X-Amz-Credential=REDACTED&X-Amz-Security-Token=REDACTED")


def test_a_presigned_index_that_fails_is_refused_naming_it_without_its_signature(tmp_path, cache):
    (tmp_path / "a").mkdir()
    with FileStore(str(tmp_path / "a")) as store:  # no index.txt there: 404
        with pytest.raises(SettingError) as refused:
            Sidecar(SidecarSettings(source=f"{store.url}/index.txt?X-Goog-Signature={SECRET}", cache=cache))
    assert SECRET not in str(refused.value) and f"{store.url}/index.txt?X-Goog-Signature=REDACTED" in str(
        refused.value)


def test_the_configuration_error_of_feedline_sample_never_shows_a_presigned_source(tmp_path):
    source = f"http://127.0.0.1:9/index.txt?access_token={SECRET}"  # nothing listens on port 9: unreachable
    out = subprocess.run([sys.executable, "-m", "feedline", "sample", "--source", source, "--cache",
                          str(tmp_path / "cache"), "--metrics-port", "0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "300"})
    assert out.returncode == 2, out.stderr
    assert "configuration error" in out.stderr and "127.0.0.1:9/index.txt" in out.stderr, out.stderr
    assert SECRET not in out.stdout + out.stderr


@pytest.mark.parametrize("url, shown", [
    ("https://cdn.example/__token__/exp=1700000000~acl=/*~hmac=5ecre7c0ffee/data/shard-000001.tar",
     "https://cdn.example/__token__/exp=REDACTED~acl=REDACTED/*~hmac=REDACTED/data/shard-000001.tar"),
    ("https://h.example/t/eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sflKxwRJSMeKKF2QT4fwpMeJ/shard-0.tar",
     "https://h.example/t/REDACTED/shard-0.tar"),
    ("https://h.example/hf_abcdefghijklmnopqrstuvwxyz0123/shard.tar", "https://h.example/REDACTED/shard.tar"),
    ("https://h.example/d;sig=5ecre7;sv=2020-01-01/shard.tar", "https://h.example/d;sig=REDACTED;sv=REDACTED/shard.tar"),
    ("https://h.example/AKIAIOSFODNN7EXAMPLE/shard.tar", "https://h.example/REDACTED/shard.tar"),
    ("https://h.example/k/9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08/shard.tar",
     "https://h.example/k/REDACTED/shard.tar"),
    ("https://u:5ecre7@h.example/a/shard.tar", "https://REDACTED@h.example/a/shard.tar"),
])
def test_a_secret_in_a_urls_path_is_redacted_and_the_shard_stays_recognisable(url, shown):
    assert redact(url) == shown


@pytest.mark.parametrize("url", [
    "https://huggingface.co/datasets/org/name/resolve/main/train/shard-000001.tar",
    "s3://bucket/prefix/2024-01-01/part-0001/shard-{000000..000099}.tar",
    "https://h.example/data/v2/webdataset/train/shard-000123.tar",
])
def test_a_path_without_a_secret_is_shown_as_it_is(url):
    assert redact(url) == url


def test_a_token_in_the_path_of_a_failing_source_never_reaches_the_error(tmp_path):
    source = "http://127.0.0.1:9/__token__/exp=1~hmac=" + SECRET + "/index.txt"  # unreachable: refused at start-up
    out = subprocess.run([sys.executable, "-m", "feedline", "sample", "--source", source, "--cache",
                          str(tmp_path / "cache"), "--metrics-port", "0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "300"})
    assert out.returncode == 2, out.stderr
    assert "127.0.0.1:9/__token__/exp=REDACTED~hmac=REDACTED/index.txt" in out.stderr, out.stderr
    assert SECRET not in out.stdout + out.stderr


def test_the_debug_log_of_feedline_sample_never_shows_the_aws_session_token(tmp_path):
    from feedline.demo.s3store import S3Store

    with S3Store("feedline-data") as s3:  # botocore logs every signed request's headers at DEBUG
        out = subprocess.run([sys.executable, "-m", "feedline", "sample", "--source", "s3://feedline-data/none/",
                              "--cache", str(tmp_path / "cache"), "--metrics-port", "0", "--log-level", "DEBUG"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, **s3.env(AWS_SESSION_TOKEN=SECRET)})
    assert out.returncode == 2 and "no shard under this prefix" in out.stderr, out.stderr
    assert SECRET not in out.stdout + out.stderr


@pytest.mark.parametrize("make", [
    lambda: Config.load({}, env={"FEEDLINE_AUTH_HEADER": f"Authorization: Bearer {SECRET}"}),
    lambda: SidecarSettings(source="x.tar", auth_header=f"Authorization: Bearer {SECRET}"),
], ids=["Config", "SidecarSettings"])
def test_the_auth_header_never_shows_in_a_repr_of_the_settings(make):
    assert SECRET not in repr(make())


# -- (b) the credential goes to the hosts the user listed, and no other ---------------------------------------------

def test_a_host_listed_in_auth_extra_hosts_gets_the_header_and_one_not_listed_does_not(tmp_path, cache):
    id_shards(str(tmp_path / "a"), shards=1, per_shard=4)
    with FileStore(str(tmp_path / "a")) as a, Hostile(404) as cdn, Hostile(404) as other:
        a.auth = "Bearer s3cr3t"
        (tmp_path / "a" / "index.txt").write_text(f"ids-0000.tar\n{cdn.url}/x.tar\n{other.url}/y.tar\n")
        Sidecar(SidecarSettings(source=f"{a.url}/index.txt", cache=cache, budget=16 << 20, auth_header=TOKEN,
                                auth_extra_hosts=f" {cdn.url} ", retries=0))  # the start-up probe asks all three
    assert cdn.seen and all(h.get("Authorization") == "Bearer s3cr3t" for h in cdn.seen), cdn.seen
    assert other.seen and all("Authorization" not in h for h in other.seen), other.seen


@pytest.mark.parametrize("entry", ["https://cdn.example.com/data", "ftp://cdn.example.com", "user@cdn.example.com",
                                   "*.example.com", "cdn.example.com:https", "https://"])
def test_a_malformed_auth_extra_hosts_entry_is_refused_at_start_up_naming_the_setting_and_the_form(entry):
    with pytest.raises(SettingError) as refused:
        SidecarSettings(source="x.tar", auth_extra_hosts=f"https://ok.example.com,{entry}")
    assert refused.value.setting == "auth_extra_hosts"
    assert repr(entry) in refused.value.message and "https://host:port" in refused.value.message


# -- (c) what a store answers is bounded before it is held ---------------------------------------------------------

@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "huge-content-length"])
def test_an_endless_index_is_refused_at_max_index_bytes_naming_it_in_bounded_memory(cache, chunked):
    with Hostile(200, chunked) as store:
        url = f"{store.url}/index.txt?sig={SECRET}"
        tracemalloc.start()
        try:
            out = within(20, lambda: Sidecar(SidecarSettings(source=url, cache=cache, max_index_bytes=256 << 10)))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert isinstance(out.get("error"), SettingError), out
    message = str(out["error"])
    assert f"{store.url}/index.txt?sig=REDACTED" in message and "max_index_bytes=262144" in message, message
    assert SECRET not in message
    assert peak < 16 << 20, peak


def test_an_index_answered_500_with_an_endless_body_is_refused_without_reading_it(cache):
    with Hostile(500) as store:
        out = within(20, lambda: Sidecar(SidecarSettings(source=f"{store.url}/index.txt", cache=cache)))
    assert isinstance(out.get("error"), SettingError) and "HTTP 500" in str(out["error"]), out


def test_a_shard_answered_500_with_an_endless_body_fails_at_once_without_reading_it(tmp_path):
    with Hostile(500) as store:
        fetcher = Fetcher(5.0, 0, threading.Event(), RateLimiter(0))
        shard = SourceShard(f"{store.url}/x.tar", "x")
        out = within(20, lambda: fetcher.fetch(shard, str(tmp_path / "x.partial"), 1 << 30))
    assert isinstance(out.get("error"), FetchError) and out["error"].reason == "http_status", out
    assert not os.path.exists(tmp_path / "x.partial")


def test_an_s3_index_over_max_index_bytes_is_refused_naming_it(tmp_path, cache, monkeypatch):
    from feedline.demo.s3store import S3Store

    with S3Store("feedline-data") as s3:
        for name, value in s3.env().items():
            monkeypatch.setenv(name, value)
        s3.client.put_object(Bucket="feedline-data", Key="index.txt", Body=b"x-0000.tar\n" * 400)  # 4400 bytes
        with pytest.raises(SettingError, match=r"s3://feedline-data/index.txt is larger than max_index_bytes=1024"):
            Sidecar(SidecarSettings(source="s3://feedline-data/index.txt", cache=cache, max_index_bytes=1024))


# -- (d) a manifest's ids are checked before they become paths -----------------------------------------------------

def write_manifest_naming(cache, shard_id, retained=()):
    os.makedirs(os.path.join(cache, "shards"), exist_ok=True)
    doc = {"generation": 7, "budget_bytes": 1 << 20, "complete": True, "retained": list(retained),
           "shards": [{"id": shard_id, "bytes": 1, "samples": 3, "added_at": 1.0, "format": "tar"}]}
    with open(os.path.join(cache, MANIFEST), "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize("shard_id", ["../outside", "../../etc/x", "/abs/x", "a/b", "..", ".", ".hidden", "a\0b",
                                      "x" * (ID_MAX + 1), "", 7])
def test_a_manifest_id_the_sampler_would_not_make_is_refused_naming_the_cache_and_the_id(tmp_path, shard_id):
    cache = str(tmp_path / "cache")
    write_manifest_naming(cache, shard_id)
    with pytest.raises(ValueError) as refused:
        read_manifest(cache)
    assert cache in str(refused.value) and repr(shard_id)[:40] in str(refused.value)


def test_a_retained_id_that_is_a_path_is_refused_as_a_shards_id_is(tmp_path):
    cache = str(tmp_path / "cache")
    write_manifest_naming(cache, "ids-0000", retained=["../../outside"])
    with pytest.raises(ValueError, match=r"'\.\./\.\./outside' is not a cache id"):
        read_manifest(cache)


def test_a_loader_over_a_manifest_naming_a_shard_outside_the_cache_never_reads_it(tmp_path):
    cache = str(tmp_path / "cache")
    outside = write_tar(str(tmp_path / "outside.tar"), [(f"outside-{i}", {"cls": b"99"}) for i in range(3)])
    before = open(outside, "rb").read()
    write_manifest_naming(cache, "../../outside")  # <cache>/shards/../../outside.tar: the file above
    seen = []
    with pytest.raises((ValueError, TimeoutError)):  # refused, or waited for a manifest it may read
        with StagingLoader(cache=cache, batch_size=1, workers=1, wait_timeout=1, spec={"cls": "int64"}) as loader:
            for batch in loader:
                seen += batch["cls"].tolist()
    assert seen == [] and open(outside, "rb").read() == before


def test_the_sidecars_recovery_over_a_manifest_naming_files_outside_removes_none_of_them(tmp_path):
    cache = str(tmp_path / "cache")
    for name in ("outside.tar", "kept.tar"):
        write_tar(str(tmp_path / name), [("k", {"cls": b"1"})])
    write_manifest_naming(cache, "../../outside", retained=["../../kept"])
    store = CacheStore(cache, 1 << 20)
    store.recover()
    store.release()
    store.evict_oldest(10)
    assert os.path.exists(tmp_path / "outside.tar") and os.path.exists(tmp_path / "kept.tar")
    assert store.entries == []


def test_recovery_removes_a_shard_file_whose_name_is_no_cache_id_so_the_manifest_it_writes_stays_readable(tmp_path):
    store = CacheStore(str(tmp_path / "cache"), 1 << 20)
    for name in ("x" * (ID_MAX + 1), "a b", "ids-0000"):  # an older feedline's long id; a file someone copied in
        write_tar(os.path.join(store.shards_dir, name + ".tar"), [("k", {"cls": b"1"})])
    store.recover()
    assert [s.id for s in read_manifest(store.root).shards] == ["ids-0000"]
    assert sorted(os.listdir(store.shards_dir)) == [".partial", "ids-0000.idx", "ids-0000.tar"]


@pytest.mark.parametrize("name", ["...tar", ".hidden.tar", "a b(1).tar", "é.tar", "x" * 300 + ".tar",
                                  "tfds.tfrecord-00000-of-00001.gz", "d/ids-0000.tar", "e/ids-0000.tar"])
def test_every_id_the_sampler_makes_is_one_a_manifest_may_hold(name):
    names = [f"https://store.example/{name}", f"https://store.example/{name}?sig=1"]
    for shard in list_shards(" :: ".join(names)):
        assert check_id(shard.id) == shard.id
