"""Shard reading: the same samples whoever wrote the tar; decoders that never unpickle."""

import io
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from helpers import jpeg_bytes, write_tar

from feedline.formats.decoders import DecodeError, Decoder, UnsafeMemberError, decode_npy
from feedline.formats.shard_index import ShardError, build_index, load_index, write_index
from feedline.formats.transforms import RandomResizedCrop

LONG_DIR = "a-rather-long-directory-name-that-pushes-member-paths-past-the-ustar-limit/" * 2


def _samples():
    out = []
    for i in range(5):
        npy = io.BytesIO()
        np.save(npy, np.arange(i, i + 6, dtype=np.float32).reshape(2, 3))
        out.append((f"{LONG_DIR}sample{i:03d}", {
            "jpg": jpeg_bytes(i), "cls": str(i).encode(), "txt": f"caption {i} ü".encode(),
            "json": b'{"i": %d}' % i, "npy": npy.getvalue(), "seg.png": b"not decoded here",
        }))
    return out


def _read(path):
    index = build_index(path)
    with open(path, "rb") as f:
        data = f.read()
    return [(s.key, {ext: data[o:o + n] for ext, (o, n) in s.fields.items()}) for s in index.samples]


def test_pillow_in_use_is_pillow_simd_with_libjpeg_turbo():
    from feedline.preflight import check_pillow_simd

    check = check_pillow_simd()
    assert check.ok, check.detail


def test_webdataset_gnu_tar_and_tarfile_shards_read_the_same(tmp_path):
    import webdataset as wds

    samples = _samples()
    by_tarfile = write_tar(str(tmp_path / "tarfile.tar"), samples, tarfile.PAX_FORMAT)

    by_wds = str(tmp_path / "wds.tar")
    with wds.TarWriter(by_wds) as sink:
        for key, fields in samples:
            sink.write({"__key__": key, **fields})

    src = tmp_path / "files"
    names = []
    for key, fields in samples:
        for ext, data in fields.items():
            p = src / f"{key}.{ext}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            names.append(f"{key}.{ext}")
    by_gnu = str(tmp_path / "gnu.tar")
    subprocess.run(["tar", "--format=gnu", "-cf", by_gnu, "-C", str(src), *names], check=True)

    expected = [(k, dict(f)) for k, f in samples]
    assert _read(by_tarfile) == expected
    assert _read(by_wds) == expected
    assert _read(by_gnu) == expected


def test_index_is_stored_as_json_next_to_the_shard_and_reused(tmp_path):
    path = write_tar(str(tmp_path / "a.tar"), _samples())
    index = build_index(path)
    stored = write_index(index)
    assert stored == str(tmp_path / "a.idx")
    with open(stored) as f:
        assert f.read().startswith('{"version":1')
    assert load_index(path) == index


def test_stale_index_is_not_trusted(tmp_path):
    path = write_tar(str(tmp_path / "a.tar"), _samples()[:2])
    write_index(build_index(path))
    write_tar(path, _samples())  # the shard changed under its index
    assert len(load_index(path).samples) == 5


def test_a_shards_index_is_kept_by_the_process_and_read_once_an_epoch_not_more(tmp_path):
    path = write_tar(str(tmp_path / "a.tar"), _samples())
    assert load_index(path) is load_index(path)


def test_a_shard_rewritten_in_place_or_replaced_under_its_name_is_indexed_again(tmp_path):
    path = write_tar(str(tmp_path / "a.tar"), _samples()[:2])
    assert len(load_index(path).samples) == 2
    write_tar(path, _samples()[:3])  # the same file rewritten (a new size, a new modification time)
    assert len(load_index(path).samples) == 3
    write_tar(str(tmp_path / "b.tar"), _samples())
    os.replace(tmp_path / "b.tar", path)  # another file under the name (a new inode)
    assert len(load_index(path).samples) == 5


def test_truncated_shard_is_refused_with_a_clear_message(tmp_path):
    path = write_tar(str(tmp_path / "t.tar"), _samples())
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ShardError, match="truncated|not a readable tar"):
        build_index(path)


def test_non_tar_file_is_refused(tmp_path):
    path = tmp_path / "x.tar"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ShardError, match="not a readable tar"):
        build_index(str(path))


def test_npy_is_read_without_a_copy_and_matches_numpy():
    arr = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    buf = io.BytesIO()
    np.save(buf, arr)
    view = decode_npy(memoryview(buf.getvalue()))
    assert view.base is not None
    np.testing.assert_array_equal(view, arr)


def test_npy_with_python_objects_is_refused_never_unpickled():
    buf = io.BytesIO()
    np.save(buf, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DecodeError, match="unpickle"):
        decode_npy(memoryview(buf.getvalue()))


@pytest.mark.parametrize("ext", ["pyd", "pickle", "pkl", "meta.pickle"])
def test_pickle_members_are_refused_naming_the_safety_reason(ext):
    with pytest.raises(UnsafeMemberError, match="runs code from the data"):
        Decoder()(ext, memoryview(b"\x80\x04K\x01."))


