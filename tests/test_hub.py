"""hf://datasets/... sources against a stand-in Hub on 127.0.0.1 (tests/fake_hub.py: the endpoints huggingface_hub
2.4 calls, the Link header's pages, the token checked) whose downloads redirect to a CDN on 127.0.0.2 that refuses
a request carrying an Authorization header: the store itself, then the sidecar end to end."""

import hashlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from fake_hub import OTHER_TOKEN, TOKEN, FakeHub
from helpers import ROOT, Sampler, id_shards, manifest_ids, wait_for

from feedline.demo.procs import free_port
from feedline.sampler.hub import HubStore, parse_hf_url, unpinned
from feedline.sampler.http import HttpTransport
from feedline.sampler.ratelimit import RateLimiter
from feedline.sampler.sources import SourceShard
from feedline.sampler.stores import StoreContext, StoreError, Stores

REPO = "feedline-org/ids"
SHARDS = 6
PER_SHARD = 20


@pytest.fixture
def hub():
    with FakeHub() as server:
        yield server


@pytest.fixture
def shard_files(tmp_path):
    """SHARDS id shards of PER_SHARD samples (2 KiB payloads: LFS files, served through the CDN), by repo path."""
    paths = id_shards(str(tmp_path / "src"), shards=SHARDS, per_shard=PER_SHARD, payload=2048)
    return {f"data/{os.path.basename(p)}": open(p, "rb").read() for p in paths}


@pytest.fixture
def dataset(hub, shard_files):
    """REPO on the Hub: the shards under data/, a README, a small index and a shard elsewhere."""
    files = {**shard_files, "README.md": b"# ids\n", "other/ids-9999.tar": shard_files["data/ids-0000.tar"],
             "data/valid-0000.tar": shard_files["data/ids-0001.tar"]}
    hub.dataset(REPO, files)
    return files


@pytest.fixture
def no_saved_login(monkeypatch, tmp_path):
    """No HF_TOKEN and no login saved by huggingface_hub (never the user's own)."""
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)


def make_store(hub, token=TOKEN, timeout=10.0):
    http = HttpTransport(timeout, threading.Event(), RateLimiter(0))
    return HubStore(StoreContext(timeout, 1, 2, http), endpoint=hub.url, token=token)


def download(store, url, dest, size=None):
    https_url, credential = store.resolve(url)
    return store.context.http.get(SourceShard(https_url, "x", "", size), str(dest), 1 << 30, credential=credential)


# -- URLs ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url, parsed", [
    ("hf://datasets/org/name/data/train-0000.tar", ("org/name", None, "data/train-0000.tar")),
    ("hf://datasets/org/name@main/data/", ("org/name", "main", "data/")),
    ("hf://datasets/org/name@v1.0/a/b-", ("org/name", "v1.0", "a/b-")),
    ("hf://datasets/org/name", ("org/name", None, "")),
    ("hf://datasets/org/name@refs/convert/parquet/default/train/0000.parquet",
     ("org/name", "refs/convert/parquet", "default/train/0000.parquet")),
    ("hf://datasets/org/name@refs/pr/3", ("org/name", "refs/pr/3", "")),
    ("hf://datasets/org/name@my%2Fbranch/x.tar", ("org/name", "my/branch", "x.tar")),
    ("hf://datasets/org/name/file@2.tar", ("org/name", None, "file@2.tar")),
])
def test_hf_urls_parse_into_repository_revision_and_path(url, parsed):
    assert parse_hf_url(url) == parsed
    assert unpinned(url) == f"hf://datasets/{parsed[0]}/{parsed[2]}"


@pytest.mark.parametrize("url, says", [
    ("hf://models/org/name/x.tar", "dataset repositories only"),
    ("hf://spaces/org/name/x.tar", "dataset repositories only"),
    ("hf://dataset/org/name/x.tar", "hf://datasets/"),
    ("hf://org/name/x.tar", "write hf://datasets/"),
    ("hf://datasets/org", "give both its org and its name"),
    ("hf://datasets/", "give both its org and its name"),
    ("hf://datasets/org@main/x.tar", "names no dataset"),
    ("hf://datasets/org/name@/x.tar", "nothing after the '@'"),
    ("hf://datasets/org/na me/x.tar", "not a Hub name"),
    ("hf://datasets/org/name/../other/x.tar", "'..'"),
    ("s3://bucket/x.tar", "not an hf:// URL"),
])
def test_malformed_hf_urls_are_refused_saying_what_to_write(url, says):
    with pytest.raises(ValueError) as err:
        parse_hf_url(url)
    assert says in str(err.value), str(err.value)


