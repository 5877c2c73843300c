"""At scale (issue 71), on made-up shards: an epoch start's metadata calls a rank, an index's memory a sample."""

from __future__ import annotations

import json
import tracemalloc

from helpers import write_tar

from feedline.bench.scale.made_up import metadata_calls, tar_bytes, write_shards
from feedline.formats.sample_index import Sample, ShardIndex
from feedline.formats.sample_index import table_of
from feedline.formats.shard_index import build_index, load_index
from feedline.loader.plan.epoch_plan import EpochPlan
from feedline.loader.plan.rank import Rank
from feedline.loader.plan.sources import PathSource


def test_an_epoch_start_over_100000_shards_costs_a_rank_of_4096_its_own_shards_in_metadata_calls(tmp_path):
    """One directory read for the listing (no stat a shard), one open for each of the rank's own shards' indexes:
    on a shared filesystem each call is a round trip to its metadata server."""
    folder = tmp_path / "shards"
    write_shards(str(folder), 100_000)
    source = PathSource(str(folder))
    with metadata_calls() as calls:
        shards = source.snapshot()
        plan = EpochPlan.make(shards, epoch=0, seed=0, rank=Rank(2048, 4096), workers=16)
        assert plan.batches(256, False) > 0
    assert len(shards) == 100_000 and plan.rank_shards == 24
    assert sum(calls.values()) <= 100_000 / 4096 + 10, dict(calls)


def test_an_index_holds_its_samples_in_at_most_64_bytes_each(tmp_path):
    path = tmp_path / "many.tar"
    path.write_bytes(tar_bytes(20_000, ("jpg", "cls")))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = build_index(str(path))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index.samples) == 20_000 and held / 20_000 <= 64


def test_an_index_as_arrays_reads_back_the_samples_it_was_given_in_every_way(tmp_path):
    samples = [Sample("a/0", {"jpg": (512, 10), "cls": (1536, 1)}), Sample("b\udcff", {"txt": (3072, 0)}),
               Sample("a/2", {"cls": (4096, 7), "jpg": (5120, 2**40)})]
    table = table_of(samples)
    assert list(table) == samples and table == samples and len(table) == 3
    assert table[-1] == samples[-1] and table[1:] == samples[1:] and list(table[1].fields) == ["txt"]
    back = ShardIndex.from_json("x.tar", ShardIndex("x.tar", 9000, table).to_json())
    assert back.samples == samples and back.shard_bytes == 9000


def test_an_index_file_beside_a_shard_is_used_and_one_a_listing_did_not_see_is_not_looked_for(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    shard = write_tar(str(folder / "s.tar"), [("k0", {"cls": b"1"})])
    PathSource(str(folder)).snapshot()  # listed: no .idx beside it
    with metadata_calls() as calls:
        assert [s.key for s in load_index(shard).samples] == ["k0"]
    assert calls["open"] == 1  # the shard, not a .idx
    (folder / "s.idx").write_text(json.dumps({"version": 1, "shard_bytes": (folder / "s.tar").stat().st_size,
                                              "samples": [["from-the-idx", [["cls", 512, 1]]]]}))
    (folder / "s.tar").touch()  # a new mtime: not the index kept from before
    PathSource(str(folder)).snapshot()  # listed again: the .idx is there now
    assert [s.key for s in load_index(shard).samples] == ["from-the-idx"]


def test_the_scale_simulation_runs_and_writes_its_report(tmp_path):
    """``feedline bench scale --quick``: every part runs (small points: a check, not a measurement)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "feedline", "bench", "scale", "--quick", "--shm", str(tmp_path),
                          "--scale-json", str(tmp_path / "s.json"), "--scale-markdown", str(tmp_path / "s.md")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "s.json").read_text())
    assert {r["part"] for r in report["targets"]} == {"1", "2", "3", "4", "5", "6", "7"}
    assert not any("error" in r for key in ("state", "epoch_start", "index", "fill", "elastic", "agreement")
                   for r in report[key])
    assert "## 6. More ranks than shards" in (tmp_path / "s.md").read_text()
    assert list(tmp_path.glob("feedline-scale-*")) == []  # its made-up shards are gone


def test_a_plans_left_out_samples_are_saved_as_runs_and_states_saved_as_lists_still_load():
    shards = [f"/d/s-{i}.tar" for i in range(4)]
    left = tuple(range(1000)) + (5000, 5002)
    plan = EpochPlan.make(shards, epoch=1, seed=3, rank=Rank(0, 2), workers=2, skip={"/d/s-1.tar": left})
    state = plan.get_state()
    assert state["skip"]["/d/s-1.tar"] == [[0, 1000], [5000, 5001], [5002, 5003]]
    saved_before = dict(state, skip={"/d/s-1.tar": list(left)})  # a state of an earlier feedline
    assert EpochPlan.from_state(saved_before).skip == EpochPlan.from_state(state).skip == {"/d/s-1.tar": left}
    worker = plan.for_worker(0)
    assert type(worker).from_json(worker.to_json()) == worker


def test_an_epoch_start_over_a_brace_list_of_100000_shards_reads_their_folder_once(tmp_path):
    """``train-{000000..099999}.tar``, as webdataset's users name shards: one directory read for the names, not a
    stat each; a name not there (yet) gives nothing, a folder named like a shard is read as one."""
    folder = tmp_path / "shards"
    write_shards(str(folder), 100_000)
    (folder / "train-000003.tar").unlink()
    source = PathSource(str(folder / "train-{000000..099999}.tar"))
    with metadata_calls() as calls:
        shards = source.snapshot()
        plan = EpochPlan.make(shards, epoch=0, seed=0, rank=Rank(2048, 4096), workers=16)
        assert plan.batches(256, False) > 0
    assert len(shards) == 99_999 and str(folder / "train-000003.tar") not in shards
    assert sum(calls.values()) <= 100_000 / 4096 + 10, dict(calls)
