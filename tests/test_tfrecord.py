"""TFRecord shards read as they are (issue 36): files TensorFlow's own TFRecordWriter made, every field compared
with what the writer was given; corrupt records counted, naming file and record; gzip; resume."""

import base64
import io
import os
import struct

import numpy as np
import pytest

from helpers import peer_written, trained_samples

from feedline import StagingLoader
from feedline.formats import tfrecord
from feedline.formats.shard_index import ShardError, build_index

# in one xdist worker: TensorFlow starts once to write the module's files
pytestmark = pytest.mark.xdist_group("tfrecord")

def tf_written(directory, *extra):
    return peer_written("tfrecord", directory, *extra)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Files TensorFlow wrote, plain in the folder and GZIP'd in its gz/ (one TensorFlow start)."""
    d = tmp_path_factory.mktemp("tf")
    return d, tf_written(d, "--gzip", str(d / "gz"))


def epoch(shards, **kw):
    """Every sample of one epoch: {key (file/ordinal): the sample's fields}."""
    out = {}
    with StagingLoader(shards, batch_size=5, workers=2, **kw) as loader:
        for batch in loader:
            n = len(batch["__key__"])
            for i in range(n):
                fields = {}
                for name, value in batch.items():
                    if name.startswith("__"):
                        continue
                    v = value[i]
                    fields[name] = v.numpy() if hasattr(v, "numpy") else v
                out[batch["__key__"][i]] = fields
        stats = loader.stats()
    return out, stats


def test_every_field_of_every_record_tensorflow_wrote_arrives_as_it_was_given(written):
    d, given = written
    got, _ = epoch(str(d / "*.tfrecord"), decode={"image/encoded": bytes, "caption": bytes})
    assert len(got) == sum(len(r) for r in given["files"].values()) == 24
    for name, records in given["files"].items():
        for n, want in enumerate(records):
            s = got[f"{name[: -len('.tfrecord')]}/{n:08d}"]
            assert s["image/encoded"] == base64.b64decode(want["image/encoded"])  # the JPEG's bytes, as written
            assert s["image/class/label"] == want["image/class/label"]
            assert s["image/class/label"].dtype == np.int64
            k = int(s["image/object/bbox_len"])
            assert k == len(want["image/object/bbox"])
            np.testing.assert_array_equal(s["image/object/bbox"][:k], np.float32(want["image/object/bbox"]))
            assert s["tokens"].tolist() == want["tokens"]
            assert s["caption"] == want["caption"].encode()
            assert [bytes(t) for t in s["tags"]] == [t.encode() for t in want["tags"]]
            assert s["score"] == np.float32(want["score"])


def test_an_image_feature_decodes_as_an_image(written):
    from PIL import Image

    d, given = written
    got, _ = epoch(str(d / "part-000.tfrecord"), fields={"image": "image/encoded", "label": "image/class/label"})
    for n, want in enumerate(given["files"]["part-000.tfrecord"]):
        s = got[f"part-000/{n:08d}"]
        pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(want["image/encoded"]))).convert("RGB"))
        assert s["image"].shape == (48, 64, 3) and np.array_equal(s["image"], pixels)
        assert s["label"] == want["image/class/label"] and set(s) == {"image", "label"}


def test_gzip_compressed_tfrecords_read_as_the_plain_ones(tmp_path, written):
    d, given = written
    assert sorted(os.listdir(d / "gz")) == sorted(f"{name}.gz" for name in given["files"])
    plain, _ = epoch(str(d / "*.tfrecord"), fields=["tokens", "image/class/label"])
    packed, _ = epoch(str(d / "gz" / "*.tfrecord.gz"), fields=["tokens", "image/class/label"],
                      decompress_dir=str(tmp_path / "plain"))
    assert sorted((int(s["image/class/label"]), s["tokens"].tolist()) for s in packed.values()) == \
           sorted((int(s["image/class/label"]), s["tokens"].tolist()) for s in plain.values())


