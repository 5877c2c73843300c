"""Well-mixed batches from a dataset written in class order (issue 50): the default shuffle mixes the whole epoch.

100 classes x 200 samples, written in class order in shards of 1000 (a folder per class packed in sorted order),
read one epoch at the loader's defaults, batch 32, 2 workers — the case the issue measured.
"""

import pytest
from helpers import write_tar

from feedline import StagingLoader
from feedline.bench.shuffle_quality import expected_distinct, measure, spearman

CLASSES, PER_CLASS, PER_SHARD, BATCH = 100, 200, 1000, 32


@pytest.fixture(scope="module")
def sorted_shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("sorted")
    samples = [(f"c{c:03d}-{i:03d}", {"cls": str(c).encode()}) for c in range(CLASSES) for i in range(PER_CLASS)]
    return [write_tar(str(d / f"sorted-{k:03d}.tar"), samples[k * PER_SHARD:(k + 1) * PER_SHARD])
            for k in range(len(samples) // PER_SHARD)]


def position(key: str) -> int:
    c, i = key.split("-")
    return int(c[1:]) * PER_CLASS + int(i)


def epoch(shards, **settings):
    with StagingLoader(shards, batch_size=BATCH, workers=2, fields=["cls"], spec={"cls": "int64"},
                       **settings) as loader:
        batches = [(b["cls"].tolist(), [position(k) for k in b["__key__"]]) for b in loader]
    labels = [c for c in range(CLASSES) for _ in range(PER_CLASS)]
    return measure([b for b, _ in batches], [p for _, ps in batches for p in ps], labels, BATCH), \
        sorted(p for _, ps in batches for p in ps)


def assert_mixed_as_uniform(shards) -> None:
    """One epoch of record shards whose rows hold `cls` and their written position `pos`: every row once, batches
    as mixed as a uniform shuffle's."""
    with StagingLoader(shards, batch_size=BATCH, workers=2, fields=["cls", "pos"],
                       spec={"cls": "int64", "pos": "int64"}) as loader:
        batches = [(b["cls"].tolist(), b["pos"].tolist()) for b in loader]
    labels = [c for c in range(CLASSES) for _ in range(PER_CLASS)]
    q = measure([b for b, _ in batches], [p for _, ps in batches for p in ps], labels, BATCH)
    assert sorted(p for _, ps in batches for p in ps) == list(range(CLASSES * PER_CLASS))
    assert q.distinct_ratio >= 0.95 and abs(q.spearman) <= 0.05, q


def test_the_default_shuffle_mixes_a_class_sorted_dataset_as_a_uniform_permutation_would(sorted_shards):
    q, seen = epoch(sorted_shards)
    assert seen == list(range(CLASSES * PER_CLASS))  # every sample once
    assert q.distinct_ratio >= 0.95, q
    assert abs(q.spearman) <= 0.05, q


def test_each_epoch_is_mixed_in_another_order_and_the_same_seed_gives_the_same_epochs(sorted_shards):
    def two_epochs(seed):
        with StagingLoader(sorted_shards, batch_size=BATCH, workers=2, fields=["cls"], spec={"cls": "int64"},
                           seed=seed) as loader:
            return [[position(k) for b in loader for k in b["__key__"]] for _ in range(2)]

    first, second = two_epochs(0)
    assert sorted(first) == sorted(second) == list(range(CLASSES * PER_CLASS))
    assert first != second and abs(spearman(first, second)) <= 0.05  # not the same order, nor a close one
    assert two_epochs(0) == [first, second] and two_epochs(1)[0] != first


def test_the_stream_shuffle_is_kept_for_those_who_rely_on_it_and_mixes_less(sorted_shards):
    q, seen = epoch(sorted_shards, shuffle="stream")
    assert seen == list(range(CLASSES * PER_CLASS))
    assert q.distinct_ratio < 0.6, q  # webdataset's scheme: a batch holds the few classes of a shard or two


def test_a_block_of_fewer_shards_mixes_fewer_places_at_once(sorted_shards):
    q, _ = epoch(sorted_shards, shuffle_block=2)
    wide, _ = epoch(sorted_shards)
    assert q.distinct < wide.distinct


def test_the_uniform_expectation_and_spearman_are_exact_on_small_cases():
    assert expected_distinct([1, 1], 2) == pytest.approx(2.0)
    assert expected_distinct([2, 2], 2) == pytest.approx(1 + 2 / 3)  # same class with probability 1/3
    assert spearman([0, 1, 2, 3], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([0, 1, 2, 3], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_tfrecord_files_written_in_class_order_are_mixed_as_tar_shards_are(tmp_path):
    from test_tfrecord import write_records

    shards = []
    for k in range(CLASSES * PER_CLASS // PER_SHARD):  # record n of the dataset: class n // PER_CLASS
        rows = range(k * PER_SHARD, (k + 1) * PER_SHARD)
        shards.append(str(write_records(tmp_path / f"sorted-{k:03d}.tfrecord",
                                        [{"cls": ("int64", [n // PER_CLASS]), "pos": ("int64", [n])} for n in rows])))
    assert_mixed_as_uniform(shards)


def test_parquet_files_written_in_class_order_are_mixed_a_window_of_row_groups_at_a_time(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = []
    for k in range(CLASSES * PER_CLASS // PER_SHARD):  # row n of the dataset: class n // PER_CLASS
        rows = list(range(k * PER_SHARD, (k + 1) * PER_SHARD))
        path = str(tmp_path / f"sorted-{k:03d}.parquet")
        pq.write_table(pa.table({"cls": [n // PER_CLASS for n in rows], "pos": rows}), path, row_group_size=250)
        shards.append(path)
    assert_mixed_as_uniform(shards)