def test_resolve_gives_the_hub_url_quoted_and_the_token_for_the_hub_only(hub, no_saved_login):
    store = make_store(hub)
    url, credential = store.resolve("hf://datasets/org/name@refs/convert/parquet/a b/c#1.parquet")
    assert url == f"{hub.url}/datasets/org/name/resolve/refs%2Fconvert%2Fparquet/a%20b/c%231.parquet"
    assert credential == {"Authorization": f"Bearer {TOKEN}"}
    url, credential = make_store(hub, token=None).resolve("hf://datasets/org/name/x.tar")
    assert url == f"{hub.url}/datasets/org/name/resolve/main/x.tar" and credential == {}
    with pytest.raises(StoreError, match="a folder"):
        store.resolve("hf://datasets/org/name/data/")


def test_the_store_is_opened_by_scheme_with_hf_endpoint_and_hf_token(hub, dataset, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url + "/")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    http = HttpTransport(10, threading.Event(), RateLimiter(0))
    store = Stores(StoreContext(10, 1, 2, http)).for_url("hf://datasets/org/name/x.tar")
    assert isinstance(store, HubStore) and store.endpoint == hub.url and store.token == TOKEN
    assert len(store.list(f"hf://datasets/{REPO}/data/ids-")) == SHARDS


def test_the_saved_login_is_the_token_when_hf_token_is_unset(hub, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: TOKEN)
    http = HttpTransport(10, threading.Event(), RateLimiter(0))
    assert HubStore(StoreContext(10, 1, 2, http), endpoint=hub.url).credential == {"Authorization": f"Bearer {TOKEN}"}


# -- listing ------------------------------------------------------------------------------------------------------


def test_a_listing_finds_every_file_under_the_prefix_pinned_to_one_commit_with_lfs_sizes(hub, dataset):
    store = make_store(hub)
    sha = hub.repos[REPO].refs["main"]
    found = store.list(f"hf://datasets/{REPO}/data/")
    assert sorted(o.url for o in found) == sorted(f"hf://datasets/{REPO}@{sha}/{p}" for p in dataset
                                                  if p.startswith("data/"))
    assert all(o.size == len(dataset[parse_hf_url(o.url)[2]]) for o in found)
    mid_name = store.list(f"hf://datasets/{REPO}/data/ids-")  # a glob's fixed part ends mid-name
    assert sorted(parse_hf_url(o.url)[2] for o in mid_name) == [f"data/ids-{k:04d}.tar" for k in range(SHARDS)]
    everything = store.list(f"hf://datasets/{REPO}")
    assert {parse_hf_url(o.url)[2] for o in everything} == set(dataset)
    assert store.list(f"hf://datasets/{REPO}/nothing-here/") == []
    # the tree was listed at the commit, never at the branch
    assert all(f"/tree/{sha}" in r["path"] for r in hub.seen("hub", "/tree/"))


def test_a_branch_is_resolved_once_and_its_files_come_from_that_commit_after_it_moves(hub, dataset, tmp_path):
    store = make_store(hub)
    before = hub.repos[REPO].refs["main"]
    first = store.list(f"hf://datasets/{REPO}/data/ids-")
    hub.commit(REPO, {"data/ids-0000.tar": b"\0" * 4096, "data/ids-0099.tar": b"\0" * 4096})  # main moves on
    again = store.list(f"hf://datasets/{REPO}/data/ids-")
    assert again == first and all(f"@{before}/" in o.url for o in again)
    assert len(hub.seen("hub", "/revision/main")) == 1  # resolved once per store
    n = download(store, first[0].url, tmp_path / "old.tar", first[0].size)
    assert open(tmp_path / "old.tar", "rb").read() == dataset["data/ids-0000.tar"] and n == first[0].size
    fresh = make_store(hub).list(f"hf://datasets/{REPO}/data/ids-")  # a new run sees the new commit
    assert len(fresh) == SHARDS + 1 and all(f"@{hub.repos[REPO].refs['main']}/" in o.url for o in fresh)
    assert store.pin(f"hf://datasets/{REPO}/data/ids-0001.tar") == f"hf://datasets/{REPO}@{before}/data/ids-0001.tar"


