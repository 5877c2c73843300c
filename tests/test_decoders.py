"""Every member webdataset decodes, feedline decodes the same way: member by member, field by field.

The reference is the real ``webdataset`` package: its default decoding (``.decode()``: gunzip,
then its table) with its image handler (``"rgb8"``), over shards written by ``webdataset.ShardWriter``
and by ``tarfile``.
"""

import collections
import gzip
import io
import os
import subprocess
import sys
import tarfile

import cbor2
import msgpack
import numpy as np
import pytest
import torch
from PIL import Image

from feedline import SettingError, StagingLoader
from feedline.formats.decoders import Decoder, UnsafeMemberError
from feedline.formats.shard_index import build_index
from feedline.formats.video import VideoMember

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PICKLE = b"\x80\x04K\x01."


def image(i: int, size=(8, 6)) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)


def encoded(arr: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def every_member(i: int) -> dict:
    """One sample with every extension of webdataset's table, as values ShardWriter encodes (it gzips ``.gz``)."""
    arr = (np.arange(6, dtype=np.float32) + i).reshape(2, 3)
    return {
        "__key__": f"s{i:04d}",
        "jpg": image(i), "png": image(i + 1), "ppm": image(i + 2), "tiff": image(i + 3), "seg.png": image(i + 4),
        "cls": i % 5, "cls2": i, "index": i + 1, "inx": i + 2, "id": i + 3,
        "txt": f"caption {i} ü", "text": f"text {i}", "transcript": f"words {i}",
        "json": {"i": i, "tags": ["a"] * (i % 3)}, "jsn": [i, "x", None],
        "npy": arr, "npz": {"a": arr, "b": np.arange(i + 1, dtype=np.int16)},
        "mp": {"i": i, "raw": bytes([i]), "xs": [1, 2.5, None, True]}, "msg": [i, "x"],
        "cbor": {"i": i, "s": "x", "b": b"y", "f": 1.5},
        "ten": [arr, np.arange(3, dtype=np.int64)], "tb": arr * 2,
        "pth": {"w": torch.arange(4, dtype=torch.float32) + i, "t": (i, "x"), "h": torch.ones(2, dtype=torch.float16)},
        "txt.gz": f"zipped {i}", "json.gz": {"z": i}, "npy.gz": npy(arr), "cls.gz": i % 7, "jpg.gz": image(i + 5),
        "flac": b"fLaC" + bytes(range(i % 50)), "mp4": b"\x00\x00\x00\x18ftypmp42" + bytes([i]), "wav": b"RIFF" + bytes([i]),
        "bin": bytes([i, 1, 2]),
        # not in webdataset's table but written by its ShardWriter: feedline decodes them too (below)
        "tenbin": [arr], "msgpack": {"m": i},
    }


FEEDLINE_ONLY = {"tenbin", "msgpack", "bin"}  # decoded by feedline, left as bytes by webdataset 1.0's table


def shardwriter_shards(directory, shards=2, per_shard=4) -> list[str]:
    import webdataset as wds

    os.makedirs(directory, exist_ok=True)
    with wds.ShardWriter(os.path.join(directory, "w-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(shards * per_shard):
            sink.write(every_member(i))
    return sorted(os.path.join(directory, f) for f in os.listdir(directory))


def tar_members(i: int) -> list[tuple[str, bytes]]:
    """The same kinds of member, written by hand: multi-dot and uppercase names, directories, metadata."""
    from webdataset import tenbin

    arr = np.arange(4, dtype=np.float64).reshape(2, 2) - i
    pth = io.BytesIO()
    torch.save(collections.OrderedDict(w=torch.full((2,), float(i)), n=torch.tensor(i)), pth)
    one_tensor = io.BytesIO()
    torch.save(torch.arange(3) * i, one_tensor)
    key = f"set.v1/clip_{i:03d}"
    return [
        (f"{key}.JPG", encoded(image(i), "JPEG")),
        (f"{key}.seg.PNG", encoded(image(i + 1), "PNG")),
        (f"{key}.Cls", str(i).encode()),
        (f"{key}.caption.en.txt", f"an image {i}".encode()),
        (f"{key}.meta.JSON", b'{"k": %d}' % i),
        (f"{key}.depth.npy", npy(arr)),
        (f"{key}.mp", msgpack.packb({"i": i, "b": b"\x01"})),
        (f"{key}.cbor", cbor2.dumps([i, {"x": b"z"}])),
        (f"{key}.ten", bytes(tenbin.encode_buffer([arr]))),
        (f"{key}.pth", pth.getvalue()),
        (f"{key}.weights.pth", one_tensor.getvalue()),
        (f"{key}.txt.gz", gzip.compress(f"gz {i}".encode())),
        (f"{key}.left.jpg.gz", gzip.compress(encoded(image(i + 2), "JPEG"))),
        (f"{key}.OGG", b"OggS" + bytes([i])),
    ]


def tarfile_shards(directory, shards=2, per_shard=3) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for s in range(shards):
        path = os.path.join(directory, f"t-{s:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            for name, data in [("__meta__", b"skipped"), *[m for i in range(per_shard) for m in tar_members(s * 10 + i)]]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def webdataset_samples(paths: list[str], decode: bool = True) -> list[dict]:
    import webdataset as wds

    ds = wds.WebDataset(paths, shardshuffle=False, empty_check=False)
    return list(ds.decode("rgb8") if decode else ds)


def feedline_samples(paths: list[str]) -> list[dict]:
    """Every member of every sample through feedline's index and default decoders, as a worker decodes them."""
    decoder, out = Decoder(), []
    for path in paths:
        with open(path, "rb") as f:
            data = memoryview(f.read())
        for ref in build_index(path).samples:
            out.append({"__key__": ref.key} | {ext: decoder(ext, data[off : off + size])
                                               for ext, (off, size) in ref.fields.items()})
    return out


def same(ours, theirs, where="") -> None:
    """Equal values of the same type; a feedline image equals webdataset's rgb8 array of it."""
    if hasattr(ours, "getbands"):
        np.testing.assert_array_equal(np.asarray(ours.convert("RGB")), theirs, err_msg=where)
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray) and ours.dtype == theirs.dtype, where
        np.testing.assert_array_equal(ours, theirs, err_msg=where)
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), where
        for k in theirs:
            same(ours[k], theirs[k], f"{where}[{k!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for j, (a, b) in enumerate(zip(ours, theirs)):
            same(a, b, f"{where}[{j}]")
    elif isinstance(ours, VideoMember):  # a video member: its bytes, as webdataset's, which VideoClip reads
        assert type(theirs) is bytes and ours == theirs, (where, ours, theirs)
    else:
        assert type(ours) is type(theirs) and ours == theirs, (where, ours, theirs)


def compare(ours: list[dict], theirs: list[dict], skip=frozenset()) -> int:
    assert [s["__key__"] for s in ours] == [s["__key__"] for s in theirs]
    fields = 0
    for a, b in zip(ours, theirs):
        assert set(a) - {"__key__"} == set(b) - {"__key__", "__url__", "__local_path__"}, a["__key__"]
        for ext in set(a) - {"__key__"} - skip:
            same(a[ext], b[ext], f"{a['__key__']}.{ext}")
            fields += 1
    return fields


def test_shardwriter_members_decode_to_webdatasets_values_member_by_member(tmp_path):
    paths = shardwriter_shards(str(tmp_path))
    ours, theirs = feedline_samples(paths), webdataset_samples(paths)
    assert len(ours) == 8
    assert compare(ours, theirs, skip=FEEDLINE_ONLY) == 8 * (len(every_member(0)) - 1 - len(FEEDLINE_ONLY))
    s = ours[3]
    assert s["txt.gz"] == "zipped 3" and s["json.gz"] == {"z": 3} and s["cls.gz"] == 3
    assert isinstance(s["npy.gz"], np.ndarray) and s["jpg.gz"].size == (8, 6)
    assert s["mp"] == {"i": 3, "raw": b"\x03", "xs": [1, 2.5, None, True]} and s["cbor"]["b"] == b"y"
    assert [a.shape for a in s["ten"]] == [(2, 3), (3,)] and len(s["tb"]) == 1
    assert s["pth"]["t"] == (3, "x") and s["pth"]["h"].dtype == torch.float16
    assert s["flac"].startswith(b"fLaC") and isinstance(s["mp4"], bytes) and isinstance(s["wav"], bytes)


def test_members_webdataset_leaves_as_bytes_feedline_decodes_as_their_writer_meant(tmp_path):
    s = feedline_samples(shardwriter_shards(str(tmp_path), shards=1, per_shard=1))[0]
    assert s["msgpack"] == {"m": 0}
    np.testing.assert_array_equal(s["tenbin"][0], every_member(0)["tenbin"][0])
    assert s["bin"].dtype == np.uint8 and s["bin"].tolist() == [0, 1, 2]  # raw, for a spec to reinterpret


def test_tarfile_members_with_dotted_and_uppercase_names_group_and_decode_as_webdataset(tmp_path):
    paths = tarfile_shards(str(tmp_path))
    ours, theirs = feedline_samples(paths), webdataset_samples(paths)
    assert len(ours) == 6 and ours[0]["__key__"] == "set.v1/clip_000"
    assert set(ours[0]) == {"__key__", "jpg", "seg.png", "cls", "caption.en.txt", "meta.json", "depth.npy", "mp",
                            "cbor", "ten", "pth", "weights.pth", "txt.gz", "left.jpg.gz", "ogg"}
    assert compare(ours, theirs) == 6 * 14
    assert isinstance(ours[1]["weights.pth"], torch.Tensor) and ours[1]["pth"]["n"].item() == 1


def test_member_names_group_into_the_keys_webdataset_gives(tmp_path):
    names = ["./a.JPG", "./a.Cls", "dir.x/b.seg.PNG", "dir.x/b.TXT", "__meta__", "__x.txt", "noext", "d/.hid.txt",
             "e/f.g/h.i.JSON", "__sub__/k.txt", "K.A.B.c"]
    path = str(tmp_path / "names.tar")
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    theirs = [(s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in webdataset_samples([path], False)]
    ours = [(s.key, sorted(s.fields)) for s in build_index(path).samples]
    assert ours == theirs
    assert ("dir.x/b", ["seg.png", "txt"]) in ours and ("K", ["a.b.c"]) in ours


def loader_rows(loader) -> list[dict]:
    """The samples of one epoch, taken apart from the batches: tensors row by row, side lists item by item."""
    out = []
    for batch in loader:
        for r, key in enumerate(batch["__key__"]):
            out.append({name: value[r] for name, value in batch.items()} | {"__key__": key})
    return sorted(out, key=lambda s: s["__key__"])


def test_a_loader_delivers_every_member_as_webdataset_decodes_it(tmp_path):
    paths = shardwriter_shards(str(tmp_path))
    theirs = {s["__key__"]: s for s in webdataset_samples(paths)}
    with StagingLoader(paths, batch_size=3, workers=2, shuffle=False) as loader:
        kinds = {f.name: f.dtype if f.side else "tensor" for f in loader.spec.fields}
        rows = loader_rows(loader)
    assert len(rows) == 8
    assert {k for k, v in kinds.items() if v == "tree"} == {"mp", "msg", "cbor", "ten", "tb", "pth", "npz", "tenbin",
                                                            "msgpack"}
    assert kinds["json"] == kinds["jsn"] == kinds["json.gz"] == "json" and kinds["txt.gz"] == "text"
    for ext in ("jpg", "png", "seg.png", "jpg.gz", "cls", "cls.gz", "id", "npy", "npy.gz"):
        assert kinds[ext] == "tensor", ext
    for row in rows:
        ref = theirs[row["__key__"]]
        for ext, value in row.items():
            if ext in FEEDLINE_ONLY or ext == "__key__" or ext.endswith("_len"):
                continue
            if isinstance(value, torch.Tensor):
                want = ref[ext]
                want = np.asarray(want) if isinstance(want, (int, np.ndarray)) else want
                assert value.numpy().dtype == (np.int64 if isinstance(ref[ext], int) else want.dtype), ext
                np.testing.assert_array_equal(value.numpy(), want, err_msg=f"{row['__key__']}.{ext}")
            else:
                same(value, ref[ext], f"{row['__key__']}.{ext}")


def test_a_pth_member_with_more_than_tensors_is_refused_as_pickles_are(tmp_path):
    buf = io.BytesIO()
    torch.save({"w": torch.ones(1), "when": __import__("datetime").date(2026, 1, 1)}, buf)
    with pytest.raises(UnsafeMemberError, match=r"weights_only=True.*datetime\.date.*decode=\{'pth'"):
        Decoder()("pth", memoryview(buf.getvalue()))
    path = str(tmp_path / "p.tar")
    with tarfile.open(path, "w") as tar:
        for i in range(4):
            for ext, data in (("pth", buf.getvalue()), ("cls", b"1")):
                info = tarfile.TarInfo(f"{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with pytest.raises(SettingError, match=r"fields.*run code from the data"):
        StagingLoader([path], batch_size=2, workers=1)
    with StagingLoader([path], batch_size=2, workers=1, fields=["cls"]) as loader:
        assert sum(len(b["cls"]) for b in loader) == 4


def first_bytes(data: memoryview) -> bytes:
    return bytes(data[:4])


def test_a_users_decoder_takes_over_an_extension_and_gunzipped_members_reach_it():
    dec = Decoder({"MP4": first_bytes, "txt.gz": first_bytes})
    assert dec("mp4", memoryview(b"\x00\x00\x00\x18ftyp")) == b"\x00\x00\x00\x18"
    assert dec("clip.mp4.gz", memoryview(gzip.compress(b"ftypmp42"))) == b"ftyp"  # gunzipped, then the user's
    assert dec("txt.gz", memoryview(gzip.compress(b"hello"))) == b"\x1f\x8b\x08\x00"  # the whole name: theirs
    assert dec("en.txt.gz", memoryview(gzip.compress(b"hello"))) == "hello"
    assert Decoder(False)("txt.gz", memoryview(b"\x1f\x8b")).tolist() == [0x1F, 0x8B]  # decode=False: raw bytes


def test_a_member_whose_decoders_package_is_missing_is_refused_at_construction_naming_it(tmp_path):
    paths = shardwriter_shards(str(tmp_path), shards=1, per_shard=2)
    code = ("import sys; sys.modules['cbor2'] = None\n"
            "from feedline import StagingLoader, SettingError\n"
            f"try:\n    StagingLoader({paths!r}, batch_size=2, workers=1)\n"
            "except SettingError as exc:\n    print('REFUSED', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "REFUSED" in out.stdout, out.stderr[-2000:]
    assert "'.cbor' members" in out.stdout and "pip install cbor2" in out.stdout and "decode" in out.stdout


def test_the_audio_example_decodes_flac_members_with_a_decoder_hook(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "audio.py"), "--demo", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "read 24 clips in 4 batches: flac float32 (4, 16000), cls int64 (4,)" in out.stdout  # 12 clips a worker


@pytest.mark.parametrize("first", ["init", "preinit"])
def test_an_image_member_is_sniffed_by_signature_before_the_formats_that_parse_to_find_out(first):
    """Pillow tries formats in Image.ID's order, the order its plugins were imported in: after Image.init()
    alone, IM and IPTC (no signature check: a parse attempt on every file) came before JPEG."""
    code = (f"from PIL import Image; Image.{first}()\n"
            "from feedline.formats.images import image_formats\n"
            "order = image_formats()\n"
            "checks = [Image.OPEN[f][1] is not None for f in order]\n"
            "print(order[0], any(checks[checks.index(False):]), 'EPS' in order)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    head, sniffed_after_a_parser, eps = out.split()
    assert (head, sniffed_after_a_parser, eps) == ("JPEG", "False", "False"), out
