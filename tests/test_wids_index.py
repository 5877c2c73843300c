"""A webdataset shard index (``widsindex create`` of the ``wids`` package) as ``shards=``: its shards, and the sample
counts it gives, so the plan and a mixture's draw read no index of a shard the rank does not read (issue 71)."""

import fcntl
import json
import os
import subprocess
import sys

import pytest

from feedline.errors import SettingError
from feedline.formats import shard_index
from feedline.formats.urls import ShardListError, local_shards, parse_index
from feedline.loader.loader import StagingLoader
from feedline.loader.plan.mixture import Source
from feedline.loader.plan.rank import Rank

from helpers import id_shards

SPEC = {"bin": ("uint8", (64,)), "cls": "int64"}
WIDSINDEX = os.path.join(os.path.dirname(sys.executable), "widsindex")
# `widsindex create` copies each shard to the fixed path /tmp/shard.tar and counts that copy, so two runs at once
# (two xdist workers) count each other's shards: seen in CI as a listing of 7 samples for a shard of 5
TOOL_LOCK = "/tmp/feedline-tests-widsindex.lock"


def _listed(folder: str, shards: int, per_shard: int, first_id: int = 0) -> str:
    """``shards`` id shards in ``folder`` and the shardindex.json `widsindex create` writes for them."""
    paths = id_shards(folder, shards=shards, per_shard=per_shard)
    if first_id:  # ids from first_id on (a second source's)
        for p in paths:
            os.unlink(p)
        from helpers import id_samples, write_tar
        paths = [write_tar(os.path.join(folder, f"ids-{k:04d}.tar"), id_samples(first_id + k * per_shard, per_shard))
                 for k in range(shards)]
    with open(TOOL_LOCK, "a") as lock:  # the tool copies every shard to /tmp/shard.tar to count it: one at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        out = subprocess.run([WIDSINDEX, "create", *[os.path.basename(p) for p in paths]], cwd=folder,
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return os.path.join(folder, "shardindex.json")


def _ids(loader) -> list[int]:
    return sorted(int(i) for b in loader for i in b["cls"])


def test_widsindex_output_names_its_shards_with_their_sample_counts(tmp_path):
    index = _listed(str(tmp_path / "d"), shards=3, per_shard=7)
    entries = local_shards([index])
    assert [e.url for e in entries] == [str(tmp_path / "d" / f"ids-{k:04d}.tar") for k in range(3)]
    assert [e.samples for e in entries] == [7, 7, 7] and all(e.size == 20480 for e in entries)


def test_a_rank_reads_the_indexes_of_its_own_shards_only(tmp_path):
    ids = []
    for r in range(2):
        index = _listed(str(tmp_path / f"rank-{r}"), shards=24, per_shard=10)  # (files new to this process)
        with StagingLoader(index, batch_size=8, workers=2, spec=SPEC, device="cpu", rank=Rank(r, 2)) as loader:
            assert len(loader) == 16  # 2 workers x 60 samples, 8 a batch
            own = loader._next_plan().own_paths()
            probed = set(sorted(str(p) for p in (tmp_path / f"rank-{r}").glob("*.tar"))[:8])
            assert own <= _read_here(tmp_path / f"rank-{r}") <= own | probed  # checked against the listing
            ids += _ids(loader)
    assert sorted(ids) == list(range(240))  # the two ranks: every sample once


def _mixture(tmp_path, listed: bool) -> list[Source]:
    web = _listed(str(tmp_path / "web"), shards=20, per_shard=5)
    curated = _listed(str(tmp_path / "curated"), shards=20, per_shard=5, first_id=1000)
    if not listed:
        web, curated = os.path.dirname(web), os.path.dirname(curated)
    return [Source("web", shards=web, weight=0.5), Source("curated", shards=curated, weight=0.5)]


def _read_here(root) -> set[str]:
    """The shards under ``root`` whose indexes this process read (``load_index`` keeps them)."""
    return {key[0] for key in shard_index._MEMO._kept if key[0].startswith(str(root))}


@pytest.mark.parametrize("listed", [True, False])
def test_a_mixtures_draw_reads_no_index_of_other_ranks_shards_when_its_sources_are_listed(tmp_path, listed):
    ids = []
    for r in range(2):
        run = tmp_path / f"rank-{r}"  # new files for each rank: none of their indexes read in this process yet
        with StagingLoader(sources=_mixture(run, listed), batch_size=5, workers=1, spec=SPEC, device="cpu",
                           seed=3, rank=Rank(r, 2)) as loader:
            assert len(loader) == 20
            read = _read_here(run)
            own = {p for p in loader._next_plan().own_paths()}
            ids += _ids(loader)
        if listed:  # its own shards, and the first ones the start's probe reads: not the 40 of both sources
            probed = set(sorted(str(p) for p in run.glob("*/*.tar"))[:8])
            assert own <= read <= own | probed and len(read) < 40
        else:
            assert len(read) == 40  # the draw counted every shard of both sources
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 200 and sum(i < 1000 for i in ids) == 100


