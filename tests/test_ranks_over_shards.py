"""More ranks than shards (issue 71, part 6): a growing cache is waited for until every rank has a shard of its own;
a source that will never hold one a rank is refused at start; never an epoch in which a rank has no batch."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import id_shards, publish_copy, shard_bytes

from feedline import SettingError, StagingLoader
from feedline.cache.source import CacheWaitTimeout
from feedline.cache.store import CacheStore
from feedline.loader.plan.rank import Rank

ID_SPEC = {"cls": "int64", "bin": ("uint8", (64,))}


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "remote"
    id_shards(str(d), shards=3, per_shard=8)
    return d


def test_a_growing_cache_with_fewer_shards_than_ranks_is_waited_for_until_each_rank_has_one(tmp_path, data):
    cache = str(tmp_path / "cache")
    store = CacheStore(cache, 10 * shard_bytes(data))
    store.recover()
    publish_copy(store, data, 0)

    def later():
        time.sleep(1.0)
        publish_copy(store, data, 1)
        publish_copy(store, data, 2)

    publisher = threading.Thread(target=later)
    publisher.start()
    t0 = time.monotonic()
    try:
        with StagingLoader(cache=cache, batch_size=4, workers=1, spec=ID_SPEC, rank=Rank(2, 3), wait_timeout=30,
                           equal_batches="off") as loader:
            waited = time.monotonic() - t0
            batches = [b["cls"].tolist() for b in loader]
    finally:
        publisher.join()
    assert waited >= 0.9  # it started once the third shard was in, not with one shard for three ranks
    ids = sorted(i for b in batches for i in b)
    assert len(ids) == 8 and len({i // 8 for i in ids}) == 1  # one shard of its own, whole


def test_a_cache_that_holds_the_whole_source_in_fewer_shards_than_ranks_is_refused_naming_both(tmp_path, data):
    cache = str(tmp_path / "cache")
    store = CacheStore(cache, 10 * shard_bytes(data), source_ids=frozenset({"ids-0000", "ids-0001"}))
    store.recover()
    publish_copy(store, data, 0)
    publish_copy(store, data, 1)
    with pytest.raises(SettingError, match=r"2 shard\(s\) \(the whole source\) for 3 ranks: rank 0 would get none"):
        StagingLoader(cache=cache, batch_size=4, workers=1, spec=ID_SPEC, rank=Rank(0, 3), wait_timeout=10)


def test_a_growing_cache_that_never_holds_a_shard_a_rank_says_why_it_waited(tmp_path, data):
    cache = str(tmp_path / "cache")
    store = CacheStore(cache, 10 * shard_bytes(data))
    store.recover()
    publish_copy(store, data, 0)
    with pytest.raises(CacheWaitTimeout, match="fewer than 4: one for each of the 4 ranks that split it"):
        StagingLoader(cache=cache, batch_size=4, workers=1, spec=ID_SPEC, rank=Rank(1, 4), wait_timeout=1)
