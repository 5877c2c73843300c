"""Hostile sources, members and neighbours (issue 49): nothing leaks, nothing outside the cache is read or removed,
no member's content is taken for feedline's own encoding, no view is materialised past the bound.

Each case is what a hostile or broken source can produce, a few kilobytes, through the public API or the sidecar.
"""

import http.server
import io
import os
import struct
import threading

import msgpack
import pytest
import torch
from helpers import id_shards, jpeg_bytes, write_tar

from feedline import StagingLoader
from feedline.cache.store import CacheStore
from feedline.demo.store import FileStore
from feedline.errors import SettingError
from feedline.formats.bounds import DecodeError
from feedline.formats.urls import ShardListError, parse_index
from feedline.loader.layout import tree
from feedline.sampler.settings import SidecarSettings
from feedline.sampler.sidecar import Sidecar

TOKEN = "Authorization: Bearer s3cr3t"


class HeaderLog(http.server.ThreadingHTTPServer):
    """Another host: answers 404 to everything, and keeps the headers of every request it got."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        log = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                log.append(dict(self.headers))
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_GET  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> "HeaderLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


def test_an_index_naming_another_host_gets_no_credential_from_the_sidecar(tmp_path, cache):
    (tmp_path / "a").mkdir()
    id_shards(str(tmp_path / "a"), shards=1, per_shard=4)
    with FileStore(str(tmp_path / "a")) as a, HeaderLog() as b:
        a.auth = "Bearer s3cr3t"  # host A wants the token; the index it serves names a shard on host B too
        (tmp_path / "a" / "index.txt").write_text(f"ids-0000.tar\n{b.url}/elsewhere.tar\n")
        settings = SidecarSettings(source=f"{a.url}/index.txt", cache=cache, budget=16 << 20, auth_header=TOKEN,
                                   retries=0)
        sidecar = Sidecar(settings)
        assert len(sidecar.shards) == 2  # A answered the index (and its probe) with the token
        sidecar.fetcher.http.request("GET", f"{b.url}/elsewhere.tar")
        sidecar.fetcher.http.request("HEAD", f"{a.url}/ids-0000.tar")
    assert b.seen and all("Authorization" not in h for h in b.seen), b.seen


@pytest.mark.parametrize("entry, named", [("file:///etc/passwd.tar", "file:"), ("pipe:cat /etc/x.tar", "pipe:"),
                                          ("ftp://host/x.tar", "ftp:")])
def test_a_remote_index_naming_another_scheme_is_refused_by_name(entry, named):
    with pytest.raises(ShardListError, match=f"line 2: .*is a {named} entry; a remote index names remote shards"):
        parse_index(f"a.tar\n{entry}\n", "http://store/data/index.txt")


def test_a_remote_index_resolves_paths_on_its_own_host_never_on_this_one():
    entries = parse_index("/etc/secret.tar\n../up.tar\nx.tar\n", "http://store:8080/data/index.txt")
    assert [e.url for e in entries] == ["http://store:8080/etc/secret.tar", "http://store:8080/up.tar",
                                        "http://store:8080/data/x.tar"]
    s3 = parse_index("/top.tar\nx.tar\n../y.tar\n", "s3://bucket/data/index.txt")
    assert [e.url for e in s3] == ["s3://bucket/top.tar", "s3://bucket/data/x.tar", "s3://bucket/y.tar"]


def test_a_local_shard_that_is_not_a_regular_file_is_refused(tmp_path):
    fifo = tmp_path / "never-ends.tar"
    os.mkfifo(fifo)
    with pytest.raises(SettingError, match="not a regular file"):
        Sidecar(SidecarSettings(source=str(fifo), cache=str(tmp_path / "cache"), budget=16 << 20))


def imitation(meta: list, payload: bytes) -> bytes:
    """What feedline's own side-channel extensions hold (loader/layout/tree.py): magic, header, payload."""
    head = msgpack.packb(meta)
    return b"FLt1" + struct.pack("<I", len(head)) + head + payload


