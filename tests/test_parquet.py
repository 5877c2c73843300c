"""Parquet files read as they are (issue 36): files Hugging Face ``datasets`` (``to_parquet``) and pyarrow wrote,
every field compared with what the writer was given; row groups; a broken file; resume; the sidecar's refusal."""

import base64
import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import id_shards, peer_written, trained_samples

from feedline import Source, StagingLoader
from feedline.formats import parquet, parquet_pages

@pytest.fixture(scope="module")
def hf_written(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    return d, peer_written("parquet", d)


def epoch(shards, **kw):
    """Every sample of one epoch: {key (file/row): the sample's fields}."""
    out = {}
    with StagingLoader(shards, batch_size=5, workers=2, **kw) as loader:
        for batch in loader:
            for i, key in enumerate(batch["__key__"]):
                out[key] = {name: (v[i].numpy() if hasattr(v[i], "numpy") else v[i])
                            for name, v in batch.items() if not name.startswith("__")}
        stats = loader.stats()
    return out, stats


def test_every_field_of_every_row_hugging_face_datasets_wrote_arrives_as_it_was_given(hf_written):
    d, given = hf_written
    got, _ = epoch(str(d / "*.parquet"), decode={"image": bytes})  # the Image column's bytes, as written
    assert len(got) == 24
    for name, rows in given["files"].items():
        for n, want in enumerate(rows):
            s = got[f"{name[: -len('.parquet')]}/{n:08d}"]
            assert s["image"] == base64.b64decode(want["image"])
            assert s["label"] == want["label"] and s["label"].dtype == np.int64
            assert s["caption"] == want["caption"]
            k = int(s["tokens_len"])
            assert s["tokens"][:k].tolist() == want["tokens"]
            assert s["score"] == np.float32(want["score"]) and s["score"].dtype == np.float32


def test_a_hugging_face_image_column_decodes_as_an_image(hf_written):
    from PIL import Image

    d, given = hf_written
    got, _ = epoch(str(d / "part-001.parquet"), fields=["image", "label"])
    for n, want in enumerate(given["files"]["part-001.parquet"]):
        s = got[f"part-001/{n:08d}"]
        pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(want["image"]))).convert("RGB"))
        assert np.array_equal(s["image"], pixels) and set(s) == {"image", "label"}


def pyarrow_rows(path, ids, row_group_size):
    """A file pyarrow writes in row groups of ``row_group_size``: an id, 64 payload bytes, a list, a name."""
    table = pa.table({"cls": pa.array(list(ids), pa.int64()),
                      "bin": pa.array([bytes([i % 256]) * 64 for i in ids], pa.binary()),
                      "points": pa.array([[float(i)] * (i % 4) for i in ids], pa.list_(pa.float32())),
                      "Name": pa.array([f"row {i}" for i in ids], pa.string())})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def test_rows_across_row_groups_read_as_pyarrow_wrote_them(tmp_path):
    path = pyarrow_rows(tmp_path / "p.parquet", range(50), row_group_size=7)
    assert pq.ParquetFile(path).metadata.num_row_groups == 8
    got, _ = epoch(path, spec={"cls": "int64", "bin": ("uint8", (64,)),
                               "points": {"dtype": "float32", "shape": [8], "variable": True}, "name": "text"})
    assert sorted(int(s["cls"]) for s in got.values()) == list(range(50))
    for s in got.values():
        i = int(s["cls"])
        assert s["bin"].tolist() == [i % 256] * 64 and s["name"] == f"row {i}"
        assert s["points"][: int(s["points_len"])].tolist() == [float(i)] * (i % 4)


def test_the_row_groups_a_worker_keeps_stay_within_their_bound(tmp_path):
    path = pyarrow_rows(tmp_path / "p.parquet", range(40), row_group_size=10)
    groups = parquet.RowGroups(max_bytes=1)  # less than one group: only the one in use is kept
    data = memoryview(open(path, "rb").read())
    for g in (0, 1, 2, 1):
        assert groups.table(path, data, g, None).num_rows == 10
        assert len(groups._groups) == 1