def _record_spans(path):
    return [s.fields[tfrecord.RECORD] for s in build_index(path).samples]


def test_a_record_whose_data_crc_fails_is_a_counted_error_naming_file_and_record(tmp_path, written, capfd):
    d, _ = written
    broken = tmp_path / "broken.tfrecord"
    data = bytearray((d / "part-000.tfrecord").read_bytes())
    off, length = _record_spans(str(d / "part-000.tfrecord"))[3]
    data[off + length // 2] ^= 0xFF
    broken.write_bytes(bytes(data))
    got, stats = epoch(str(broken), fields=["image/class/label"], max_sample_errors=3)
    assert sorted(int(s["image/class/label"]) for s in got.values()) == [n for n in range(12) if n != 3]
    assert stats.sample_errors_total["corrupt"] == 1
    logged = capfd.readouterr().err  # the workers' log
    assert f"{broken} sample 'broken/00000003': the record's data CRC does not match" in logged


def test_a_file_whose_framing_breaks_is_refused_naming_the_record(tmp_path, written):
    d, _ = written
    data = bytearray((d / "part-000.tfrecord").read_bytes())
    off, _ = _record_spans(str(d / "part-000.tfrecord"))[5]
    cut = tmp_path / "cut.tfrecord"
    cut.write_bytes(bytes(data[: off + 40]))
    with pytest.raises(ShardError, match="truncated: record 5"):
        build_index(str(cut))
    data[off - 12] ^= 0x01  # record 5's length: its CRC no longer matches
    bad = tmp_path / "bad.tfrecord"
    bad.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="record 5 .* length's CRC"):
        build_index(str(bad))


def test_a_bad_shard_among_good_ones_is_skipped_and_counted(tmp_path, written):
    d, _ = written
    (tmp_path / "junk.tfrecord").write_bytes(b"this is not a TFRecord file at all, just text")
    got, stats = epoch([str(d / "part-000.tfrecord"), str(tmp_path / "junk.tfrecord")], fields=["tokens"],
                       max_sample_errors=3)
    assert len(got) == 12 and stats.sample_errors_total["bad_shard"] == 1


def write_records(path, records):
    """Records framed and checked as TFRecordWriter frames them; each a {name: (kind, values)} of Example features
    (kind "bytes", "int64", "float", or None for a feature with no kind)."""
    example = tfrecord._example_class()
    with open(path, "wb") as f:
        for features in records:
            ex = example()
            for name, (kind, values) in features.items():
                feature = ex.features.feature[name]
                if kind is None:
                    feature.SetInParent()
                else:
                    getattr(feature, f"{kind}_list").value.extend(values)
            data = ex.SerializeToString()
            head = struct.pack("<Q", len(data))
            f.write(head + struct.pack("<I", tfrecord.masked_crc(head)) + data +
                    struct.pack("<I", tfrecord.masked_crc(data)))
    return str(path)


def write_id_records(path, ids):
    """Records of {"cls": id, "bin": 64 bytes}, as the id tar shards hold them."""
    return write_records(path, [{"cls": ("int64", [i]), "bin": ("bytes", [bytes([i % 256]) * 64])} for i in ids])


def test_names_are_lowercased_a_kindless_feature_is_left_out_and_a_string_named_id_stays_bytes(tmp_path):
    path = write_records(tmp_path / "r.tfrecords", [{"Label": ("int64", [i]), "id": ("bytes", [f"x{i}".encode()]),
                                                    "empty": (None, [])} for i in range(6)])
    got, stats = epoch(path)
    assert sorted((int(s["label"]), s["id"]) for s in got.values()) == [(i, f"x{i}".encode()) for i in range(6)]
    assert all(set(s) == {"label", "id"} for s in got.values()) and sum(stats.sample_errors_total.values()) == 0