def test_a_listing_longer_than_a_page_follows_the_link_header_to_the_end(shard_files):
    with FakeHub(page_size=4) as hub:
        files = {f"data/part-{k:03d}/{name[5:]}": data for k in range(3) for name, data in shard_files.items()}
        hub.dataset(REPO, files)
        found = make_store(hub).list(f"hf://datasets/{REPO}/data/")
        assert sorted(parse_hf_url(o.url)[2] for o in found) == sorted(files)
        pages = hub.seen("hub", "/tree/")
        assert len(pages) >= len(files) // 4 and any("cursor=" in r["path"] for r in pages)


def test_a_listing_past_max_index_bytes_is_refused_naming_the_bound(shard_files):
    from feedline.sampler.stores import StoreError

    with FakeHub(page_size=4) as hub:
        hub.dataset(REPO, {f"data/part-{k:03d}.tar": b"x" for k in range(30)})
        store = make_store(hub)
        assert len(store.list(f"hf://datasets/{REPO}/data/")) == 30
        store.context = replace(store.context, max_list_bytes=4096)  # 14 entries of ~290 bytes
        with pytest.raises(StoreError, match="past max_index_bytes=4096 bytes after") as got:
            store.list(f"hf://datasets/{REPO}/data/")
        assert got.value.reason == "too_large"


def test_a_revision_with_a_slash_is_encoded_whole_in_every_request(hub, shard_files, tmp_path):
    hub.dataset(REPO, {"README.md": b"x"})
    parquet = hub.commit(REPO, {"default/train/0000.parquet": b"P" * 2048}, ref="refs/convert/parquet", keep=False)
    mine = hub.commit(REPO, {"data/ids-0000.tar": shard_files["data/ids-0000.tar"]}, ref="my/branch")
    store = make_store(hub)
    found = store.list(f"hf://datasets/{REPO}@refs/convert/parquet/default/")
    assert [o.url for o in found] == [f"hf://datasets/{REPO}@{parquet}/default/train/0000.parquet"]
    assert hub.seen("hub", "/revision/refs%2Fconvert%2Fparquet")
    assert [o.url for o in store.list(f"hf://datasets/{REPO}@my%2Fbranch/data/")] == [
        f"hf://datasets/{REPO}@{mine}/data/ids-0000.tar"]
    unpinned = f"hf://datasets/{REPO}@refs/convert/parquet/default/train/0000.parquet"
    assert "/resolve/refs%2Fconvert%2Fparquet/default/train/0000.parquet" in store.resolve(unpinned)[0]
    assert download(store, unpinned, tmp_path / "p.parquet") == 2048


# -- size, text, download -------------------------------------------------------------------------------------------


def test_sizes_come_from_the_listing_or_from_paths_info(hub, dataset):
    store = make_store(hub)
    assert store.size(f"hf://datasets/{REPO}/data/ids-0002.tar") == len(dataset["data/ids-0002.tar"])
    assert store.size(f"hf://datasets/{REPO}@main/README.md") == len(dataset["README.md"])
    assert len(hub.seen("hub", "/paths-info/")) == 2
    listed = store.list(f"hf://datasets/{REPO}/data/ids-0003")[0]
    assert store.size(listed.url) == listed.size and len(hub.seen("hub", "/paths-info/")) == 2
    with pytest.raises(StoreError, match="no file data/nope.tar in dataset") as err:
        store.size(f"hf://datasets/{REPO}/data/nope.tar")
    assert err.value.reason == "http_status" and not err.value.retry
    with pytest.raises(StoreError, match="a folder"):
        store.size(f"hf://datasets/{REPO}/data")


def test_text_reads_a_small_file_from_the_hub_and_a_large_one_through_the_cdn(hub, dataset):
    index = "\n".join(f"ids-{k:04d}.tar" for k in range(SHARDS)).encode() * 40  # over LFS_FROM: an LFS file
    hub.commit(REPO, {"index.txt": index, "small.txt": b"ids-0000.tar\n"})
    store = make_store(hub)
    assert store.text(f"hf://datasets/{REPO}/small.txt", 1 << 20) == "ids-0000.tar\n"
    assert store.text(f"hf://datasets/{REPO}/index.txt", 1 << 20) == index.decode()
    assert hub.seen("cdn") and all(r["auth"] is None for r in hub.seen("cdn"))
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in hub.seen("hub", "/resolve/"))
    with pytest.raises(StoreError) as err:
        store.text(f"hf://datasets/{REPO}/index.txt", 100)
    assert err.value.reason == "too_large"
    with pytest.raises(StoreError, match="no file or folder nope.txt") as err:
        store.text(f"hf://datasets/{REPO}/nope.txt", 100)
    assert not err.value.retry


