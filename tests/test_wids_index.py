"""A webdataset shard index (``widsindex create`` of the ``wids`` package) as ``shards=``: its shards, and the sample
counts it gives, so the plan and a mixture's draw read no index of a shard the rank does not read (issue 71)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from app.errors import SettingError
from app.formats.urls import ShardListError, local_shards, parse_index
from app.loader.loader import StagingLoader
from app.loader.plan.mixture import Source

from helpers import id_shards

SPEC = {"bin": ("uint8", (64,)), "cls": "int64"}
WIDSINDEX = os.path.join(os.path.dirname(sys.executable), "widsindex")


def _listed(folder: str, shards: int, per_shard: int, first_id: int = 0) -> str:
    """``shards`` id shards in ``folder`` and the shardindex.json `widsindex create` writes for them."""
    paths = id_shards(folder, shards=shards, per_shard=per_shard)
    if first_id:  # ids from first_id on (a second source's)
        for p in paths:
            os.unlink(p)
        from helpers import id_samples, write_tar
        paths = [write_tar(os.path.join(folder, f"ids-{k:04d}.tar"), id_samples(first_id + k * per_shard, per_shard))
                 for k in range(shards)]
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


def test_a_loader_plans_from_the_listed_counts_without_reading_every_index(tmp_path):
    index = _listed(str(tmp_path / "d"), shards=12, per_shard=10)
    with StagingLoader(index, batch_size=8, workers=2, spec=SPEC, device="cpu") as loader:
        assert len(loader) == 16  # 2 workers x 60 samples, 8 a batch
        read_here, _ = loader._pipeline.indexes.counts()
        assert read_here < 12  # only the start's probe read indexes; the count came from the listing
        assert _ids(loader) == list(range(120))
    shutil.copytree(tmp_path / "d", tmp_path / "e")  # new files: none of their indexes read in this process yet
    with StagingLoader(str(tmp_path / "e"), batch_size=8, workers=2, spec=SPEC, device="cpu") as folder:
        assert len(folder) == 16 and folder._pipeline.indexes.counts()[0] == 12  # the folder: every index read


def test_a_mixture_of_listed_sources_draws_from_their_counts(tmp_path):
    web = _listed(str(tmp_path / "web"), shards=10, per_shard=10)
    curated = _listed(str(tmp_path / "curated"), shards=10, per_shard=10, first_id=1000)
    sources = [Source("web", shards=web, weight=0.5), Source("curated", shards=curated, weight=0.5)]
    with StagingLoader(sources=sources, batch_size=10, workers=1, spec=SPEC, device="cpu", seed=3) as loader:
        assert len(loader) == 20
        assert loader._pipeline.indexes.counts()[0] < 20  # the draw read none; the probe its first shards
        ids = _ids(loader)
    assert len(ids) == 200 and len(set(ids)) == 200
    assert sum(i < 1000 for i in ids) == 100


def test_a_stale_listing_is_refused_naming_the_shard_and_the_fix(tmp_path):
    index = _listed(str(tmp_path / "d"), shards=2, per_shard=7)
    doc = json.loads(open(index).read())
    doc["shardlist"][0]["nsamples"] = 9
    with open(index, "w") as f:
        json.dump(doc, f)
    with pytest.raises(SettingError, match=r"ids-0000.tar holds 7 samples, but its listing says 9.*widsindex create"):
        StagingLoader(index, batch_size=8, workers=1, spec=SPEC, device="cpu")


def test_a_listing_with_a_base_resolves_its_urls_against_it(tmp_path):
    id_shards(str(tmp_path / "data" / "train"), shards=2, per_shard=3)
    index = tmp_path / "data" / "shardindex.json"
    index.write_text(json.dumps({"wids_version": 1, "base": "train/", "shardlist": [
        {"url": "ids-0000.tar", "nsamples": 3}, {"url": "ids-0001.tar", "nsamples": 3}]}))
    entries = local_shards([str(index)])
    assert [e.url for e in entries] == [str(tmp_path / "data" / "train" / f"ids-{k:04d}.tar") for k in range(2)]


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
    with pytest.raises(ShardListError, match="a remote index names remote shards only"):
        parse_index(json.dumps({"wids_version": 1, "shardlist": [{"url": "file:///etc/x.tar", "nsamples": 1}]}),
                    "https://host/data/shardindex.json")


def test_feedline_trains_progress_total_is_the_ranks_own_samples_from_the_listing(tmp_path):
    from app.loader.plan.rank import Rank
    from app.trainer.train import epoch_samples

    index = _listed(str(tmp_path / "d"), shards=5, per_shard=10)
    with StagingLoader(index, batch_size=5, workers=1, spec=SPEC, device="cpu", rank=Rank(1, 2)) as loader:
        it = iter(loader)
        ids = [int(i) for i in next(it)["cls"]]
        total = epoch_samples(loader)
        ids += [int(i) for b in it for i in b["cls"]]
    assert total == len(ids) and len(ids) in (20, 30)  # its own 2 or 3 shards of 10, not half of all 50