def test_two_features_that_differ_only_in_case_make_the_record_a_counted_error(tmp_path):
    records = [{"label": ("int64", [i])} for i in range(6)]
    records[2] = {"label": ("int64", [2]), "LABEL": ("int64", [3])}
    got, stats = epoch(write_records(tmp_path / "r.tfrecord", records), max_sample_errors=3)
    assert sorted(int(s["label"]) for s in got.values()) == [0, 1, 3, 4, 5]
    assert stats.sample_errors_total["corrupt"] == 1


def test_a_numeric_feature_of_one_value_beside_several_batches_as_a_variable_field(tmp_path):
    path = write_records(tmp_path / "r.tfrecord", [{"n": ("int64", list(range(1 + i % 3)))} for i in range(9)])
    got, _ = epoch(path)
    assert sorted((int(s["n_len"]), s["n"][: int(s["n_len"])].tolist()) for s in got.values()) == \
           sorted((1 + i % 3, list(range(1 + i % 3))) for i in range(9))


def test_tfds_file_names_are_tfrecord_files(tmp_path):
    path = write_id_records(tmp_path / "mnist-train.tfrecord-00000-of-00001", range(10))
    got, _ = epoch(path, fields=["cls"])
    assert sorted(int(s["cls"]) for s in got.values()) == list(range(10))
    assert sorted(got)[0] == "mnist-train.tfrecord-00000-of-00001/00000000"


def test_a_gzip_file_not_named_gz_is_refused_saying_so(tmp_path):
    import gzip

    plain = write_id_records(tmp_path / "r.tfrecord", range(3))
    (tmp_path / "z.tfrecord").write_bytes(gzip.compress(open(plain, "rb").read()))
    with pytest.raises(ShardError, match="a gzip file .* name it <name>.tfrecord.gz"):
        build_index(str(tmp_path / "z.tfrecord"))


def test_a_state_saved_mid_epoch_over_tfrecords_resumes_exactly(tmp_path):
    from test_resume import run

    os.makedirs(tmp_path / "ids")
    for s in range(4):
        write_id_records(str(tmp_path / "ids" / f"ids-{s}.tfrecord"), range(s * 30, s * 30 + 30))
    shards = str(tmp_path / "ids" / "*.tfrecord")
    full = run(tmp_path, shards=shards, workers=2, saves={"0:7": str(tmp_path / "s.json")})
    per_epoch = len(full) // 2  # the script reads two epochs
    assert sorted(i for b in full[:per_epoch] for i in b) == list(range(120))
    rest = run(tmp_path, shards=shards, workers=2, states=[str(tmp_path / "s.json")])
    assert full[:7] + rest == full


def test_a_mixture_of_tar_shards_and_tfrecord_files_selects_one_field_from_either(tmp_path):
    from helpers import id_shards

    from feedline import Source

    tars = id_shards(str(tmp_path / "tar"), shards=2, per_shard=20)  # ids 0..39 as .cls members
    write_id_records(str(tmp_path / "rec.tfrecord"), range(100, 140))  # ids 100..139 as a "cls" feature
    mix = [Source("tar", shards=tars, weight=0.5), Source("tfrecord", shards=str(tmp_path / "rec.tfrecord"),
                                                          weight=0.5)]
    got = {}
    with StagingLoader(sources=mix, batch_size=8, workers=2, fields={"id": "cls", "payload": "bin"},
                       spec={"id": "int64", "payload": ("uint8", (64,))}) as loader:  # a .bin member, a bytes feature
        for batch in loader:
            for i, name in zip(batch["id"].tolist(), batch["__source__"]):
                got[i] = name
    assert got == {**{i: "tar" for i in range(40)}, **{i: "tfrecord" for i in range(100, 140)}}


def test_feedline_train_trains_on_tfrecord_files(written, tmp_path):
    d, _ = written
    assert trained_samples(str(d / "*.tfrecord"), tmp_path) == [24]