def test_a_shard_downloads_through_the_redirect_with_the_token_kept_from_the_cdn(hub, dataset, tmp_path):
    store = make_store(hub)
    for obj in store.list(f"hf://datasets/{REPO}/data/ids-"):
        path = parse_hf_url(obj.url)[2]
        assert download(store, obj.url, tmp_path / os.path.basename(path), obj.size) == len(dataset[path])
        assert open(tmp_path / os.path.basename(path), "rb").read() == dataset[path]
    assert len(hub.seen("cdn")) == SHARDS and all(r["auth"] is None for r in hub.seen("cdn"))
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in hub.seen("hub"))


# -- refusals -----------------------------------------------------------------------------------------------------


def test_a_private_dataset_without_a_token_is_denied_naming_hf_token_and_the_login(hub, dataset, no_saved_login):
    hub.repos[REPO].private = True
    with pytest.raises(StoreError) as err:
        make_store(hub, token=None).list(f"hf://datasets/{REPO}/data/")
    said = str(err.value)
    assert err.value.reason == "denied" and not err.value.retry
    assert "HF_TOKEN" in said and "huggingface-cli login" in said and f"{hub.url}/datasets/{REPO}" in said
    with pytest.raises(StoreError, match="HF_TOKEN") as err:  # the file too, through resolve
        make_store(hub, token=None).text(f"hf://datasets/{REPO}/README.md", 100)
    assert err.value.reason == "denied"
    with pytest.raises(StoreError, match="refuses the token") as err:
        make_store(hub, token="hf_wrong").list(f"hf://datasets/{REPO}/data/")
    assert err.value.reason == "denied"
    assert len(make_store(hub).list(f"hf://datasets/{REPO}/data/")) == SHARDS + 1


def test_a_gated_dataset_whose_terms_are_not_accepted_is_denied_naming_its_page(hub, dataset):
    hub.repos[REPO].gated = True
    with pytest.raises(StoreError) as err:
        make_store(hub, token=OTHER_TOKEN).list(f"hf://datasets/{REPO}/data/")
    assert err.value.reason == "denied" and "accept its terms" in str(err.value)
    assert f"{hub.url}/datasets/{REPO}" in str(err.value)


@pytest.mark.parametrize("url, says", [
    ("hf://datasets/feedline-org/nope/data/", "no dataset feedline-org/nope at"),
    (f"hf://datasets/{REPO}@no-such-branch/data/", "has no revision 'no-such-branch'"),
])
def test_a_dataset_or_revision_that_does_not_exist_is_named(hub, dataset, url, says):
    with pytest.raises(StoreError) as err:
        make_store(hub).list(url)
    assert says in str(err.value) and err.value.reason == "http_status" and not err.value.retry


def test_throttling_is_retried_later(hub, dataset):
    hub.fail("api", 429)
    with pytest.raises(StoreError, match="throttles") as err:
        make_store(hub).list(f"hf://datasets/{REPO}/data/")
    assert err.value.retry and err.value.reason == "http_status"
    hub.fail("resolve", 429)
    with pytest.raises(StoreError, match="throttles") as err:
        make_store(hub).text(f"hf://datasets/{REPO}/README.md", 100)
    assert err.value.retry


def test_an_unreachable_endpoint_is_a_connection_error_naming_hf_endpoint(hub):
    store = make_store(hub)
    store.api.endpoint = store.endpoint = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(StoreError) as err:
        store.list(f"hf://datasets/{REPO}/data/")
    assert err.value.reason == "connection" and err.value.retry and "HF_ENDPOINT" in str(err.value)
    assert time.monotonic() - t0 < 10  # no minutes of huggingface_hub's own backoff first


def test_a_stalled_hub_is_a_timeout_within_the_fetch_timeout(hub, dataset):
    hub.stall_api = 3.0
    t0 = time.monotonic()
    with pytest.raises(StoreError) as err:
        make_store(hub, timeout=1.0).list(f"hf://datasets/{REPO}/data/")
    assert err.value.reason == "timeout" and err.value.retry
    assert time.monotonic() - t0 < 3.0


# -- the sidecar, end to end ----------------------------------------------------------------------------------------