def test_the_dictionary_page_size_is_read_from_its_header_as_pyarrow_wrote_it(tmp_path):
    words = [f"word {i:04d}" for i in range(300)]
    pq.write_table(pa.table({"w": pa.array([words[i % 300] for i in range(3000)])}), tmp_path / "w.parquet")
    data = (tmp_path / "w.parquet").read_bytes()
    chunk = pq.read_metadata(tmp_path / "w.parquet").row_group(0).column(0)
    assert chunk.has_dictionary_page
    assert parquet_pages.dictionary_page_bytes(data, chunk.dictionary_page_offset) == sum(4 + len(w) for w in words)
    assert parquet_pages.dictionary_page_bytes(data, chunk.data_page_offset) is None  # a data page: not a dictionary's


def test_large_distinct_values_read_densely_and_a_repeated_value_as_a_dictionary(tmp_path):
    rng = np.random.default_rng(0)
    blobs = [rng.bytes(1 << 20) for _ in range(8)]
    # written a row at a time, as Hugging Face datasets writes: past the first, pyarrow's 1 MiB dictionary is full and
    # the rest go to plain pages (read as a dictionary, each would be hashed into one: a third of the samples/s)
    pq.write_table(pa.table({"bin": pa.array(blobs)}), tmp_path / "large.parquet", write_batch_size=1)
    # a dictionary of a 30 kB value and a short one: 4000 rows could hold 120 MB in place (they hold 70 kB)
    repeated = pa.DictionaryArray.from_arrays(pa.array([0] + [1] * 3999, pa.int32()), pa.array([b"y" * 30000, b"z"]))
    pq.write_table(pa.table({"bin": repeated}), tmp_path / "repeated.parquet", store_schema=False)
    groups = parquet.RowGroups(max_bytes=32 << 20)  # the 8 MiB of "large" read densely fit, 120 MB would not
    for name, kind in (("large", pa.binary()), ("repeated", pa.dictionary(pa.int32(), pa.binary()))):
        data = memoryview((tmp_path / f"{name}.parquet").read_bytes())
        assert groups.table(name, data, 0, None, bound=1 << 20).schema.field("bin").type == kind, name
    assert [parquet.read_row("repeated", data, (0, i), 1 << 20)["bin"][1] for i in (0, 1)] == [b"y" * 30000, b"z"]
    # in a list, a row may hold any number of values: only the dictionary bounds them
    pq.write_table(pa.table({"bin": pa.array([[b] for b in blobs])}), tmp_path / "lists.parquet", write_batch_size=1)
    data = memoryview((tmp_path / "lists.parquet").read_bytes())
    assert groups.table("lists", data, 0, None, bound=1 << 20).schema.field("bin").type.value_type == kind


def test_a_broken_file_among_good_ones_is_skipped_and_counted(tmp_path):
    good = pyarrow_rows(tmp_path / "good.parquet", range(10), row_group_size=4)
    data = open(good, "rb").read()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])  # no footer
    got, stats = epoch([good, str(tmp_path / "cut.parquet")], fields=["cls"], max_sample_errors=3)
    assert sorted(int(s["cls"]) for s in got.values()) == list(range(10))
    assert stats.sample_errors_total["bad_shard"] == 1


def test_a_state_saved_mid_epoch_over_parquet_files_resumes_exactly(tmp_path):
    from test_resume import run

    os.makedirs(tmp_path / "ids")
    for s in range(4):
        pyarrow_rows(tmp_path / "ids" / f"ids-{s}.parquet", range(s * 30, s * 30 + 30), row_group_size=8)
    shards = str(tmp_path / "ids" / "*.parquet")
    full = run(tmp_path, shards=shards, workers=2, saves={"0:7": str(tmp_path / "s.json")})
    per_epoch = len(full) // 2
    assert sorted(i for b in full[:per_epoch] for i in b) == list(range(120))
    rest = run(tmp_path, shards=shards, workers=2, states=[str(tmp_path / "s.json")])
    assert full[:7] + rest == full


