"""Compressed ``shards=`` under several ranks (issue 71): each rank decompresses the shards it reads, not every
shard of the list, and what it reads is exact (the split, an elastic resume's replay)."""

import gzip
import json
import os

from feedline.formats.urls import shard_stem
from feedline.loader.loader import StagingLoader
from feedline.loader.plan.rank import Rank

from helpers import id_shards

SPEC = {"bin": ("uint8", (64,)), "cls": "int64"}


def _gz_shards(folder: str, shards: int, per_shard: int) -> list[str]:
    out = []
    for path in id_shards(folder, shards=shards, per_shard=per_shard):
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            g.write(f.read())
        os.unlink(path)
        out.append(path + ".gz")
    return out


def _copies(folder) -> set[str]:
    """The sources (by stem) whose plain copies are in ``folder``."""
    return {name.rsplit("-", 1)[0] for name in os.listdir(folder) if name.endswith(".tar")}


def test_each_rank_decompresses_the_shards_it_reads_not_the_whole_list(tmp_path):
    shards = _gz_shards(str(tmp_path / "gz"), shards=20, per_shard=5)
    ids = []
    for r in range(2):
        inflated = tmp_path / f"inflated-{r}"
        with StagingLoader(shards, batch_size=5, workers=2, spec=SPEC, device="cpu", rank=Rank(r, 2),
                           decompress_dir=str(inflated)) as loader:
            ids += [int(i) for b in loader for i in b["cls"]]
            own = {shard_stem(p) for p in loader.plan.own_paths()}
        probed = {shard_stem(p) for p in sorted(shards)[:8]}  # the start's layout probe reads the first shards
        copies = _copies(inflated)
        assert own <= copies <= own | probed and len(copies) < 20
    assert sorted(ids) == list(range(100))  # the two ranks' shares: every sample once


def test_an_elastic_resume_over_compressed_shards_delivers_every_sample_once(tmp_path):
    shards = _gz_shards(str(tmp_path / "gz"), shards=8, per_shard=10)
    head, states = [], []
    for r in range(2):
        with StagingLoader(shards, batch_size=5, workers=2, spec=SPEC, device="cpu", rank=Rank(r, 2), seed=4,
                           decompress_dir=str(tmp_path / f"inflated-{r}")) as loader:
            it = iter(loader)
            head += [int(i) for _ in range(3) for i in next(it)["cls"]]
            states.append(json.loads(json.dumps(loader.state_dict())))
    # a new run of one rank, with copies of nothing yet: the replay counts the old streams' shards from their copies
    with StagingLoader(shards, batch_size=5, workers=1, spec=SPEC, device="cpu", seed=4,
                       decompress_dir=str(tmp_path / "inflated-new")) as loader:
        loader.load_state_dict(states, elastic=True)
        rest = [int(i) for b in loader for i in b["cls"]]
    assert sorted(head + rest) == list(range(80))


def test_a_start_refused_for_want_of_room_keeps_the_loaded_state_for_the_next(tmp_path):
    import pytest

    from feedline.errors import SettingError

    shards = _gz_shards(str(tmp_path / "gz"), shards=4, per_shard=10)
    with StagingLoader(shards, batch_size=5, workers=1, spec=SPEC, device="cpu", seed=2,
                       decompress_dir=str(tmp_path / "first")) as loader:
        it = iter(loader)
        head = [int(i) for _ in range(3) for i in next(it)["cls"]]
        state = json.loads(json.dumps(loader.state_dict()))
    blocked = tmp_path / "second"
    with StagingLoader(shards, batch_size=5, workers=1, spec=SPEC, device="cpu", seed=2,
                       decompress_dir=str(blocked)) as loader:
        loader.load_state_dict(state)
        for p in blocked.iterdir():  # the probe's copies gone, and the folder a file: no copy can be made
            p.unlink()
        blocked.rmdir()
        blocked.write_text("not a folder")
        with pytest.raises(SettingError, match="decompress_dir"):
            next(iter(loader))
        blocked.unlink()  # room again: the same start goes on from the state
        rest = [int(i) for b in loader for i in b["cls"]]
    assert sorted(head + rest) == list(range(40))