def sampler(hub, cache, source, samplers, tmp_path, **env):
    s = Sampler(None, cache, "--policy", "fill", "--budget", "64MiB", "--retry-max-seconds", "2", source=source,
                env=hub.env(HF_HOME=str(tmp_path / "hf-home"), **env))
    samplers.append(s)
    return s


def all_ids(cache):
    from feedline import StagingLoader

    seen = []
    spec = {"cls": "int64", "bin": ("uint8", (2048,))}
    with StagingLoader(cache=cache, batch_size=10, workers=1, spec=spec) as loader:
        for batch in loader:
            seen += batch["cls"].tolist()
    return sorted(seen)


def cached_bytes(cache, shard_id):
    with open(os.path.join(cache, "shards", f"{shard_id}.tar"), "rb") as f:
        return f.read()


def test_a_glob_fills_the_cache_with_whole_shards_and_the_loader_reads_every_sample_once(hub, dataset, cache,
                                                                                         samplers, tmp_path):
    s = sampler(hub, cache, f"hf://datasets/{REPO}/data/*.tar", samplers, tmp_path)
    ids = [f"ids-{k:04d}" for k in range(SHARDS)]
    assert wait_for(lambda: sorted(manifest_ids(cache)) == sorted(ids + ["valid-0000"]), 60), s.stop()
    assert s.stop() is not None and s.proc.returncode == 0
    for k in range(SHARDS):
        assert hashlib.sha256(cached_bytes(cache, f"ids-{k:04d}")).digest() == \
            hashlib.sha256(dataset[f"data/ids-{k:04d}.tar"]).digest()
    seen = all_ids(cache)
    assert sorted(set(seen)) == list(range(SHARDS * PER_SHARD))  # valid-0000 repeats ids-0001's samples
    assert len(seen) == (SHARDS + 1) * PER_SHARD
    assert hub.seen("cdn") and all(r["auth"] is None for r in hub.seen("cdn"))
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in hub.seen("hub"))


def test_a_folder_fills_the_cache_with_every_shard_in_it_and_nothing_else(hub, dataset, cache, samplers, tmp_path):
    s = sampler(hub, cache, f"hf://datasets/{REPO}/data/", samplers, tmp_path)
    assert wait_for(lambda: len(manifest_ids(cache)) == SHARDS + 1, 60), s.stop()
    out = s.stop()
    assert sorted(manifest_ids(cache)) == sorted([f"ids-{k:04d}" for k in range(SHARDS)] + ["valid-0000"])
    assert cached_bytes(cache, "valid-0000") == dataset["data/valid-0000.tar"]
    assert "HTTP Request" not in out and TOKEN not in out


def test_a_branch_is_pinned_to_one_commit_for_the_whole_run(hub, dataset, cache, samplers, tmp_path):
    dev = hub.commit(REPO, dict(dataset), ref="dev")  # a branch of its own, at another commit than main's
    s = sampler(hub, cache, f"hf://datasets/{REPO}@dev/data/ids-*.tar", samplers, tmp_path)
    assert wait_for(lambda: len(manifest_ids(cache)) == SHARDS, 60), s.stop()
    s.stop()
    downloads = hub.seen("hub", "/resolve/")
    assert downloads and all(f"/resolve/{dev}/" in r["path"] for r in downloads)
    assert all_ids(cache) == list(range(SHARDS * PER_SHARD))


def test_a_listing_of_many_pages_reaches_every_shard(tmp_path, shard_files, cache, samplers):
    with FakeHub(page_size=3) as hub:
        hub.dataset(REPO, {**shard_files, "README.md": b"x"})
        s = sampler(hub, cache, f"hf://datasets/{REPO}/**/*.tar", samplers, tmp_path)
        assert wait_for(lambda: len(manifest_ids(cache)) == SHARDS, 60), s.stop()
        s.stop()
        assert len(hub.seen("hub", "/tree/")) >= 3
    assert all_ids(cache) == list(range(SHARDS * PER_SHARD))


def test_a_private_dataset_without_a_token_is_refused_at_start_up_naming_the_fix(hub, dataset, cache, tmp_path):
    hub.repos[REPO].private = True
    env = {**os.environ, **hub.env(HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN="")}
    out = subprocess.run([sys.executable, "-m", "feedline", "sample", "--source", f"hf://datasets/{REPO}/data/*.tar",
                          "--cache", cache, "--metrics-port", "0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "HF_TOKEN" in out.stderr and "huggingface-cli login" in out.stderr and REPO in out.stderr
    assert not hub.seen("cdn")