FORGED = msgpack.ExtType(96, imitation(["<f8", [1 << 28]], b"x" * 8))  # 8 bytes claiming to be 2 GiB


def test_a_members_extension_that_imitates_feedlines_array_encoding_arrives_as_data(tmp_path):
    path = write_tar(str(tmp_path / "forged.tar"), [(f"k{i}", {"cls": str(i).encode(), "mp": msgpack.packb(
        {"value": FORGED})}) for i in range(4)])
    with StagingLoader(path, batch_size=2, workers=1, fields=["cls", "mp"]) as loader:
        values = [v["value"] for b in loader for v in b["mp"]]
    assert values == [FORGED] * 4 and all(type(v) is msgpack.ExtType for v in values)


def test_the_side_channel_refuses_an_array_whose_bytes_are_not_its_shape_before_allocating():
    with pytest.raises(ValueError, match=r"shape \[268435456\] and 8-byte items, but 8 bytes"):
        tree._ext_hook(FORGED.code, FORGED.data)
    tensor = imitation(["float32", [1 << 30]], b"\0" * 4)
    with pytest.raises(ValueError, match=r"shape \[1073741824\] and 4-byte items, but 4 bytes"):
        tree._ext_hook(99, tensor)


def test_a_pth_view_larger_than_the_bound_is_skipped_and_counted(tmp_path):
    buf = io.BytesIO()
    torch.save({"big": torch.zeros(1).expand(1 << 31)}, buf)  # 4 bytes stored, 8 GiB as a tensor of its own
    assert len(buf.getvalue()) < 4096
    small = io.BytesIO()
    torch.save({"big": torch.zeros(4)}, small)
    samples = [(f"k{i}", {"cls": str(i).encode(), "pth": buf.getvalue() if i == 3 else small.getvalue()})
               for i in range(6)]
    path = write_tar(str(tmp_path / "views.tar"), samples)
    with StagingLoader(path, batch_size=2, workers=1, shuffle=False, fields=["cls", "pth"],
                       max_member_bytes=1 << 20, max_sample_errors=0.5) as loader:
        got = sorted(int(i) for b in loader for i in b["cls"])
        assert loader.stats().sample_errors_total["member_too_large"] == 1
    assert got == [0, 1, 2, 4, 5]


def test_a_cache_whose_partial_folder_links_elsewhere_is_refused_and_nothing_there_removed(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "precious.txt").write_text("keep me")
    cache = tmp_path / "cache"
    (cache / "shards").mkdir(parents=True)
    os.symlink(theirs, cache / "shards" / ".partial")
    id_shards(str(tmp_path / "src"), shards=1, per_shard=4)
    with pytest.raises(SettingError, match=r"cache.*\.partial is a symbolic link"):
        Sidecar(SidecarSettings(source=str(tmp_path / "src"), cache=str(cache), budget=16 << 20))
    with pytest.raises(ValueError, match="symbolic link"):
        CacheStore(str(cache), 16 << 20)
    assert (theirs / "precious.txt").read_text() == "keep me"


def test_recovery_removes_a_link_left_in_partial_never_what_it_points_to(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "precious.txt").write_text("keep me")
    store = CacheStore(str(tmp_path / "cache"), 16 << 20)
    os.symlink(theirs, os.path.join(store.partial_dir, "x.123.456"))
    store.recover()
    assert os.listdir(store.partial_dir) == [] and (theirs / "precious.txt").read_text() == "keep me"


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n0 0 moveto 16 16 lineto stroke\nshowpage\n%%EOF\n"


def test_an_image_member_holding_postscript_is_not_opened_by_ghostscripts_plugin(tmp_path):
    from feedline.formats.images import decode_image

    with pytest.raises(DecodeError, match="not a readable image"):
        decode_image(memoryview(EPS))
    samples = [(f"k{i}", {"cls": str(i).encode(), "jpg": EPS if i == 1 else jpeg_bytes(i)}) for i in range(4)]
    with StagingLoader(write_tar(str(tmp_path / "eps.tar"), samples), batch_size=2, workers=1, shuffle=False,
                       fields=["cls", "jpg"], spec={"cls": "int64", "jpg": ("uint8", (72, 96, 3))},
                       max_sample_errors=0.5) as loader:
        got = sorted(int(i) for b in loader for i in b["cls"])
        assert loader.stats().sample_errors_total["corrupt"] == 1
    assert got == [0, 2, 3]