def large_rows(path, ids, row_group_size):
    """Rows of 20 KiB (an image's size): past GROUP_SPLIT_ROW_BYTES, so a part of the file is whole row groups."""
    table = pa.table({"cls": pa.array(list(ids), pa.int64()),
                      "bin": pa.array([bytes([i % 256]) * 64 for i in ids], pa.binary()),
                      "jpg": pa.array([bytes([i % 256]) * (20 << 10) for i in ids], pa.binary())})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def test_the_parts_of_a_parquet_file_of_large_rows_are_whole_row_groups_and_small_rows_every_nth_row(tmp_path):
    from feedline.loader.plan.epoch_plan import part_indexes, row_groups_of

    big = large_rows(tmp_path / "big.parquet", range(40), row_group_size=8)
    small = pyarrow_rows(tmp_path / "small.parquet", range(40), row_group_size=8)
    assert row_groups_of(small) is None  # small rows: every worker may decode every group, for a wider mix
    groups = row_groups_of(big)
    parts = [set(part_indexes(big, 40, (k, 3), groups)) for k in range(3)]
    assert set().union(*parts) == set(range(40)) and sum(map(len, parts)) == 40  # disjoint, covering
    for part in parts:  # no row group is in two parts: each is decoded by one worker
        assert all({groups[i] for i in part}.isdisjoint({groups[i] for i in other}) for other in parts
                   if other is not part)


def test_parquet_files_of_large_rows_read_every_row_once_and_resume_exactly_and_elastically(tmp_path):
    from test_resume import run

    os.makedirs(tmp_path / "big")
    for s in range(3):  # the epoch shuffle: every file split between the workers, by whole row groups
        large_rows(tmp_path / "big" / f"big-{s}.parquet", range(s * 24, s * 24 + 24), row_group_size=5)
    shards = str(tmp_path / "big" / "*.parquet")
    full = run(tmp_path, shards=shards, workers=2, saves={"0:5": str(tmp_path / "s.json")})
    per_epoch = len(full) // 2
    assert sorted(i for b in full[:per_epoch] for i in b) == list(range(72))
    assert run(tmp_path, shards=shards, workers=2, states=[str(tmp_path / "s.json")]) == full[5:]
    rest = run(tmp_path, shards=shards, workers=1, states=[str(tmp_path / "s.json")], elastic=True, epochs=1)
    assert sorted([i for b in full[:5] for i in b] + [i for b in rest for i in b]) == list(range(72))


def test_a_mixture_of_tar_and_parquet_sources(tmp_path):
    tars = id_shards(str(tmp_path / "tar"), shards=2, per_shard=20)
    rows = pyarrow_rows(tmp_path / "p.parquet", range(100, 140), row_group_size=16)
    mix = [Source("tar", shards=tars, weight=0.5), Source("parquet", shards=rows, weight=0.5)]
    got = {}
    with StagingLoader(sources=mix, batch_size=8, workers=2, fields={"id": "cls", "payload": "bin"},
                       spec={"id": "int64", "payload": ("uint8", (64,))}) as loader:
        for batch in loader:
            got.update(zip(batch["id"].tolist(), batch["__source__"]))
    assert got == {**{i: "tar" for i in range(40)}, **{i: "parquet" for i in range(100, 140)}}


def test_feedline_train_trains_on_hugging_face_parquet_files(hf_written, tmp_path):
    d, _ = hf_written
    assert trained_samples(str(d / "*.parquet"), tmp_path) == [24]


def test_a_binary_column_bound_for_a_slot_is_a_view_of_the_row_group_read_in_batches_not_a_copy(tmp_path):
    values = [os.urandom(300_000) for _ in range(6)] + [None, b""]
    pq.write_table(pa.table({"bin": pa.array(values, pa.binary())}), tmp_path / "v.parquet", row_group_size=8)
    data = memoryview((tmp_path / "v.parquet").read_bytes())
    groups = parquet.RowGroups()
    table = groups.table("v.parquet", data, 0, None)
    assert table.column(0).num_chunks > 1  # ~1 MiB batches: no buffer grown to the group's size
    for i, value in enumerate(values):
        kind, got = parquet.read_row("v.parquet", data, (0, i), 1 << 20, views={"bin"})["bin"]
        assert (None if got is None else bytes(got)) == value
        if value:
            assert isinstance(got, memoryview) and isinstance(got.obj, pa.Buffer)  # the batch's own buffer
