"""TFRecord and Parquet files where tar shards go: the sidecar's cache (fetched, decompressed, published, leased,
evicted), an elastic resume, ``StagingLoader.from_env``."""

import gzip
import json
import os
import shutil

import pytest
from helpers import Sampler, id_shards
from test_parquet import pyarrow_rows
from test_tfrecord import write_id_records

from feedline import StagingLoader
from feedline.cache.manifest import read_manifest, shard_path
from feedline.cache.source import CacheSource
from feedline.cache.readers import leased_ids
from feedline.cache.store import CacheStore
from feedline.demo.store import FileStore
from feedline.formats.shard_index import index_path, load_index

FIELDS = {"id": "cls", "payload": "bin"}


def mixed_store(d):
    """Two tar shards (ids 0-39), a gzip TFRecord file (100-119), a plain one (120-139), a Parquet file (200-229)."""
    id_shards(str(d), shards=2, per_shard=20)
    write_id_records(d / "rec-a.tfrecord", range(100, 120))
    (d / "rec-a.tfrecord.gz").write_bytes(gzip.compress((d / "rec-a.tfrecord").read_bytes()))
    os.unlink(d / "rec-a.tfrecord")
    write_id_records(d / "rec-b.tfrecords", range(120, 140))
    pyarrow_rows(d / "rows.parquet", range(200, 230), row_group_size=7)
    return ["ids-0000.tar", "ids-0001.tar", "rec-a.tfrecord.gz", "rec-b.tfrecords", "rows.parquet"]


def test_the_sidecar_caches_tfrecord_and_parquet_files_beside_tar_shards_and_the_loader_reads_every_sample(
        tmp_path, cache, samplers):
    names = mixed_store(tmp_path / "remote")
    with FileStore(str(tmp_path / "remote")) as store:
        s = Sampler(store, cache, "--policy", "fill", "--budget", "64MiB", "--min-shards", "5",
                    source="::".join(f"{store.url}/{n}" for n in names))
        samplers.append(s)
        s.wait_ready()
        entries = {e.id: e for e in read_manifest(cache).shards}
        assert {i: (e.format, e.samples) for i, e in entries.items()} == {
            "ids-0000": ("tar", 20), "ids-0001": ("tar", 20), "rec-a": ("tfrecord", 20), "rec-b": ("tfrecord", 20),
            "rows": ("parquet", 30)}
        plain = (tmp_path / "remote" / "rec-a.tfrecord.gz").read_bytes()
        assert open(shard_path(cache, "rec-a", "tfrecord"), "rb").read() == gzip.decompress(plain)  # cached plain
        assert read_manifest(cache).total_bytes == sum(os.path.getsize(shard_path(cache, i, e.format))
                                                       for i, e in entries.items())
        got = {}
        with StagingLoader(cache=cache, batch_size=8, workers=2, min_shards=5, fields=FIELDS,
                           spec={"id": "int64", "payload": ("uint8", (64,))}) as loader:
            for batch in loader:
                for i, payload, key in zip(batch["id"].tolist(), batch["payload"], batch["__key__"]):
                    assert i not in got and bytes(payload.tolist()) == bytes([i % 256]) * 64
                    got[i] = key
            assert sum(loader.stats().sample_errors_total.values()) == 0
        s.stop()
    assert sorted(got) == [*range(40), *range(100, 140), *range(200, 230)]
    assert got[100] == "rec-a/00000000" and got[201] == "rows/00000001"  # keys name the cache id


def copy_in(store, src, shard_id, fmt):
    partial = store.partial_path(shard_id)
    shutil.copyfile(src, partial)
    return store.publish(shard_id, partial, str(src), fmt=fmt)


def test_a_full_cache_evicts_the_oldest_record_file_with_its_index_and_keeps_a_leased_one_until_released(tmp_path):
    rec = write_id_records(tmp_path / "r.tfrecord", range(20))
    rows = pyarrow_rows(tmp_path / "p.parquet", range(30), row_group_size=7)
    budget = os.path.getsize(rec) + os.path.getsize(rows) + 100
    leased: set[str] = set()
    store = CacheStore(str(tmp_path / "cache"), budget, leased=lambda: set(leased))
    copy_in(store, rec, "r", "tfrecord")
    copy_in(store, rows, "p", "parquet")
    for fmt, sid in (("tfrecord", "r"), ("parquet", "p")):
        assert os.path.exists(index_path(shard_path(store.root, sid, fmt)))
    leased.add("r")
    copy_in(store, rec, "r2", "tfrecord")  # room for it: the oldest, r, goes, but a reader's epoch reads it
    assert [e.id for e in store.entries] == ["p", "r2"] and read_manifest(store.root).retained == ["r"]
    assert os.path.exists(shard_path(store.root, "r", "tfrecord"))
    leased.clear()
    assert store.release() == ["r"]
    assert not os.path.exists(shard_path(store.root, "r", "tfrecord"))
    assert not os.path.exists(index_path(shard_path(store.root, "r", "tfrecord")))
    assert sorted(os.listdir(os.path.join(store.root, "shards"))) == [
        ".partial", "p.parquet", "p.parquet.idx", "r2.tfrecord", "r2.tfrecord.idx"]


