"""The cache directory: sources, plans, publish, eviction, recovery, fetching over real HTTP."""

import errno
import hashlib
import json
import os
import shutil
import threading

import pytest
from helpers import publish_copy, shard_bytes

from feedline.cache.manifest import LOG, MANIFEST, read_manifest, shard_path
from feedline.cache.store import BudgetError, CacheStore
from feedline.demo.store import Fault
from feedline.formats.shard_index import ShardError
from feedline.formats.urls import expand
from feedline.sampler.fetch import Fetcher, FetchError, RateLimiter
from feedline.sampler.policy import FillPolicy, GrowPolicy, shard_plan
from feedline.sampler.sources import SourceError, SourceShard, list_shards

# -- sources and plans ----------------------------------------------------------------------------

def test_brace_expansion_gives_zero_padded_ranges_and_lists():
    assert expand("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand("{a,b}/x-{8..10}.tar") == ["a/x-8.tar", "a/x-9.tar", "a/x-10.tar",
                                              "b/x-8.tar", "b/x-9.tar", "b/x-10.tar"]


def test_brace_expansion_handles_nested_stepped_descending_and_padded_ranges():
    assert expand("s-{a,{b,c}}.tar") == ["s-a.tar", "s-b.tar", "s-c.tar"]
    assert expand("{0..6..2}") == ["0", "2", "4", "6"]
    assert expand("{3..1}") == ["3", "2", "1"]
    assert expand("{1..03}") == ["01", "02", "03"]


def test_lists_join_with_double_colons_and_file_urls_are_paths():
    assert expand("file:///d/a-{0..1}.tar::/e/b.tar") == ["/d/a-0.tar", "/d/a-1.tar", "/e/b.tar"]


def test_compressed_and_presigned_urls_are_shards_not_index_files():
    shards = list_shards("http://store/d/s-{0..1}.tar.gz::https://bucket/x.tar?X-Amz-Signature=abc&t=1")
    assert [(s.id, s.compression) for s in shards] == [("s-0", "gzip"), ("s-1", "gzip"), ("x", None)]
    assert shards[2].url.endswith("?X-Amz-Signature=abc&t=1")


def test_a_url_that_is_neither_a_shard_nor_an_index_is_refused_with_the_rules():
    with pytest.raises(SourceError, match="index file"):
        list_shards("http://store/d/data.bin")


def test_http_url_patterns_become_shards_with_ids():
    shards = list_shards("http://store/data/train-{0000..0002}.tar")
    assert [s.id for s in shards] == ["train-0000", "train-0001", "train-0002"]
    assert shards[1].url == "http://store/data/train-0001.tar"


def test_an_index_file_gives_urls_checksums_and_sizes(tmp_path):
    idx = tmp_path / "index.txt"
    sha = "a" * 64
    idx.write_text(f"# shards\nhttp://h/x.tar {sha} 1024\nsub/y.tar\n")
    shards = list_shards(str(idx))
    assert shards[0] == SourceShard("http://h/x.tar", "x", sha, 1024)
    assert shards[1].url == str(tmp_path / "sub" / "y.tar")


def test_a_pipe_source_is_a_shard_per_command_and_other_schemes_are_refused_naming_those_supported():
    assert [(s.url, s.id) for s in list_shards("pipe:curl -sf http://x/a-{0..1}.tar")] == [
        ("pipe:curl -sf http://x/a-0.tar", "a-0"), ("pipe:curl -sf http://x/a-1.tar", "a-1")]  # issue 51
    with pytest.raises(SourceError, match="supported are http.*pipe:COMMAND"):
        list_shards("ftp://x/a.tar")


def test_the_same_seed_gives_the_same_plan_without_replacement(data):
    shards = list_shards(str(data))
    first = [next(p) for p in [shard_plan(shards, 3)] for _ in range(8)]
    again = [s for s, _ in zip(shard_plan(shards, 3), range(8))]
    other = [s for s, _ in zip(shard_plan(shards, 4), range(8))]
    assert first == again
    assert first != other
    assert len({s.id for s in first}) == 8  # one round: each shard once


def test_grow_policy_adds_per_epoch_then_replaces_a_fraction():
    p = GrowPolicy(initial_shards=4, grow_shards=2, replace_fraction=0.25)
    assert p.initial(cached=1) == 3
    assert p.on_epoch(1, cached=4, full=False) == 2
    assert p.on_epoch(2, cached=8, full=True) == 2


def test_fill_policy_fills_then_refreshes_at_its_rate():
    p = FillPolicy(fetch_threads=3, refresh_per_minute=60)
    assert p.keep_busy(full=False, now=0.0, busy=1) == 2
    assert p.keep_busy(full=True, now=10.0, busy=0) == 0
    assert p.keep_busy(full=True, now=10.5, busy=0) == 0
    assert p.keep_busy(full=True, now=11.0, busy=0) == 1


