"""The shard indexes a loader's processes share (loader/workers/index_share.py): each built once, copied by the
others, in an anonymous memfd that no exit leaves behind."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from feedline.formats.sample_index import SampleTable, SampleTableBuilder, ShardError, ShardIndex
from feedline.formats.shard_index import load_index
from feedline.loader.loader import StagingLoader
from feedline.loader.workers.index_share import IndexShare

from helpers import ROOT, id_shards, within

SPEC = {"bin": ("uint8", (64,)), "cls": "int64"}


def _table() -> SampleTable:
    b = SampleTableBuilder()
    b.add("a/0", {"jpg": (512, 10), "cls": (1024, 1)})
    b.add("caf\udcc3", {"png": (2048, 7)})  # a key that is not UTF-8 (kept by surrogateescape) and a second layout
    b.add("b/2", {"jpg": (4096, 3), "cls": (5120, 2)})
    return b.build()


def _identity(path: str) -> tuple[str, int, int, int, int, int]:
    st = os.stat(path)
    return path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _feedline_fds() -> list[str]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if "feedline-indexes" in target:
            out.append(target)
    return out


def test_a_table_copied_back_from_its_bytes_is_the_same_table():
    table = _table()
    back = SampleTable.from_bytes(memoryview(table.to_bytes()))
    assert back == table and list(back) == list(table)
    assert back[1].key == "caf\udcc3" and back[1].fields == {"png": (2048, 7)}


def test_bytes_cut_short_are_not_a_table():
    data = _table().to_bytes()
    with pytest.raises(ValueError):
        SampleTable.from_bytes(data[:-3])


def test_an_index_left_by_one_process_is_found_by_another_identity(tmp_path):
    path = id_shards(str(tmp_path), shards=1, per_shard=5)[0]
    with IndexShare.create() as share:
        index = load_index(path, share=share)
        assert share.counts() == (1, 0)
        other = IndexShare.attach(share.to_json())  # a worker's view of the same memfd
        found = other.find(_identity(path))
        assert found is not None and found.samples == index.samples and found.shard_bytes == index.shard_bytes
        assert share.counts() == (1, 1)


def test_a_replaced_file_is_not_given_the_old_files_index(tmp_path):
    path = id_shards(str(tmp_path), shards=1, per_shard=5)[0]
    with IndexShare.create() as share:
        old = _identity(path)
        load_index(path, share=share)
        os.replace(id_shards(str(tmp_path / "new"), shards=1, per_shard=9)[0], path)
        assert len(load_index(path, share=share).samples) == 9
        assert share.find(old) is not None and share.counts()[0] == 2  # the new file's own table, built


def test_a_full_share_starts_over_and_drops_what_it_held(tmp_path):
    table = _table()
    size = len(table.to_bytes()) + 64
    with IndexShare.create(capacity=64 + size + size // 2) as share:
        first, second = ("/a.tar", 1, 1, 1, 1, 1), ("/b.tar", 1, 2, 1, 1, 1)
        share.put(first, ShardIndex("/a.tar", 100, table))
        share.put(second, ShardIndex("/b.tar", 200, table))
        assert share.find(first) is None
        found = share.find(second)
        assert found is not None and found.shard_bytes == 200 and found.samples == table


def test_processes_needing_the_same_indexes_at_once_build_each_one_once(tmp_path):
    paths = id_shards(str(tmp_path), shards=6, per_shard=400)
    with IndexShare.create() as share:
        code = textwrap.dedent(f"""
            import sys
            from feedline.formats.shard_index import load_index
            from feedline.loader.workers.index_share import IndexShare
            share = IndexShare.attach({share.to_json()!r})
            sys.stdin.readline()  # every process starts together
            print(sum(len(load_index(p, share=share).samples) for p in {paths!r}))
        """)
        procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, pass_fds=[share.fd], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for _ in range(4)]
        outs = [p.communicate("go\n", timeout=60)[0] for p in procs]
        assert [int(o) for o in outs] == [2400] * 4
        assert share.counts() == (6, 18)


def test_a_process_killed_while_building_an_index_lets_the_next_one_build_it(tmp_path):
    path = id_shards(str(tmp_path), shards=1, per_shard=5)[0]
    identity = _identity(path)
    with IndexShare.create() as share:
        code = textwrap.dedent(f"""
            import time
            from feedline.loader.workers.index_share import IndexShare
            share = IndexShare.attach({share.to_json()!r})
            with share.building({identity!r}):
                print("held", flush=True)
                time.sleep(60)
        """)
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, pass_fds=[share.fd], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline() == "held\n"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        out = within(10, lambda: len(load_index(path, share=share).samples))
        assert out.get("value") == 5


def test_a_loaders_workers_build_each_index_once_under_the_epoch_shuffle(tmp_path):
    shards = id_shards(str(tmp_path), shards=6, per_shard=37)  # tar files only: each index is a scan of headers
    with StagingLoader(shards, batch_size=8, workers=2, spec=SPEC, device="cpu") as loader:
        assert loader.settings.block > 0  # the default shuffle: each worker reads part of every shard
        ids = sorted(int(i) for b in loader for i in b["cls"])
        built, copied = loader._pipeline.indexes.counts()
    assert ids == list(range(222))
    assert built == 6 and copied >= 6  # each built once (by the start's probe or a worker), copied by the others


def test_indexes_the_trainer_counted_are_copied_by_every_worker(tmp_path):
    shards = id_shards(str(tmp_path), shards=6, per_shard=37)
    with StagingLoader(shards, batch_size=8, workers=2, spec=SPEC, device="cpu") as loader:
        assert len(loader) == 29  # counted here, from the indexes it built (a worker's 114 and 108 samples, 8 a batch)
        ids = sorted(int(i) for b in loader for i in b["cls"])
        assert loader._pipeline.indexes.counts() == (6, 12)
    assert ids == list(range(222))


def test_a_closed_loader_holds_no_shared_index_memory(tmp_path):
    shards = id_shards(str(tmp_path), shards=2, per_shard=10)
    before = _feedline_fds()
    loader = StagingLoader(shards, batch_size=8, workers=1, spec=SPEC, device="cpu")
    assert len(_feedline_fds()) == len(before) + 1
    loader.close()
    assert _feedline_fds() == before


def test_an_index_too_large_to_share_is_marked_so_the_others_build_it_without_waiting(tmp_path):
    path = id_shards(str(tmp_path), shards=1, per_shard=50)[0]
    with IndexShare.create(capacity=256) as share:  # room for the header and a mark, not for the table
        assert len(load_index(path, share=share).samples) == 50
        assert share.find(_identity(path)) is False and share.counts() == (0, 0)


def test_an_unreadable_shard_is_marked_so_the_others_do_not_wait_to_fail_in_turn(tmp_path):
    path = str(tmp_path / "cut.tar")
    with open(path, "wb") as f:
        f.write(b"not a tar at all" * 40)
    with IndexShare.create() as share:
        with pytest.raises(ShardError):
            load_index(path, share=share)
        assert share.find(_identity(path)) is False


def test_a_share_that_fails_is_no_error_the_index_is_built_where_needed(tmp_path):
    path = id_shards(str(tmp_path), shards=1, per_shard=5)[0]
    share = IndexShare.create()
    broken = IndexShare(os.dup(share.fd), share.capacity, owner=True)
    os.close(broken.fd)  # every lock and read on it fails (EBADF)
    share.close()
    assert len(load_index(path, share=broken).samples) == 5


def test_an_index_read_before_without_the_share_is_left_there_when_read_with_it(tmp_path):
    path = id_shards(str(tmp_path), shards=1, per_shard=5)[0]
    load_index(path)  # a mixture's count, say: kept by this process
    with IndexShare.create() as share:
        load_index(path, share=share)
        found = share.find(_identity(path))
        assert found is not None and found is not False and len(found.samples) == 5


def test_a_worker_does_not_pass_the_shared_memory_on_to_processes_it_starts():
    with IndexShare.create() as share:
        os.set_inheritable(share.fd, True)  # as a spawned worker gets it
        IndexShare.attach(share.to_json())
        assert not os.get_inheritable(share.fd)


def test_an_index_that_cannot_be_shared_offered_again_takes_no_more_room():
    import struct

    with IndexShare.create() as share:
        identity = ("/empty.tfrecord", 1, 3, 0, 1, 1)
        end = lambda: struct.unpack_from("<Q", os.pread(share.fd, 8, 0))[0]  # noqa: E731 (where the records end)
        share.put(identity, ShardIndex("/empty.tfrecord", 0, []))  # a list, not a table: its mark
        once = end()
        for _ in range(5):  # the memo offers it at every open
            share.put(identity, ShardIndex("/empty.tfrecord", 0, []))
        assert end() == once and share.find(identity) is False
