"""The sampler sidecar as a real process, a real HTTP store, and the loader reading its cache."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import (
    N_SHARDS,
    ROOT,
    Sampler,
    manifest_ids,
    publish_copy,
    shard_bytes,
    wait_for,
)

from feedline import StagingLoader
from feedline.cache.manifest import read_manifest, shard_path
from feedline.cache.readers import leased_ids
from feedline.cache.store import CacheStore
from feedline.demo.procs import free_port
from feedline.demo.store import Fault, FileStore
from feedline.formats.shard_index import build_index

SPEC = {"cls": "int64", "bin": ("uint8", (2048,))}


# -- growth and replacement -------------------------------------------------------------------------

def test_the_cache_grows_at_each_new_loader_epoch(remote, cache, samplers, data):
    s = Sampler(remote, cache, "--policy", "grow", "--initial-shards", "2", "--grow-shards", "2",
                "--budget", str(20 * shard_bytes(data)), "--min-shards", "2")
    samplers.append(s)
    s.wait_ready()
    seen = []
    with StagingLoader(cache=cache, batch_size=8, workers=1, spec=SPEC, min_shards=2) as loader:
        for epoch in range(3):
            n = sum(len(b["cls"]) for b in loader)
            seen.append(len(loader.epoch_shards))
            assert n == 20 * len(loader.epoch_shards)
            assert wait_for(lambda: len(manifest_ids(cache)) == 2 + 2 * (epoch + 1))
    assert seen == [2, 4, 6]
    assert s.stop() is not None and s.proc.returncode == 0


def test_once_full_the_oldest_fraction_is_replaced_each_epoch(remote, cache, samplers, data):
    s = Sampler(remote, cache, "--policy", "grow", "--initial-shards", "4", "--grow-shards", "2",
                "--replace-fraction", "0.5", "--budget", str(4 * shard_bytes(data) + 100), "--min-shards", "4")
    samplers.append(s)
    s.wait_ready()
    before = manifest_ids(cache)
    with StagingLoader(cache=cache, batch_size=8, workers=1, spec=SPEC, min_shards=4) as loader:
        sum(len(b["cls"]) for b in loader)
        assert wait_for(lambda: len(set(manifest_ids(cache)) - set(before)) == 2)
    after = manifest_ids(cache)
    assert len(after) == 4
    assert after[:2] == before[2:]  # the two oldest went, the newer two stayed, in age order


# -- the invariants, under load ---------------------------------------------------------------------------

def test_budget_is_never_exceeded_and_the_loader_never_reads_a_torn_shard(remote, cache, samplers, data):
    budget = 3 * shard_bytes(data) + 100
    s = Sampler(remote, cache, "--policy", "fill", "--refresh-per-minute", "1200", "--budget", str(budget),
                "--min-shards", "3", "--fetch-threads", "2")
    samplers.append(s)
    s.wait_ready()
    worst = {"manifest": 0, "disk": 0, "kept": 0}
    stop = threading.Event()

    def watch():
        shards_dir = os.path.join(cache, "shards")
        while not stop.is_set():
            try:
                worst["manifest"] = max(worst["manifest"], read_manifest(cache).total_bytes)
            except (FileNotFoundError, ValueError):
                pass
            try:  # evicted shards kept for the reader's epoch are not in the budget: counted apart
                kept = {f"{i}.tar" for i in read_manifest(cache).retained}
            except (FileNotFoundError, ValueError):
                continue
            disk = {True: 0, False: 0}
            names = os.listdir(shards_dir)
            try:  # kept at either read: one evicted (and kept) while the folder was listed is no budget breach
                kept |= {f"{i}.tar" for i in read_manifest(cache).retained}
            except (FileNotFoundError, ValueError):
                continue
            for name in names:
                if name.endswith(".tar"):
                    try:
                        disk[name in kept] += os.path.getsize(os.path.join(shards_dir, name))
                    except FileNotFoundError:
                        pass
            worst["disk"] = max(worst["disk"], disk[False])
            worst["kept"] = max(worst["kept"], disk[True])
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with StagingLoader(cache=cache, batch_size=5, workers=2, spec=SPEC, min_shards=3,
                           max_sample_errors=1000) as loader:
            epochs_shards = set()
            for _ in range(12):
                for batch in loader:
                    expected = (batch["cls"] % 251).to(torch.uint8)
                    assert torch.equal(batch["bin"][:, 0], expected)
                    assert torch.equal(batch["bin"][:, -1], expected)
                epochs_shards.update(loader.epoch_shards)
                time.sleep(0.05)
            errors = loader.stats().sample_errors_total
    finally:
        stop.set()
        watcher.join()
    assert worst["manifest"] <= budget and worst["disk"] <= budget
    assert worst["kept"] <= 2 * budget  # the epoch's shards (at most the budget), and for a moment the last epoch's
    assert {k: v for k, v in errors.items() if v and k != "evicted"} == {}
    assert len(epochs_shards) > 3  # the cache really turned over while training


def published(cache, data, count, lease=0.0):
    """A cache holding the first ``count`` shards, published as the sampler does (``lease``: its
    ``reader_lease``, 0 for none)."""
    store = CacheStore(cache, budget_bytes=10 * shard_bytes(data),
                       leased=(lambda: leased_ids(cache, lease)) if lease else None)
    store.recover()
    for k in range(count):
        publish_copy(store, data, k)
    return store


def test_a_shard_evicted_before_it_was_opened_is_skipped_and_counted_never_a_crash(cache, data):
    published(cache, data, 3)
    # no bad sample allowed, yet an eviction is no bad sample: it is counted, outside the failure budget
    with StagingLoader(cache=cache, batch_size=8, workers=1, spec=SPEC, max_sample_errors=0.0) as loader:
        os.unlink(shard_path(cache, "ids-0001"))  # still listed in the manifest, gone before a worker opens it
        n = sum(len(b["cls"]) for b in loader)
        assert n == 40
        assert loader.stats().sample_errors_total["evicted"] == 1


def test_a_shard_evicted_after_the_epoch_started_still_reads_whole(cache, data):
    store = published(cache, data, 3)
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC, shuffle_buffer=0) as loader:
        it = iter(loader)
        first = next(it)
        store.evict_oldest(3)  # every shard of the epoch goes while the epoch runs
        assert manifest_ids(cache) == [] and not os.listdir(os.path.join(cache, "shards", ".partial"))
        ids = first["cls"].tolist() + [i for b in it for i in b["cls"].tolist()]
        stats = loader.stats()
    assert sorted(ids) == list(range(60))
    assert stats.sample_errors_total["evicted"] == 0


def test_a_state_taken_after_the_epochs_shards_were_evicted_resumes_the_rest_of_the_epoch(cache, data):
    store = published(cache, data, 3)
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC, shuffle_buffer=0) as loader:
        it = iter(loader)
        ids = [i for _ in range(5) for i in next(it)["cls"].tolist()]
        store.evict_oldest(2)  # read from the mapped files still; a state must count them as the epoch planned
        state = loader.state_dict()
    assert not state["finished"]
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC, shuffle_buffer=0) as again:
        again.load_state_dict(state)
        assert again.next_epoch == 0
        rest = [i for b in again for i in b["cls"].tolist()]
    assert len(ids) == 20 and len(set(ids + rest)) == len(ids + rest)
    assert set(range(40, 60)) <= set(ids + rest)  # the shard still cached is read to its end


def test_a_worker_killed_after_shards_of_its_epoch_were_evicted_is_replaced_with_no_sample_lost_or_repeated(
        cache, data):
    store = published(cache, data, 3)
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC, shuffle_buffer=16) as loader:
        it = iter(loader)
        ids = [i for _ in range(3) for i in next(it)["cls"].tolist()]
        store.evict_oldest(1)  # the worker has it open and reads it whole; a replacement cannot open it
        os.kill(loader._pipeline.pool.worker_pids()[0], signal.SIGKILL)
        ids += [i for b in it for i in b["cls"].tolist()]
    assert sorted(ids) == list(range(60))


def test_a_trainer_resumed_after_the_sidecar_evicted_its_epochs_shards_trains_every_sample_once(cache, data):
    store = published(cache, data, 3, lease=600)
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC, shuffle_buffer=16) as loader:
        it = iter(loader)
        ids = [i for _ in range(3) for i in next(it)["cls"].tolist()]
        state = loader.state_dict()
    store.evict_oldest(3)  # while the trainer is down, every shard of its epoch leaves the manifest
    publish_copy(store, data, 3)
    assert manifest_ids(cache) == ["ids-0003"] and store.retained_bytes == 3 * shard_bytes(data)
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC, shuffle_buffer=16) as loader:
        loader.load_state_dict(state)
        ids += [i for b in loader for i in b["cls"].tolist()]
        assert sorted(ids) == list(range(60))  # the resumed epoch: exactly once, nothing lost
        assert store.release() == [] and len(os.listdir(os.path.join(cache, "shards"))) >= 6
        next(iter(loader))  # the next epoch reads only ids-0003: what the last one kept goes
        assert sorted(store.release()) == ["ids-0000", "ids-0001", "ids-0002"]
    assert store.retained_bytes == 0 and read_manifest(cache).retained == []
    assert sorted(os.listdir(os.path.join(cache, "shards"))) == [".partial", "ids-0003.idx", "ids-0003.tar"]


def test_a_resumed_epoch_leases_its_shards_however_the_checkpoint_spelled_the_cache_path(cache, data, tmp_path):
    link = tmp_path / "link"
    os.symlink(cache, link)
    store = published(cache, data, 3, lease=600)
    with StagingLoader(cache=str(link), batch_size=4, workers=1, spec=SPEC) as loader:
        next(iter(loader))
        state = loader.state_dict()  # its plan names link/shards/...
    store.evict_oldest(3)
    publish_copy(store, data, 3)
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC) as loader:
        loader.load_state_dict(state)
        next(iter(loader))
        assert leased_ids(cache, 600) == {"ids-0000", "ids-0001", "ids-0002"}
        assert store.release() == []


def test_a_loader_renews_its_lease_as_batches_go_out(cache, data, monkeypatch):
    import feedline.cache.source as source

    monkeypatch.setattr(source, "TOUCH_EVERY", 0.0)
    published(cache, data, 2, lease=600)
    reader = os.path.join(cache, "readers", "0.json")
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC) as loader:
        it = iter(loader)
        next(it)
        old = time.time() - 601
        os.utime(reader, (old, old))
        assert leased_ids(cache, 600) == set()
        next(it)
        assert leased_ids(cache, 600) == {"ids-0000", "ids-0001"}


def test_an_evicted_shard_kept_for_a_reader_is_removed_once_its_lease_goes_stale(cache, data):
    store = published(cache, data, 2, lease=600)
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC) as loader:
        next(iter(loader))
    store.evict_oldest(2)
    assert store.release() == [] and os.path.exists(shard_path(cache, "ids-0000"))
    old = time.time() - 601  # the trainer never came back: its last sign of life is past the lease
    os.utime(os.path.join(cache, "readers", "0.json"), (old, old))
    assert sorted(store.release()) == ["ids-0000", "ids-0001"]
    assert not os.path.exists(shard_path(cache, "ids-0000")) and read_manifest(cache).retained == []


def test_a_restarted_sidecar_keeps_what_a_reader_still_needs_and_adopts_none_of_it(cache, data):
    store = published(cache, data, 2, lease=600)
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC) as loader:
        next(iter(loader))
    store.evict_oldest(1)
    again = CacheStore(cache, budget_bytes=10 * shard_bytes(data), leased=lambda: leased_ids(cache, 600))
    again.recover()
    assert again.ids() == {"ids-0001"} and read_manifest(cache).retained == ["ids-0000"]
    assert os.path.exists(shard_path(cache, "ids-0000"))


def test_the_loader_waits_for_min_shards_and_then_says_why_it_gave_up(cache):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="min_shards=2"):
        StagingLoader(cache=cache, spec=SPEC, min_shards=2, wait_timeout=0.5)
    assert time.monotonic() - t0 >= 0.5


def test_a_loader_waiting_for_more_shards_than_the_source_has_starts_once_the_whole_source_is_cached(
        remote, cache, samplers, data):
    source = f"{remote.url}/ids-{{0000..0001}}.tar"  # two shards; the loader (and compose) asks for four
    s = Sampler(remote, cache, "--min-shards", "4", "--initial-shards", "4", "--budget", str(20 * shard_bytes(data)),
                source=source)
    samplers.append(s)
    s.wait_ready()  # ready too: the whole source is there
    assert "whole source" in s.get("/readyz")[1]
    assert read_manifest(cache).complete
    t0 = time.monotonic()
    with StagingLoader(cache=cache, batch_size=8, workers=1, spec=SPEC, min_shards=4, wait_timeout=30) as loader:
        n = sum(len(b["cls"]) for b in loader)
    assert time.monotonic() - t0 < 15 and n == 40


def test_a_manifest_says_complete_only_while_every_source_shard_is_published(tmp_path, data):
    ids = sorted(p[: -len(".tar")] for p in os.listdir(data) if p.endswith(".tar"))[:2]
    store = CacheStore(str(tmp_path / "cache"), budget_bytes=10 * shard_bytes(data), source_ids=frozenset(ids))
    publish_copy(store, data, 0)
    assert not read_manifest(store.root).complete
    publish_copy(store, data, 1)
    assert read_manifest(store.root).complete and store.complete
    store.evict_oldest(1)
    assert not read_manifest(store.root).complete


def test_the_loader_reports_its_epoch_for_the_sampler(remote, cache, samplers, data):
    s = Sampler(remote, cache, "--initial-shards", "2", "--budget", str(20 * shard_bytes(data)))
    samplers.append(s)
    s.wait_ready()
    with StagingLoader(cache=cache, batch_size=8, workers=1, spec=SPEC) as loader:
        for _ in range(2):
            for _ in loader:
                pass
        state = json.loads(open(os.path.join(cache, "readers", "0.json")).read())
    assert state["epoch"] == 1 and state["rank"] == 0 and state["generation"] >= 1
    assert os.listdir(os.path.join(cache, "readers")) == []  # read to its end and closed: the lease ended


# -- crashes and stops ---------------------------------------------------------------------------------

def test_sigkill_mid_download_leaves_a_cache_the_next_start_recovers(remote, cache, samplers, data):
    s = Sampler(remote, cache, "--policy", "fill", "--max-mbps", str(shard_bytes(data) / 4e6),
                "--budget", str(5 * shard_bytes(data)), "--fetch-threads", "2")
    samplers.append(s)
    partial_dir = os.path.join(cache, "shards", ".partial")
    assert wait_for(lambda: os.path.isdir(partial_dir) and os.listdir(partial_dir))
    s.proc.kill()
    s.proc.communicate()
    assert os.listdir(partial_dir)  # killed mid-download
    again = Sampler(remote, cache, "--policy", "fill", "--budget", str(5 * shard_bytes(data)), "--min-shards", "4")
    samplers.append(again)
    again.wait_ready()
    assert again.stop() is not None and again.proc.returncode == 0
    assert os.listdir(partial_dir) == []
    m = read_manifest(cache)
    assert m.total_bytes <= 5 * shard_bytes(data)
    for entry in m.shards:
        assert len(build_index(shard_path(cache, entry.id)).samples) == entry.samples == 20


def test_sigterm_discards_the_download_in_flight_and_exits_within_seconds(remote, cache, samplers, data):
    s = Sampler(remote, cache, "--policy", "fill", "--max-mbps", str(shard_bytes(data) / 10e6),
                "--budget", str(5 * shard_bytes(data)))
    samplers.append(s)
    partial_dir = os.path.join(cache, "shards", ".partial")
    assert wait_for(lambda: os.path.isdir(partial_dir) and os.listdir(partial_dir))
    t0 = time.monotonic()
    s.stop(signal.SIGTERM)
    assert time.monotonic() - t0 < 5
    assert s.proc.returncode == 0
    assert os.listdir(partial_dir) == []


# -- bad input -----------------------------------------------------------------------------------------

def test_fetch_errors_are_counted_and_good_shards_still_arrive(remote, cache, samplers, data):
    remote.faults["ids-0001.tar"] = Fault(status=404)
    remote.faults["ids-0002.tar"] = Fault(reset_after=3000)
    (data / "ids-0003.tar").write_bytes(os.urandom(shard_bytes(data)))  # not a tar
    s = Sampler(remote, cache, "--policy", "fill", "--budget", str(20 * shard_bytes(data)), "--min-shards", "7")
    samplers.append(s)
    s.wait_ready()

    def errors():
        _, metrics = s.get("/metrics")
        return {line.split("reason=\"")[1].split("\"")[0]: float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines() if line.startswith("feedline_fetch_errors_total{")}

    assert wait_for(lambda: errors().get("connection", 0) + errors().get("truncated", 0) >= 2)
    counts = errors()
    assert counts["http_status"] == 1  # a 404 is not retried
    assert counts["connection"] + counts["truncated"] == 2  # a reset mid-body: tried, retried once, skipped
    assert counts["not_tar"] == 1
    assert sorted(manifest_ids(cache)) == [f"ids-{k:04d}" for k in range(N_SHARDS) if k not in (1, 2, 3)]


@pytest.mark.parametrize("args, words", [
    (["--budget", "1000"], ["budget", "smaller than a shard"]),
    (["--budget", "100TiB"], ["budget", "shm_size", "sizeLimit"]),
])
def test_start_up_refuses_a_budget_that_cannot_work(remote, cache, samplers, args, words):
    s = Sampler(remote, cache, *args)
    samplers.append(s)
    out = s.exit_output()
    assert s.proc.returncode == 2
    for w in words:
        assert w in out


def test_start_up_refuses_an_unreachable_source(cache):
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "feedline", "sample", "--source",
                          f"http://127.0.0.1:{port}/s-{{0..3}}.tar", "--cache", cache, "--metrics-port", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "unreachable" in out.stderr and "--source" in out.stderr


def test_a_metrics_port_in_use_is_refused_naming_port_and_setting(remote, cache, samplers):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = Sampler(remote, cache, port=port)
        samplers.append(s)
        out = s.exit_output()
    assert s.proc.returncode == 2
    assert str(port) in out and "--metrics-port" in out


def test_health_and_readiness_endpoints(remote, cache, samplers, data):
    s = Sampler(remote, cache, "--initial-shards", "3", "--min-shards", "3", "--budget", str(20 * shard_bytes(data)))
    samplers.append(s)
    assert wait_for(lambda: s.get("/healthz")[0] == 200)
    s.wait_ready()
    status, body = s.get("/readyz")
    assert status == 200 and "3 shards" in body


# -- a library part on its own ---------------------------------------------------------------------------

def test_the_sidecar_runs_from_its_settings_alone_and_pushes_stats_to_its_sink(remote, cache, data):
    from feedline.metrics.catalog import SAMPLER
    from feedline.metrics.sink import PrometheusSink
    from feedline.sampler.settings import SidecarSettings
    from feedline.sampler.sidecar import Sidecar

    sink = PrometheusSink(SAMPLER)
    settings = SidecarSettings(source=f"{remote.url}/ids-{{0000..{N_SHARDS - 1:04d}}}.tar", cache=cache,
                               budget=20 * shard_bytes(data), initial_shards=3, min_shards=3)
    sidecar = Sidecar(settings, sink)
    runner = threading.Thread(target=sidecar.run)
    runner.start()
    try:
        assert wait_for(lambda: sidecar.ready()[0])
    finally:
        sidecar.stop()
        runner.join(10)
    assert not runner.is_alive()
    assert len(manifest_ids(cache)) == 3
    assert sink.value("fetch_bytes_total") == 3 * shard_bytes(data)
    assert sink.value("cache_shards") == 3


@pytest.mark.parametrize("change, setting", [
    ({"budget": 0}, "budget"), ({"policy": "hoard"}, "policy"), ({"fetch_threads": 0}, "fetch_threads"),
    ({"partition_index": 2, "partition_count": 2}, "partition_index"), ({"source": " "}, "source"),
])
def test_sidecar_settings_refuse_what_cannot_work_naming_the_setting(change, setting):
    from feedline.errors import SettingError
    from feedline.sampler.settings import SidecarSettings

    with pytest.raises(SettingError) as err:
        SidecarSettings(**{"source": "http://store/s-{0..3}.tar", **change})
    assert err.value.setting == setting


def test_compressed_and_presigned_shards_are_fetched_and_published_as_plain_tars(tmp_path, cache, samplers):
    from helpers import wds_shards

    from feedline.formats.transforms import RandomResizedCrop

    wds_shards(str(tmp_path / "gz"), suffix="tar.gz")
    with FileStore(str(tmp_path / "gz")) as store:
        source = (f"{store.url}/shard-{{000000..000002}}.tar.gz::"
                  f"{store.url}/shard-000003.tar.gz?X-Amz-Signature=0f3c&X-Amz-Expires=600")
        s = Sampler(store, cache, "--policy", "fill", "--budget", "64MiB", "--min-shards", "4", source=source)
        samplers.append(s)
        s.wait_ready()
        assert sorted(manifest_ids(cache)) == [f"shard-{k:06d}" for k in range(4)]
        assert all(os.path.getsize(shard_path(cache, i)) % 512 == 0 for i in manifest_ids(cache))  # plain tars
        assert read_manifest(cache).total_bytes == sum(os.path.getsize(shard_path(cache, i))
                                                       for i in manifest_ids(cache))  # budget counts plain bytes
        with StagingLoader(cache=cache, batch_size=8, workers=2, min_shards=4,
                           transform=RandomResizedCrop(32, fields=["jpg"])) as loader:
            keys = sorted(k for b in loader for k in b["__key__"])
        s.stop()
    assert keys == [f"{i:06d}" for i in range(48)]


def test_a_shard_that_decompresses_beyond_the_budget_is_stopped_and_counted(tmp_path, cache, samplers):
    import gzip

    from helpers import write_tar

    (tmp_path / "bomb").mkdir()
    tar = write_tar(str(tmp_path / "plain.tar"), [("k0", {"bin": bytes(4 << 20)})])  # 4 MiB of zeros
    (tmp_path / "bomb" / "b-0.tar.gz").write_bytes(gzip.compress(open(tar, "rb").read()))
    with FileStore(str(tmp_path / "bomb")) as store:
        s = Sampler(store, cache, "--policy", "fill", "--budget", "2MiB", source=f"{store.url}/b-{{0..0}}.tar.gz")
        samplers.append(s)
        assert wait_for(lambda: 'feedline_fetch_errors_total{reason="too_large"} 1.0' in s.get("/metrics")[1])
        partial = os.path.join(cache, "shards", ".partial")
        assert manifest_ids(cache) == [] and os.listdir(partial) == []
        s.stop()


def test_a_restarted_sidecar_goes_on_with_the_same_growth_plan(remote, cache, samplers, data):
    from feedline.cache.readers import write_reader
    from feedline.sampler.policy import shard_plan
    from feedline.sampler.sources import list_shards

    source = f"{remote.url}/ids-{{0000..{N_SHARDS - 1:04d}}}.tar"
    plan = shard_plan(list_shards(source), seed=0)
    expected = [next(plan).id for _ in range(5)]
    args = ("--initial-shards", "3", "--grow-shards", "2", "--min-shards", "3", "--budget",
            str(20 * shard_bytes(data)))
    first = Sampler(remote, cache, *args)
    samplers.append(first)
    first.wait_ready()
    assert sorted(manifest_ids(cache)) == sorted(expected[:3])
    generation = read_manifest(cache).generation
    first.proc.kill()  # preempted
    first.proc.communicate()
    again = Sampler(remote, cache, *args)
    samplers.append(again)
    again.wait_ready()
    write_reader(cache, 0, 0, generation, manifest_ids(cache))  # the trainer starts its epoch: the cache grows by 2
    assert wait_for(lambda: len(manifest_ids(cache)) == 5)
    assert sorted(manifest_ids(cache)) == sorted(expected)  # the seeded plan, not a new draw
    assert read_manifest(cache).generation > generation
    again.stop()


def test_a_reader_lease_shorter_than_two_renewals_is_refused_naming_it():
    from feedline.errors import SettingError
    from feedline.sampler.settings import SidecarSettings

    with pytest.raises(SettingError, match="reader_lease.*at least 60 s"):
        SidecarSettings(source="http://store/a.tar", reader_lease=10)
    assert SidecarSettings(source="http://store/a.tar", reader_lease=0).reader_lease == 0