def test_a_restarted_sidecar_adopts_record_files_and_drops_stale_indexes(tmp_path):
    rec = write_id_records(tmp_path / "r.tfrecord", range(20))
    rows = pyarrow_rows(tmp_path / "p.parquet", range(30), row_group_size=7)
    root = str(tmp_path / "cache")
    store = CacheStore(root, 1 << 30)
    copy_in(store, rec, "r", "tfrecord")
    os.unlink(os.path.join(root, "manifest.json"))  # a crash lost it
    shutil.copyfile(rows, shard_path(root, "p", "parquet"))  # a file nobody indexed
    open(index_path(shard_path(root, "gone", "parquet")), "w").write("{}")  # an index without its file
    again = CacheStore(root, 1 << 30)
    r = again.recover()
    assert r.adopted == 2 and {(e.id, e.format, e.samples) for e in again.entries} == {("r", "tfrecord", 20),
                                                                                        ("p", "parquet", 30)}
    assert not os.path.exists(index_path(shard_path(root, "gone", "parquet")))
    assert load_index(shard_path(root, "p", "parquet")).samples[3].key == "p/00000003"


def test_a_loader_epoch_over_cached_record_files_leases_them(tmp_path):
    root = str(tmp_path / "cache")
    store = CacheStore(root, 1 << 30)
    copy_in(store, write_id_records(tmp_path / "r.tfrecord", range(20)), "r", "tfrecord")
    copy_in(store, pyarrow_rows(tmp_path / "p.parquet", range(30), row_group_size=7), "p", "parquet")
    source = CacheSource(root)
    source.epoch_started(0, 0, source.snapshot())
    assert leased_ids(root, 60.0) == {"r", "p"}


def test_a_manifest_naming_an_unknown_format_is_corrupt(tmp_path):
    root = str(tmp_path / "cache")
    store = CacheStore(root, 1 << 30)
    copy_in(store, write_id_records(tmp_path / "r.tfrecord", range(3)), "r", "tfrecord")
    text = open(os.path.join(root, "manifest.json")).read().replace('"tfrecord"', '"orc"')
    open(os.path.join(root, "manifest.json"), "w").write(text)
    with pytest.raises(ValueError, match="unknown format 'orc'"):
        read_manifest(root)


def record_files(d):
    """Two TFRecord files (ids 0-59) and two Parquet files (60-119) in one folder."""
    os.makedirs(d)
    for k in range(2):
        write_id_records(d / f"r-{k}.tfrecord", range(k * 30, k * 30 + 30))
        pyarrow_rows(d / f"p-{k}.parquet", range(60 + k * 30, 90 + k * 30), row_group_size=8)
    return [str(d / "*.tfrecord"), str(d / "*.parquet")]


def test_an_elastic_resume_from_two_ranks_to_one_over_record_files_delivers_every_sample_once(tmp_path):
    from feedline.loader.plan.rank import Rank

    shards = record_files(tmp_path / "data")
    spec = {"cls": "int64", "bin": ("uint8", (64,))}
    taken, states = [], []
    for rank, k in ((0, 2), (1, 4)):  # each rank stopped after k batches, its state saved
        with StagingLoader(shards, batch_size=8, workers=1, seed=11, spec=spec, rank=Rank(rank, 2)) as loader:
            it = iter(loader)
            taken += [i for _ in range(k) for i in next(it)["cls"].tolist()]
            states.append(json.loads(json.dumps(loader.state_dict())))
    with StagingLoader(shards, batch_size=8, workers=2, seed=11, spec=spec, rank=Rank(0, 1)) as loader:
        loader.load_state_dict(states, elastic=True)
        rest = [i for b in loader for i in b["cls"].tolist()]
    assert len(taken) == 48 and sorted(taken + rest) == list(range(120))


def test_from_env_reads_record_files_named_by_feedline_shards(tmp_path):
    shards = record_files(tmp_path / "data")
    env = {"FEEDLINE_SHARDS": ",".join(shards), "FEEDLINE_BATCH_SIZE": "8", "FEEDLINE_WORKERS": "2",
           "FEEDLINE_DEVICE": "cpu"}
    with StagingLoader.from_env(env=env, fields=FIELDS, spec={"id": "int64", "payload": ("uint8", (64,))}) as loader:
        assert sorted(i for b in loader for i in b["id"].tolist()) == list(range(120))