def test_a_listing_out_of_date_past_the_first_shards_is_refused_before_an_epoch_reads_it(tmp_path):
    index = _listed(str(tmp_path / "d"), shards=12, per_shard=5)
    doc = json.loads(open(index).read())
    doc["shardlist"][11]["nsamples"] = 6  # past the 8 shards the start reads
    with open(index, "w") as f:
        json.dump(doc, f)
    with StagingLoader(index, batch_size=5, workers=1, spec=SPEC, device="cpu") as loader:
        with pytest.raises(SettingError, match=r"ids-0011.tar holds 5 samples, but its listing says 6"):
            next(iter(loader))


def test_a_stale_listing_is_refused_naming_the_shard_and_the_fix(tmp_path):
    index = _listed(str(tmp_path / "d"), shards=2, per_shard=7)
    doc = json.loads(open(index).read())
    doc["shardlist"][0]["nsamples"] = 9
    with open(index, "w") as f:
        json.dump(doc, f)
    with pytest.raises(SettingError, match=r"ids-0000.tar holds 7 samples, but its listing says 9.*widsindex create"):
        StagingLoader(index, batch_size=8, workers=1, spec=SPEC, device="cpu")


@pytest.mark.parametrize("base", ["train/", "train", "file://{root}/data/train"])
def test_a_listing_with_a_base_resolves_its_urls_against_that_folder(tmp_path, base):
    id_shards(str(tmp_path / "data" / "train"), shards=2, per_shard=3)
    index = tmp_path / "data" / "shardindex.json"
    index.write_text(json.dumps({"wids_version": 1, "base": base.format(root=tmp_path), "shardlist": [
        {"url": "ids-0000.tar", "nsamples": 3}, {"url": "ids-0001.tar", "nsamples": 3}]}))
    entries = local_shards([str(index)])
    assert [e.url for e in entries] == [str(tmp_path / "data" / "train" / f"ids-{k:04d}.tar") for k in range(2)]


def test_a_remote_listings_base_without_a_slash_is_a_folder():
    text = json.dumps({"wids_version": 1, "base": "https://host/dir", "shardlist": [{"url": "a-0.tar", "nsamples": 1}]})
    assert [e.url for e in parse_index(text, "https://host/x/shardindex.json")] == ["https://host/dir/a-0.tar"]


@pytest.mark.parametrize("doc, says", [
    ({"wids_version": 1}, "no shardlist"),
    ({"wids_version": 2, "shardlist": []}, "wids_version 2 is not 1"),
    ({"wids_version": 1, "shardlist": [{"url": "a.tar", "nsamples": -1}]}, r"shardlist\[0\]: nsamples is -1"),
    ({"wids_version": 1, "shardlist": [{"url": "a.tar"}]}, r"shardlist\[0\]: nsamples is None"),
    ({"wids_version": 1, "shardlist": [], "datasets": [{"source_url": "x.json"}]}, "sub-datasets"),
])
def test_a_json_index_that_is_not_a_wids_shard_index_is_refused_saying_why(doc, says):
    with pytest.raises(ShardListError, match=r"index /d/shardindex.json: .*" + says):
        parse_index(json.dumps(doc), "/d/shardindex.json")


def test_a_remote_wids_index_names_remote_shards_beside_it():
    text = json.dumps({"wids_version": 1, "shardlist": [{"url": "a-0.tar", "nsamples": 5}]})
    [entry] = parse_index(text, "https://host/data/shardindex.json")
    assert entry.url == "https://host/data/a-0.tar" and entry.samples == 5
    with pytest.raises(ShardListError, match=r"shardlist\[0\]: .* a remote index names remote shards only"):
        parse_index(json.dumps({"wids_version": 1, "shardlist": [{"url": "file:///etc/x.tar", "nsamples": 1}]}),
                    "https://host/data/shardindex.json")


def test_feedline_trains_progress_total_is_the_ranks_own_samples_from_the_listing(tmp_path):
    from feedline.trainer.train import epoch_samples

    index = _listed(str(tmp_path / "d"), shards=5, per_shard=10)
    with StagingLoader(index, batch_size=5, workers=1, spec=SPEC, device="cpu", rank=Rank(1, 2)) as loader:
        it = iter(loader)
        ids = [int(i) for i in next(it)["cls"]]
        total = epoch_samples(loader)
        ids += [int(i) for b in it for i in b["cls"]]
    assert total == len(ids) and len(ids) in (20, 30)  # its own 2 or 3 shards of 10, not half of all 50
