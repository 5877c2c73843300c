"""At scale (issue 71), on made-up shards: an epoch start's metadata calls a rank, an index's memory a sample."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from helpers import write_tar

from feedline.bench.scale.made_up import metadata_calls, tar_bytes, write_shards
from feedline.formats.sample_index import Sample, ShardIndex
from feedline.formats.sample_index import table_of
from feedline.formats.shard_index import build_index, load_index
from feedline.errors import SettingError
from feedline.loader.plan.epoch_plan import EpochPlan, shards_digest
from feedline.loader.plan.rank import Rank
from feedline.loader.plan.resume import EXACT, RANKS_FORMAT, Cursor, make_state, own_state, plan_resume, shared_lists
from feedline.loader.plan.sources import PathSource


@pytest.fixture(scope="module")
def hundred_thousand(tmp_path_factory):
    """100,000 made-up shards, written once for the tests that read them (none changes them): train-000000 ..
    train-100000 less train-000003, the name a brace list over them finds missing."""
    folder = tmp_path_factory.mktemp("shards")
    write_shards(str(folder), 100_001)
    (folder / "train-000003.tar").unlink()
    return folder


@pytest.mark.xdist_group("scale-shards")
def test_an_epoch_start_over_100000_shards_costs_a_rank_of_4096_its_own_shards_in_metadata_calls(hundred_thousand):
    """One directory read for the listing (no stat a shard), one open for each of the rank's own shards' indexes:
    on a shared filesystem each call is a round trip to its metadata server."""
    folder = hundred_thousand
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
    assert not any("error" in r for key in ("state", "epoch_start", "mixture_start", "index", "fill", "elastic",
                                            "agreement") for r in report[key])
    listed = [r for r in report["mixture_start"] if r["listed"]]  # a mixture's counts from its sources' listings
    assert listed and all(r["calls"] <= r["S"] / 4096 + 10 for r in listed)
    builds = report["index_builds"]  # a real loader's workers, each reading part of every shard
    assert builds["built"] == builds["S"] and builds["copied"] >= (builds["W"] - 1) * builds["S"]
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


@pytest.mark.xdist_group("scale-shards")
def test_an_epoch_start_over_a_brace_list_of_100000_shards_reads_their_folder_once(hundred_thousand):
    """``train-{000000..099999}.tar``, as webdataset's users name shards: one directory read for the names, not a
    stat each; a name not there (yet) gives nothing, a folder named like a shard is read as one."""
    folder = hundred_thousand
    source = PathSource(str(folder / "train-{000000..099999}.tar"))
    with metadata_calls() as calls:
        shards = source.snapshot()
        plan = EpochPlan.make(shards, epoch=0, seed=0, rank=Rank(2048, 4096), workers=16)
        assert plan.batches(256, False) > 0
    assert len(shards) == 99_999 and str(folder / "train-000003.tar") not in shards
    assert sum(calls.values()) <= 100_000 / 4096 + 10, dict(calls)


def _mid_epoch_state(plan, counts, with_shards):
    cursor = Cursor.start(plan.workers, [3] * plan.workers, [800] * plan.workers)
    settings = {"seed": 0, "batch_size": 256, "drop_last": False, "shuffle": True, "shuffle_buffer": 0,
                "shuffle_block": 0, "workers": plan.workers, "rank": plan.rank.rank,
                "world_size": plan.rank.world_size, "sources": None}
    return make_state(plan, cursor, plan.epoch, settings, counts, with_shards)


def _settings_of(state):
    """The loader settings a state was saved with (what ``plan_resume`` compares)."""
    return {k: state[k] for k in (*EXACT, "sources")}


def test_a_rank_state_over_100000_shards_is_at_most_16_kb_and_names_its_shard_list_by_digest():
    shards = [f"/data/train-{i:06d}.tar" for i in range(100_000)]
    plan = EpochPlan.make(shards, epoch=2, seed=0, rank=Rank(2048, 4096), workers=16)
    state = _mid_epoch_state(plan, dict.fromkeys(shards, 10_000), with_shards=False)
    text = json.dumps(state)
    assert len(text) <= 16 * 1024, len(text)
    assert state["plan"]["shards_digest"] == shards_digest(reversed(shards)) and state["plan"]["shards_count"] == 100_000
    assert set(state["counts"]) == plan.own_paths()  # a cache's counts: only the rank's own shards'


def test_a_state_kept_by_digest_is_refused_over_another_shard_list_and_resumes_over_the_same_one():
    shards = [f"/data/s-{i:03d}.tar" for i in range(40)]
    plan = EpochPlan.make(shards, epoch=1, seed=0, rank=Rank(0, 1), workers=2)
    state = json.loads(json.dumps(_mid_epoch_state(plan, {}, with_shards=False)))
    settings = _settings_of(state)
    resume, epoch = plan_resume(state, settings, Rank(0, 1), list(reversed(shards)), False, False)
    assert epoch == 1 and resume.plan == plan and resume.delivered == [800, 800]
    with pytest.raises(SettingError, match="shard list changed .*40 shards then, 39 now.*by its digest only"):
        plan_resume(state, settings, Rank(0, 1), shards[1:], False, True)


def test_a_gathered_state_keeps_a_shard_list_once_and_gives_each_rank_its_own_back():
    shards = [f"/cache/shards/{i:04d}.tar" for i in range(64)]
    plans = [EpochPlan.make(shards, epoch=0, seed=1, rank=Rank(r, 4), workers=2) for r in range(4)]
    ranks = [_mid_epoch_state(p, {}, with_shards=False) for p in plans]
    lists = shared_lists(ranks, {plans[0].digest: plans[0].shards})
    gathered = json.loads(json.dumps({"format": RANKS_FORMAT, "ranks": ranks, "shards": lists}))
    assert list(gathered["shards"]) == [plans[0].digest]
    for r in range(4):
        own, elastic = own_state(gathered, Rank(r, 4), False)
        assert not elastic and own["plan"]["shards"] == shards
        assert EpochPlan.from_state(own["plan"]) == plans[r]


def test_a_state_saved_before_digests_with_its_shard_list_still_loads():
    shards = [f"/data/s-{i:03d}.tar" for i in range(10)]
    plan = EpochPlan.make(shards, epoch=0, seed=0, rank=Rank(0, 1), workers=2)
    state = json.loads(json.dumps(_mid_epoch_state(plan, {}, with_shards=True)))
    del state["plan"]["shards_digest"], state["plan"]["shards_count"]
    settings = _settings_of(state)
    resume, _ = plan_resume(state, settings, Rank(0, 1), shards, False, False)
    assert resume.plan == plan


def test_an_elastic_resume_replays_only_the_old_streams_of_the_ranks_own_new_share_and_loses_nothing(monkeypatch):
    """8 ranks x 2 workers, each stream 150 samples in, resumed on 4 ranks: a new rank's shards come from 2 old
    ranks (the same epoch order, split in half as many ways), so it replays their 4 streams, not all 16; across
    the new ranks every sample is delivered once, before or after."""
    from feedline.loader.plan import resume

    shards = [f"/data/s-{i:03d}.tar" for i in range(64)]
    counts = dict.fromkeys(shards, 100)
    old = []
    for r in range(8):
        plan = EpochPlan.make(shards, epoch=0, seed=3, rank=Rank(r, 8), workers=2)
        cursor = Cursor.start(2, [1, 1], [150, 150])
        state = make_state(plan, cursor, 0, {"seed": 3, "batch_size": 100, "drop_last": False, "shuffle": True,
                                             "shuffle_buffer": 0, "shuffle_block": 0, "workers": 2, "rank": r,
                                             "world_size": 8, "sources": None}, counts)
        old.append(json.loads(json.dumps(state)))
    replayed = []
    real_order = resume.order
    monkeypatch.setattr(resume, "order", lambda *a, **k: replayed.append(a[3]) or real_order(*a, **k))
    settings = {**{k: old[0][k] for k in old[0] if k not in ("plan", "counts", "per_worker", "batches",
                                                               "finished", "format", "next_epoch")},
                "world_size": 4}
    delivered = {(p, i) for p, v in resume.delivered_samples(old).items() for i in v}
    assert len(delivered) == 8 * 2 * 150
    replayed.clear()
    rest = []
    for r in range(4):
        plan = plan_resume(old, {**settings, "rank": r}, Rank(r, 4), shards, False, True)[0].plan
        if r == 0:
            assert len(replayed) == 4, replayed  # 2 old ranks x 2 workers
        rest += [(p, i) for a in plan.assignment for p in a for i in range(100) if i not in plan.skip.get(p, ())]
    assert len(rest) == len(set(rest)) and set(rest).isdisjoint(delivered)
    assert len(rest) + len(delivered) == 6400