# -- the store --------------------------------------------------------------------------------------

def test_publish_places_shard_and_index_and_bumps_the_generation(tmp_path, data):
    store = CacheStore(str(tmp_path / "cache"), budget_bytes=10 * shard_bytes(data))
    store.recover()
    gen = store.generation
    entry = publish_copy(store, data, 0)
    path = shard_path(store.root, entry.id)
    assert os.path.exists(path) and os.path.exists(path[:-4] + ".idx")
    m = read_manifest(store.root)
    assert m.generation == gen + 1 and [s.id for s in m.shards] == ["ids-0000"] and m.shards[0].samples == 20
    assert os.listdir(store.partial_dir) == []


def _publish_as(store, data, shard_id):
    """Shard 0 of the remote dataset published under another id (as many shards as a test wants)."""
    partial = store.partial_path(shard_id)
    shutil.copyfile(data / "ids-0000.tar", partial)
    return store.publish(shard_id, partial)


def test_a_publish_appends_one_line_to_the_log_and_leaves_manifest_json_alone(tmp_path, data):
    store = CacheStore(str(tmp_path / "cache"), budget_bytes=1 << 30)
    store.recover()
    before = os.stat(os.path.join(store.root, MANIFEST)).st_ino
    gen = store.generation
    for k in range(10):
        _publish_as(store, data, f"p-{k:02d}")
    assert os.stat(os.path.join(store.root, MANIFEST)).st_ino == before  # not rewritten: O(1) a publish
    with open(os.path.join(store.root, LOG)) as f:
        assert len(f.read().splitlines()) == 1 + 10  # its header, a line a publish
    m = read_manifest(store.root)
    assert m.generation == gen + 10 and [s.id for s in m.shards] == [f"p-{k:02d}" for k in range(10)]


def test_a_torn_last_line_of_the_log_is_not_read_and_the_generation_before_it_is(tmp_path, data):
    store = CacheStore(str(tmp_path / "cache"), budget_bytes=1 << 30)
    store.recover()
    for k in range(3):
        _publish_as(store, data, f"p-{k}")
    with open(os.path.join(store.root, LOG), "a") as f:
        f.write('{"g": ' + str(store.generation + 1) + ', "add": [{"id": "p-3", "by')  # a writer died mid-line
    m = read_manifest(store.root)
    assert m.generation == store.generation and [s.id for s in m.shards] == ["p-0", "p-1", "p-2"]
    store.recover()  # the next writer folds it all into manifest.json: the torn line is gone
    assert [s.id for s in read_manifest(store.root).shards] == ["p-0", "p-1", "p-2"]


def test_the_log_is_folded_into_manifest_json_once_it_is_as_long_as_the_cache_and_readers_never_see_a_gap(
        tmp_path, data):
    """A reader polling while 200 shards are published (with evictions past 150) sees whole generations only:
    generations that never go back, each with the shards published up to it, the oldest gone first."""
    store = CacheStore(str(tmp_path / "cache"), budget_bytes=150 * shard_bytes(data))
    store.recover()
    g0 = store.generation
    seen, done = [], threading.Event()

    def reader():
        while not done.is_set():
            m = read_manifest(store.root)
            seen.append((m.generation, [s.id for s in m.shards]))

    t = threading.Thread(target=reader)
    t.start()
    try:
        folds = set()
        for k in range(200):
            _publish_as(store, data, f"f-{k:03d}")
            folds.add(os.stat(os.path.join(store.root, MANIFEST)).st_ino)
    finally:
        done.set()
        t.join()
    assert len(folds) >= 3  # folded (at 64 and 128 shards, then in the steady state): a new manifest.json
    with open(os.path.join(store.root, LOG)) as f:
        assert len(f.read().splitlines()) <= 1 + 150
    gens = [g for g, _ in seen]
    assert gens == sorted(gens) and len(seen) > 10
    newest = -1
    for g, ids in seen:  # a run of consecutive shards, the oldest evicted first, at most the budget's 150
        ks = [int(i[2:]) for i in ids]
        assert ks == list(range(ks[0], ks[0] + len(ks))) if ks else True
        assert len(ks) <= 150 and (not ks or ks[-1] >= newest)
        assert not ks or g - g0 >= ks[-1] + 1  # a generation a publish at least
        newest = ks[-1] if ks else newest
    final = read_manifest(store.root)
    assert [s.id for s in final.shards] == [f"f-{k:03d}" for k in range(50, 200)]