def test_cached_record_files_evicted_after_the_epoch_started_still_read_whole(tmp_path):
    root = str(tmp_path / "cache")
    store = CacheStore(root, 1 << 30)
    for k in range(2):  # files of 30 rows in groups of 4 and of 30 records: more rows than one batch reads
        copy_in(store, pyarrow_rows(tmp_path / f"p{k}.parquet", range(k * 30, k * 30 + 30), row_group_size=4),
                f"p{k}", "parquet")
        copy_in(store, write_id_records(tmp_path / f"r{k}.tfrecord", range(100 + k * 30, 130 + k * 30)), f"r{k}",
                "tfrecord")
    with StagingLoader(cache=root, batch_size=4, workers=1, fields=FIELDS, shuffle_buffer=0,
                       spec={"id": "int64", "payload": ("uint8", (64,))}) as loader:
        it = iter(loader)
        first = next(it)
        store.evict_oldest(4)  # every file of the epoch is unlinked while the epoch runs
        assert os.listdir(os.path.join(root, "shards")) == [".partial"]
        ids = first["id"].tolist() + [i for b in it for i in b["id"].tolist()]
        errors = loader.stats().sample_errors_total
    assert sorted(ids) == [*range(60), *range(100, 160)] and sum(errors.values()) == 0


def test_a_restart_keeps_the_file_in_the_manifests_format_when_an_id_is_on_disk_in_two(tmp_path):
    root = str(tmp_path / "cache")
    store = CacheStore(root, 1 << 30)
    copy_in(store, pyarrow_rows(tmp_path / "x.parquet", range(30), row_group_size=7), "x", "parquet")
    shutil.copyfile(write_id_records(tmp_path / "x.tfrecord", range(5)), shard_path(root, "x", "tfrecord"))
    again = CacheStore(root, 1 << 30)
    r = again.recover()
    assert [(e.id, e.format, e.samples) for e in again.entries] == [("x", "parquet", 30)] and r.removed_invalid == 1
    assert sorted(os.listdir(os.path.join(root, "shards"))) == [".partial", "x.parquet", "x.parquet.idx"]


def test_the_sidecar_fetches_anew_a_shard_the_source_now_has_in_another_format(tmp_path, cache, samplers):
    id_shards(str(tmp_path / "old"), shards=1, per_shard=20)
    store = CacheStore(cache, 1 << 30)
    copy_in(store, tmp_path / "old" / "ids-0000.tar", "ids-0000", "tar")  # cached when the source held a tar
    (tmp_path / "remote").mkdir()
    pyarrow_rows(tmp_path / "remote" / "ids-0000.parquet", range(50, 80), row_group_size=8)
    with FileStore(str(tmp_path / "remote")) as remote:
        s = Sampler(remote, cache, "--policy", "fill", "--budget", "16MiB", source=f"{remote.url}/ids-0000.parquet")
        samplers.append(s)
        s.wait_ready()
        assert [(e.id, e.format, e.samples) for e in read_manifest(cache).shards] == [("ids-0000", "parquet", 30)]
        assert "in another format than the source's now" in s.stop()
    assert sorted(os.listdir(os.path.join(cache, "shards"))) == [".partial", "ids-0000.parquet", "ids-0000.parquet.idx"]


def test_a_sidecar_is_never_ready_on_a_shard_the_source_now_has_in_another_format(tmp_path, cache):
    """/readyz is served from ready() as soon as the sidecar exists, before run(): the stale entry must be gone
    by then, or a loader starting at that moment reads data the source no longer has."""
    from feedline.sampler.settings import SidecarSettings
    from feedline.sampler.sidecar import Sidecar

    id_shards(str(tmp_path / "old"), shards=1, per_shard=20)
    copy_in(CacheStore(cache, 1 << 30), tmp_path / "old" / "ids-0000.tar", "ids-0000", "tar")
    (tmp_path / "remote").mkdir()
    pyarrow_rows(tmp_path / "remote" / "ids-0000.parquet", range(50, 80), row_group_size=8)
    with FileStore(str(tmp_path / "remote")) as remote:
        sidecar = Sidecar(SidecarSettings(source=f"{remote.url}/ids-0000.parquet", cache=cache, budget=16 << 20))
        ready, why = sidecar.ready()
        assert not ready and "0 of min_shards=1" in why
        assert read_manifest(cache).shards == []


def test_a_parquet_cell_over_the_member_bound_is_skipped_and_counted_with_or_without_a_transform(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "big.parquet")
    cells = [bytes(2048) if i % 3 == 0 else bytes(512) for i in range(6)]  # rows 0 and 3 over a 1 KiB bound
    pq.write_table(pa.table({"cls": pa.array(range(6), pa.int64()), "bin": pa.array(cells, pa.binary())}), path,
                   row_group_size=3)
    for transform in (None, Identity()):  # without one, cells reach the slot as views; with one, as bytes
        with StagingLoader(path, batch_size=2, workers=1, fields=FIELDS, max_member_bytes=1024, transform=transform,
                           spec={"id": "int64", "payload": ("uint8", (512,))}, max_sample_errors=0.5) as loader:
            assert sorted(i for b in loader for i in b["id"].tolist()) == [1, 2, 4, 5]
            assert loader.stats().sample_errors_total["member_too_large"] == 2


class Identity:
    def __call__(self, sample):
        return sample
