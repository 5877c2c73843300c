"""The cache directory among other local users, and the cache keeping its own promises (issue 49, items 4 and 8).

A cache is this user's own or refused; what feedline creates there is made exclusively, never through a link, with
modes that give other users nothing; the shards on disk, leased ones included, stay within what the sizing figures
count; a loader that is done ends its lease, and a killed one's lease files go once stale.
"""

import os
import stat
import threading
import time

import pytest
from helpers import id_shards, manifest_ids, publish_copy, shard_bytes

from feedline import StagingLoader
from feedline.cache.manifest import read_manifest
from feedline.cache.ownership import CacheDirError
from feedline.cache.readers import leased_ids, write_reader
from feedline.cache.store import CacheStore
from feedline.errors import SettingError
from feedline.formats.files import atomic_write
from feedline.sampler.settings import SidecarSettings
from feedline.sampler.sidecar import Sidecar

SPEC = {"cls": "int64"}


def someone_elses(path) -> int:
    """Make ``path`` (a folder) belong to another user; that user's uid. Only root can: elsewhere the test skips
    (a folder of root's would not do: a cache root may be root's, a mount point)."""
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        return 65534
    pytest.skip("only root can give a folder to another user here")


def test_a_cache_directory_owned_by_another_user_is_refused_by_the_sidecar_naming_it(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text("{}")
    uid = someone_elses(cache)
    id_shards(str(tmp_path / "src"), shards=1, per_shard=4)
    with pytest.raises(SettingError, match=rf"cache.*{cache} belongs to .*uid {uid}.*use a cache directory of your own"):
        Sidecar(SidecarSettings(source=str(tmp_path / "src"), cache=str(cache), budget=16 << 20))
    assert os.listdir(cache) == ["manifest.json"]  # nothing made, nothing removed in it


def test_a_loader_refuses_to_read_a_cache_another_user_made(tmp_path, data):
    cache = str(tmp_path / "cache")
    store = CacheStore(cache, 10 * shard_bytes(data))
    publish_copy(store, data, 0)
    someone_elses(cache)
    with pytest.raises(CacheDirError, match="belongs to"):
        with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC, wait_timeout=5) as loader:
            next(iter(loader))
    assert os.listdir(os.path.join(cache, "readers")) == []  # no lease written into it either


def test_the_folders_the_cache_makes_give_other_users_nothing_and_its_files_no_read(tmp_path, data):
    loose = tmp_path / "cache"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)  # a folder of this user's, open to all: tightened, not refused
    store = CacheStore(str(loose), 10 * shard_bytes(data))
    publish_copy(store, data, 0)
    for d in ("", "shards", "shards/.partial", "readers"):
        assert stat.S_IMODE(os.stat(loose / d).st_mode) == 0o700, d
    for f in ("manifest.json", "shards/ids-0000.idx", "shards/ids-0000.tar"):
        assert stat.S_IMODE(os.stat(loose / f).st_mode) & 0o077 == 0, f


def test_a_link_planted_at_a_temporary_name_is_replaced_never_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("theirs")
    target = tmp_path / "manifest.json"
    os.symlink(outside, f"{target}.tmp.{os.getpid()}")  # the name atomic_write writes to first
    atomic_write(str(target), "{}")
    assert outside.read_text() == "theirs" and target.read_text() == "{}"
    assert not os.path.lexists(f"{target}.tmp.{os.getpid()}")


def test_recovery_removes_a_shard_name_that_is_a_link_never_reading_or_adopting_what_it_points_to(tmp_path, data):
    outside = tmp_path / "theirs.tar"
    outside.write_bytes(open(os.path.join(data, "ids-0000.tar"), "rb").read())
    store = CacheStore(str(tmp_path / "cache"), 10 * shard_bytes(data))
    os.symlink(outside, os.path.join(store.shards_dir, "x.tar"))
    r = store.recover()
    assert r.adopted == 0 and r.removed_invalid == 1 and store.entries == []
    assert not os.path.lexists(os.path.join(store.shards_dir, "x.tar")) and outside.exists()


# -- item 8: the shards on disk, leased ones included, within what sizing counts ----------------------------------

def test_the_shards_kept_for_leases_stay_within_the_retain_room_while_publishes_wait(tmp_path, data):
    cache = str(tmp_path / "cache")
    one = shard_bytes(data)
    leased: set[str] = set()
    store = CacheStore(cache, 3 * one, leased=lambda: set(leased), retain_bytes=one)
    for k in range(3):
        publish_copy(store, data, k)
    leased.update(manifest_ids(cache))  # a reader's epoch reads all three
    done = threading.Event()
    worst = [0]

    def watch():
        while not done.is_set():
            on_disk = 0
            for name in os.listdir(store.shards_dir):
                if name.endswith(".tar"):
                    try:
                        on_disk += os.path.getsize(os.path.join(store.shards_dir, name))
                    except FileNotFoundError:
                        pass
            worst[0] = max(worst[0], on_disk)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    publisher = threading.Thread(target=lambda: [publish_copy(store, data, k) for k in (3, 4, 5)])
    publisher.start()
    try:
        assert not done.wait(1.5)
        assert manifest_ids(cache)[-1] == "ids-0003" and store.retained_bytes == one  # one kept; ids-0004 waits
        leased.clear()  # the reader's epoch moved on: what it kept goes, and the waiting publishes go in
        publisher.join(timeout=20)
        assert not publisher.is_alive()
    finally:
        done.set()
        watcher.join()
    assert manifest_ids(cache) == ["ids-0003", "ids-0004", "ids-0005"]
    assert worst[0] <= 3 * one + one  # the budget plus the retain room, never more