def _failing_log_writes(monkeypatch, half=True):
    """os.write to manifest.log writes half its line (or nothing), then fails as a full disk does."""
    real = os.write

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("manifest.log"):
            if half:
                real(fd, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_a_line_the_log_could_not_take_whole_is_taken_back_and_the_change_folded_instead(tmp_path, data,
                                                                                       monkeypatch):
    store = CacheStore(str(tmp_path / "cache"), budget_bytes=1 << 30)
    store.recover()
    _publish_as(store, data, "a")
    _failing_log_writes(monkeypatch)
    _publish_as(store, data, "b")  # its line torn: taken back, and the manifest folded with it
    monkeypatch.undo()
    _publish_as(store, data, "c")
    m = read_manifest(store.root)
    assert [s.id for s in m.shards] == ["a", "b", "c"] and m.generation == store.generation
    with open(os.path.join(store.root, LOG), "rb") as f:
        assert f.read().count(b"\n") == 2  # the fold's header and c's line: no torn bytes between


def test_a_change_that_cannot_be_written_at_all_changes_nothing_and_a_retry_publishes_it(tmp_path, data,
                                                                                       monkeypatch):
    from feedline.cache import manifest

    store = CacheStore(str(tmp_path / "cache"), budget_bytes=1 << 30)
    store.recover()
    _publish_as(store, data, "a")
    gen = store.generation
    _failing_log_writes(monkeypatch)
    monkeypatch.setattr(manifest, "atomic_write", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError):
        _publish_as(store, data, "b")
    assert store.generation == gen and [e.id for e in store.entries] == ["a"]
    monkeypatch.undo()
    assert read_manifest(store.root).generation == gen  # what readers see: the generation before, whole
    _publish_as(store, data, "b")  # the sidecar tries again: published, not taken for already there
    m = read_manifest(store.root)
    assert [s.id for s in m.shards] == ["a", "b"] and m.generation == gen + 1


def test_budget_is_kept_by_evicting_the_oldest_first(tmp_path, data):
    store = CacheStore(str(tmp_path / "cache"), budget_bytes=3 * shard_bytes(data) + 100)
    store.recover()
    for k in range(6):
        publish_copy(store, data, k)
        assert store.total_bytes <= store.budget_bytes
        on_disk = sum(os.path.getsize(p) for p in (tmp_path / "cache" / "shards").glob("*.tar"))
        assert on_disk <= store.budget_bytes
    assert [e.id for e in store.entries] == ["ids-0003", "ids-0004", "ids-0005"]


def test_a_shard_larger_than_the_budget_is_refused(tmp_path, data):
    store = CacheStore(str(tmp_path / "cache"), budget_bytes=shard_bytes(data) // 2)
    with pytest.raises(BudgetError, match="budget"):
        publish_copy(store, data, 0)


def test_a_non_tar_download_is_never_published(tmp_path):
    store = CacheStore(str(tmp_path / "cache"), budget_bytes=1 << 20)
    partial = store.partial_path("junk")
    with open(partial, "wb") as f:
        f.write(os.urandom(4096))
    with pytest.raises(ShardError):
        store.publish("junk", partial)
    assert store.entries == []


def test_recovery_removes_partials_and_invalid_shards_and_adopts_valid_ones(tmp_path, data):
    root = tmp_path / "cache"
    store = CacheStore(str(root), budget_bytes=10 * shard_bytes(data))
    store.recover()
    publish_copy(store, data, 0)
    (root / "shards" / ".partial" / "ids-0001.tar.123").write_bytes(b"half a shard")
    (root / "shards" / "ids-0002.tar").write_bytes((data / "ids-0002.tar").read_bytes())  # complete, unlisted
    (root / "shards" / "torn.tar").write_bytes((data / "ids-0003.tar").read_bytes()[:5000])  # torn, unlisted
    r = CacheStore(str(root), budget_bytes=10 * shard_bytes(data)).recover()
    assert (r.partial_removed, r.adopted, r.removed_invalid) == (1, 1, 1)
    ids = [s.id for s in read_manifest(str(root)).shards]
    assert sorted(ids) == ["ids-0000", "ids-0002"]
    assert not (root / "shards" / "torn.tar").exists()


def test_a_corrupt_manifest_is_rebuilt_from_the_shard_files(tmp_path, data):
    root = tmp_path / "cache"
    store = CacheStore(str(root), budget_bytes=10 * shard_bytes(data))
    store.recover()
    publish_copy(store, data, 0)
    publish_copy(store, data, 1)
    (root / "manifest.json").write_text('{"generation": 4, "shards": [')
    r = CacheStore(str(root), budget_bytes=10 * shard_bytes(data)).recover()
    assert r.manifest_rebuilt
    assert sorted(s.id for s in read_manifest(str(root)).shards) == ["ids-0000", "ids-0001"]


def test_recovery_evicts_to_a_smaller_budget(tmp_path, data):
    root = tmp_path / "cache"
    store = CacheStore(str(root), budget_bytes=10 * shard_bytes(data))
    store.recover()
    for k in range(4):
        publish_copy(store, data, k)
    r = CacheStore(str(root), budget_bytes=2 * shard_bytes(data) + 10).recover()
    assert r.evicted_over_budget == 2
    assert [s.id for s in read_manifest(str(root)).shards] == ["ids-0002", "ids-0003"]


# -- fetching over real HTTP ---------------------------------------------------------------------------

def _fetch(remote, tmp_path, name="ids-0000", retries=2, timeout=5.0, sha="", size=None):
    fetcher = Fetcher(timeout, retries, threading.Event(), RateLimiter(0), backoff=0.01)
    dest = str(tmp_path / f"{name}.part")
    shard = SourceShard(f"{remote.url}/{name}.tar", name, sha, size)
    try:
        return fetcher.fetch(shard, dest, 1 << 30), dest
    finally:
        fetcher.close_thread()


def test_a_fetch_streams_the_whole_shard(remote, data, tmp_path):
    result, dest = _fetch(remote, tmp_path)
    assert result.bytes == shard_bytes(data)
    assert open(dest, "rb").read() == (data / "ids-0000.tar").read_bytes()


def test_http_404_is_not_retried(remote, tmp_path):
    with pytest.raises(FetchError) as err:
        _fetch(remote, tmp_path, name="missing")
    assert err.value.reason == "http_status" and remote.requests["missing.tar"] == 1
    assert list(tmp_path.glob("*.part")) == []


def test_http_500_is_retried_with_backoff(remote, tmp_path):
    remote.faults["ids-0000.tar"] = Fault(status=500, times=2)
    result, _ = _fetch(remote, tmp_path, retries=2)
    assert result.attempts == 3


def test_a_connection_reset_mid_shard_is_retried(remote, tmp_path):
    remote.faults["ids-0000.tar"] = Fault(reset_after=10000, times=1)
    result, _ = _fetch(remote, tmp_path)
    assert result.attempts == 2


def test_a_stalled_server_times_out(remote, tmp_path):
    remote.faults["ids-0000.tar"] = Fault(stall_after=1000, stall_seconds=3, times=5)
    with pytest.raises(FetchError) as err:
        _fetch(remote, tmp_path, retries=0, timeout=0.5)
    assert err.value.reason == "timeout"


def test_a_truncated_body_is_detected(remote, tmp_path):
    remote.faults["ids-0000.tar"] = Fault(truncate_to=5000, times=5)
    with pytest.raises(FetchError) as err:
        _fetch(remote, tmp_path, retries=1)
    assert err.value.reason == "truncated"


def test_a_checksum_mismatch_is_detected(remote, data, tmp_path):
    with pytest.raises(FetchError) as err:
        _fetch(remote, tmp_path, sha="0" * 64, retries=0)
    assert err.value.reason == "checksum"
    good = hashlib.sha256((data / "ids-0000.tar").read_bytes()).hexdigest()
    assert _fetch(remote, tmp_path, sha=good)[0].bytes == shard_bytes(data)


def test_the_bandwidth_cap_slows_fetching(remote, data, tmp_path):
    import time

    fetcher = Fetcher(5.0, 0, threading.Event(), RateLimiter(shard_bytes(data) * 2), backoff=0.01)
    t0 = time.monotonic()
    for k in range(4):
        fetcher.fetch(SourceShard(f"{remote.url}/ids-000{k}.tar", f"s{k}"), str(tmp_path / f"s{k}"), 1 << 30)
    fetcher.close_thread()
    assert time.monotonic() - t0 >= 1.0  # 4 shards at 2 shards/s, the first second's tokens spent first
    assert json.dumps(remote.requests)


def test_recovery_sweeps_the_temporary_files_a_killed_writer_left(tmp_path, data):
    root = tmp_path / "cache"
    store = CacheStore(str(root), budget_bytes=10 * shard_bytes(data))
    store.recover()
    publish_copy(store, data, 0)
    left = ["manifest.json.tmp.99", "shards/ids-0000.idx.tmp.99", "readers/0.json.tmp.99"]
    for name in left:
        (root / name).write_text("half")
    r = CacheStore(str(root), budget_bytes=10 * shard_bytes(data)).recover()
    assert r.temporaries_removed == 3
    assert not any((root / name).exists() for name in left)
    assert [s.id for s in read_manifest(str(root)).shards] == ["ids-0000"]