def test_a_compressed_shard_holding_a_member_past_the_bound_takes_no_room_in_decompress_dir(tmp_path):
    import gzip
    import tarfile

    path = str(tmp_path / "bomb.tar.gz")
    with gzip.open(path, "wb", compresslevel=9) as z, tarfile.open(fileobj=z, mode="w|") as tar:
        for i in range(4):  # sample 1's .big is 256 MiB of zeros; the others' 100 bytes
            big = bytes(256 << 20) if i == 1 else bytes([i]) * 100
            for ext, data in (("cls", str(i).encode()), ("big", big)):
                info = tarfile.TarInfo(f"k{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    assert os.path.getsize(path) < (2 << 20)
    out = tmp_path / "plain"
    with StagingLoader(path, batch_size=2, workers=1, shuffle=False, fields=["cls", "big"],
                       spec={"cls": "int64", "big": ("uint8", (100,))}, decompress_dir=str(out),
                       max_member_bytes=1 << 20, max_sample_errors=0.5) as loader:
        got = sorted(int(i) for b in loader for i in b["cls"])
        assert loader.stats().sample_errors_total["member_too_large"] == 1
    assert got == [0, 2, 3]
    (copy,) = [p for p in out.iterdir() if p.suffix == ".tar"]
    assert copy.stat().st_size > 256 << 20 and copy.stat().st_blocks * 512 < 4 << 20  # the member is a hole


def test_a_local_index_of_the_users_own_names_the_hosts_the_credential_goes_to(tmp_path):
    from feedline.sampler.auth import auth_origins

    index = tmp_path / "index.txt"
    index.write_text("https://store.example:8443/a.tar\nhttp://other.example/b.tar\n")
    assert auth_origins(str(index)) == {("https", "store.example", 8443), ("http", "other.example", 80)}
    assert auth_origins("https://Store.example/x-{0..3}.tar") == {("https", "store.example", 443)}


def test_a_key_with_control_characters_is_one_escaped_line_of_the_key_trace(tmp_path):
    from feedline.trainer.keytrace import KeyTrace

    keys = ["k0", "k1\nk9-forged", "k2\r\x1b[2Jhidden", "k3\\x0a", "k4\u2028z"]
    path = write_tar(str(tmp_path / "keys.tar"), [(k, {"cls": str(i).encode()}) for i, k in enumerate(keys)])
    trace = str(tmp_path / "keys-{epoch}.txt")
    with StagingLoader(path, batch_size=5, workers=1, shuffle=False, fields=["cls"]) as loader, \
            KeyTrace(trace) as keytrace:
        for batch in loader:
            keytrace.write(0, batch["__key__"])
    lines = open(tmp_path / "keys-0.txt").read().splitlines()
    assert lines == ["k0", "k1\\x0ak9-forged", "k2\\x0d\\x1b[2Jhidden", "k3\\\\x0a", "k4\\u2028z"]


def test_a_shard_of_more_samples_than_an_index_may_hold_is_refused_when_published(tmp_path, monkeypatch):
    import shutil

    import feedline.formats.shard_index as shard_index
    from feedline.formats.sample_index import ShardError

    monkeypatch.setattr(shard_index, "MAX_SAMPLES", 100)  # 1,048,576 in earnest: a 512 MB tar of empty members
    path = write_tar(str(tmp_path / "many.tar"), [(f"k{i:04d}", {"cls": b""}) for i in range(102)])
    store = CacheStore(str(tmp_path / "cache"), 16 << 20)
    partial = store.partial_path("many")
    shutil.copyfile(path, partial)
    with pytest.raises(ShardError, match="holds more than .* samples, past what one shard's index may hold"):
        store.publish("many", partial)
    assert store.entries == []