def test_the_retain_room_is_the_replaced_fraction_of_the_budget_for_either_policy(tmp_path):
    id_shards(str(tmp_path / "src"), shards=2, per_shard=4)
    for policy in ("grow", "fill"):
        s = Sidecar(SidecarSettings(source=str(tmp_path / "src"), cache=str(tmp_path / policy), budget=64 << 20,
                                    policy=policy, replace_fraction=0.25))
        assert s.retain_room() == 16 << 20 and s.store.retain_bytes == 16 << 20


def leased_cache(tmp_path, data) -> str:
    """A cache of two published shards whose store keeps what a reader's lease (600 s) names."""
    cache = str(tmp_path / "cache")
    store = CacheStore(cache, 10 * shard_bytes(data), leased=lambda: leased_ids(cache, 600))
    for k in range(2):
        publish_copy(store, data, k)
    return cache


def test_a_loader_closed_after_its_epoch_ends_its_lease_and_one_closed_mid_epoch_keeps_it(tmp_path, data):
    cache = leased_cache(tmp_path, data)
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC) as loader:
        it = iter(loader)
        next(it)
    assert leased_ids(cache, 600) == {"ids-0000", "ids-0001"}  # a preemption mid-epoch: the resume finds them
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC) as loader:
        sum(1 for _ in loader)
    assert os.listdir(os.path.join(cache, "readers")) == []


def test_a_killed_readers_lease_files_go_once_stale(tmp_path):
    id_shards(str(tmp_path / "src"), shards=2, per_shard=4)
    cache = str(tmp_path / "cache")
    sidecar = Sidecar(SidecarSettings(source=str(tmp_path / "src"), cache=cache, budget=16 << 20, reader_lease=60))
    write_reader(cache, 0, 3, 1, ["ids-0000"])  # a trainer that died at epoch 3
    write_reader(cache, 1, 3, 1, ["ids-0001"])  # and one still reading
    old = time.time() - 61
    os.utime(os.path.join(cache, "readers", "0.json"), (old, old))
    runner = threading.Thread(target=sidecar.run)
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while os.path.exists(os.path.join(cache, "readers", "0.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        sidecar.stop()
        runner.join()
    assert sorted(os.listdir(os.path.join(cache, "readers"))) == ["1.json", "1.shards"]
    assert read_manifest(cache).retained == []


def test_the_sidecar_decompresses_only_into_the_room_it_leaves_free_beside_the_retain_room(small_tmpfs, tmp_path):
    import gzip
    import io
    import logging
    import shutil
    import tarfile

    from helpers import write_tar

    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(src / "bomb.tar.gz", "wb", compresslevel=9) as z, tarfile.open(fileobj=z, mode="w|") as tar:
        info = tarfile.TarInfo("k0.bin")
        info.size = 256 << 20
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    cache = str(small_tmpfs / "cache")  # a 64 MiB tmpfs: budget 40 MiB, retain room 10 MiB
    sidecar = Sidecar(SidecarSettings(source=str(src), cache=cache, budget=40 << 20, fetch_threads=1,
                                      replace_fraction=0.25, retries=0))
    for k in range(3):  # the cache holds 24 MiB: 40 MiB of the tmpfs are free
        shard = write_tar(str(tmp_path / f"full-{k}.tar"), [(f"f{k}", {"bin": os.urandom(8 << 20)})])
        partial = sidecar.store.partial_path(f"full-{k}")
        shutil.copyfile(shard, partial)
        sidecar.store.publish(f"full-{k}", partial)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("feedline.sampler").addHandler(handler)
    try:
        sidecar._fetch_one(sidecar.shards[0])
    finally:
        logging.getLogger("feedline.sampler").removeHandler(handler)
    said = " ".join(records)
    assert "the room it may take" in said, said  # refused as too large, before the tmpfs filled (no_space)
    room = int(said.split("decompresses to more than ")[1].split(" bytes")[0])
    assert room <= (40 << 20) - (10 << 20)  # what is free, less the retain room (and some headroom)
    assert os.listdir(os.path.join(cache, "shards", ".partial")) == []
    assert [e.id for e in sidecar.store.entries] == ["full-0", "full-1", "full-2"]


def test_a_mixed_caches_source_name_that_is_a_path_out_of_it_is_refused(tmp_path, data):
    import json

    elsewhere = str(tmp_path / "elsewhere")  # a cache of someone's, beside this one
    publish_copy(CacheStore(elsewhere, 10 * shard_bytes(data)), data, 0)
    root = tmp_path / "mixed"
    root.mkdir(mode=0o700)
    (root / "mix.json").write_text(json.dumps({"format": "feedline.mix/1",
                                               "sources": [{"name": "../elsewhere", "weight": 1.0}]}))
    with pytest.raises(ValueError, match=r"names a source '\.\./elsewhere', which is no folder name"):
        with StagingLoader(cache=str(root), batch_size=4, workers=1, spec=SPEC, wait_timeout=5) as loader:
            next(iter(loader))
    assert os.listdir(os.path.join(elsewhere, "readers")) == []


def test_a_reader_whose_lease_went_stale_during_a_long_pause_writes_it_again_at_its_next_batch(tmp_path, data,
                                                                                              monkeypatch):
    import feedline.cache.source as source

    monkeypatch.setattr(source, "TOUCH_EVERY", 0.0)
    cache = leased_cache(tmp_path, data)
    with StagingLoader(cache=cache, batch_size=4, workers=1, spec=SPEC) as loader:
        it = iter(loader)
        next(it)
        for name in os.listdir(os.path.join(cache, "readers")):  # the sidecar removed it: 600 s without a touch
            os.unlink(os.path.join(cache, "readers", name))
        next(it)
        assert leased_ids(cache, 600) == {"ids-0000", "ids-0001"}