def test_without_decoding_every_member_is_raw_bytes_pickles_included():
    value = Decoder(False)("pyd", memoryview(b"\x80\x04K\x01."))
    assert isinstance(value, np.ndarray) and value.dtype == np.uint8


def test_webdataset_extension_names_decode_as_webdataset_decodes_them():
    dec = Decoder()
    assert dec("cls2", memoryview(b"3")) == dec("index", memoryview(b"3")) == dec("inx", memoryview(b"3")) == 3
    assert dec("text", memoryview(b"hi")) == dec("transcript", memoryview(b"hi")) == "hi"
    assert dec("jsn", memoryview(b"[1]")) == [1]
    assert dec("seg.png", memoryview(_png())).size == (3, 2)  # a multi-dot extension decodes by its last part
    assert dec("unknown", memoryview(b"\x00\x01")) == b"\x00\x01"


def test_npz_members_decode_to_arrays_without_unpickling():
    buf = io.BytesIO()
    np.savez(buf, a=np.arange(3), b=np.ones((2, 2), np.float32))
    out = Decoder()("npz", memoryview(buf.getvalue()))
    assert set(out) == {"a", "b"} and out["b"].dtype == np.float32
    buf = io.BytesIO()
    np.savez(buf, o=np.array([{"x": 1}], dtype=object))
    with pytest.raises(DecodeError, match="never unpickled"):
        Decoder()("npz", memoryview(buf.getvalue()))


def _png():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (3, 2)).save(buf, format="PNG")
    return buf.getvalue()


def test_default_decoders_give_image_int_text_and_json():
    dec = Decoder()
    img = dec("jpg", memoryview(jpeg_bytes(1)))
    assert img.size == (96, 72)
    assert dec("cls", memoryview(b" 7\n")) == 7
    assert dec("txt", memoryview("ü".encode())) == "ü"
    assert dec("json", memoryview(b'{"a": [1]}')) == {"a": [1]}


def test_random_resized_crop_decodes_jpeg_in_draft_mode():
    from PIL import Image

    big = Image.fromarray(np.random.default_rng(0).integers(0, 255, (800, 1000, 3), dtype=np.uint8))
    buf = io.BytesIO()
    big.save(buf, format="JPEG")
    img = Image.open(io.BytesIO(buf.getvalue()))
    crop = RandomResizedCrop(64, scale=(0.9, 1.0), flip=False)
    out = crop.crop(img)
    assert out.size == (64, 64)
    assert img.size[0] <= 1000 // 4  # libjpeg decoded at 1/4 scale or smaller


def test_make_shards_packs_a_folder_and_a_list_file(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    for i in range(6):
        (folder / f"img{i}.jpg").write_bytes(jpeg_bytes(i))
        (folder / f"img{i}.cls").write_text(str(i))
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"folder/img{i}.jpg {i % 2}\n" for i in range(6)))
    env = dict(os.environ)
    for src, out in ((folder, tmp_path / "out1"), (listing, tmp_path / "out2")):
        subprocess.run([sys.executable, "-m", "feedline", "make-shards", str(src), str(out), "--shard-size", "20KiB"],
                       check=True, env=env, capture_output=True)
        shards = sorted(str(p) for p in out.glob("*.tar"))
        assert len(shards) >= 2
        samples = [s for p in shards for s in build_index(p).samples]
        assert len(samples) == 6
        assert all(set(s.fields) == {"jpg", "cls"} for s in samples)


def test_make_shards_shuffles_the_samples_by_default_and_keep_order_keeps_them(tmp_path):
    folder = tmp_path / "train"
    for c in range(4):  # an ImageNet-style tree: a folder per class, packed in sorted order
        (folder / f"class{c}").mkdir(parents=True)
        for i in range(25):
            (folder / f"class{c}" / f"{i:03d}.cls").write_text(str(c))
    orders = {}
    for name, extra in (("shuffled", []), ("again", []), ("kept", ["--keep-order"])):
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "feedline", "make-shards", str(folder), str(out), *extra],
                              check=True, capture_output=True, text=True)
        said = " ".join((done.stdout + done.stderr).split())
        assert ("samples shuffled (seed 0; --keep-order keeps the source's order)" in said) != bool(extra), said
        orders[name] = [s.key for p in sorted(out.glob("*.tar")) for s in build_index(str(p)).samples]
    assert orders["kept"] == sorted(orders["kept"])  # class0/000 ... class3/024, as the folders hold them
    assert sorted(orders["shuffled"]) == orders["kept"] and orders["shuffled"] != orders["kept"]
    assert orders["again"] == orders["shuffled"]  # seeded: the same order on every run
    first = [k.split("/")[0] for k in orders["shuffled"][:25]]
    assert len(set(first)) >= 3  # the first quarter holds most classes, not one
