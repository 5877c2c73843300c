"""A tar shard's index read from its headers directly is the index ``tarfile`` reads (issue 63: the sidecar indexes
every shard it publishes): ustar, GNU and pax archives, by tarfile, GNU tar and webdataset, links, folders and
odd members, and the broken ones, which go to tarfile and fail or stop as they did."""

import io
import os
import subprocess
import tarfile

import pytest

from feedline.formats import shard_index, tar_headers
from feedline.formats.sample_index import ShardError

LONG = "a-directory-name-long-enough-that-member-paths-pass-the-hundred-bytes-of-ustar/" * 2


def _both(path):
    """(the index by the headers, the index by tarfile): each its samples or its error's message."""
    out = []
    for walk in (shard_index._headers, shard_index._tarfile_members):
        try:
            out.append([(s.key, s.fields) for s in shard_index._samples(path, os.path.getsize(path), walk(path, None))])
        except (ShardError, tar_headers.Unusual, tarfile.TarError) as exc:
            out.append((type(exc).__name__, str(exc)))
    return out


def _write(path, fmt, members):
    """``members``: (name, data or a TarInfo type), written by tarfile in ``fmt``."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, what in members:
            info = tarfile.TarInfo(name)
            if isinstance(what, bytes):
                info.size = len(what)
                tar.addfile(info, io.BytesIO(what))
            else:
                info.type = what
                info.linkname = "s0.txt" if what in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
                tar.addfile(info)
    return str(path)


MEMBERS = [("s0.txt", b"zero"), ("s0.cls", b"0"), ("dir", tarfile.DIRTYPE), ("dir/s1.txt", b"one"),
           ("dir/s1.json", b"{}"), ("link.txt", tarfile.SYMTYPE), ("hard.txt", tarfile.LNKTYPE),
           ("fifo.bin", tarfile.FIFOTYPE), (f"{LONG}s2.txt", b"two" * 300), (f"{LONG}s2.seg.png", b""),
           ("ünïcode/s3.txt", b"three"), ("__meta__", b"x"), ("empty.bin", b"")]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_headers_read_directly_index_as_tarfile_does_in_each_format(tmp_path, fmt):
    members = MEMBERS if fmt != tarfile.USTAR_FORMAT else [m for m in MEMBERS if len(m[0]) < 155 + 100 - 60]
    path = _write(tmp_path / "a.tar", fmt, members)
    fast, slow = _both(path)
    assert fast == slow and len(fast) >= 4, (fast, slow)
    assert list(shard_index._headers(path, None))  # read directly, not handed to tarfile


def test_a_shard_gnu_tar_wrote_with_long_names_indexes_as_tarfile_does(tmp_path):
    src = tmp_path / "files"
    names = []
    for i in range(3):
        for ext in ("txt", "cls"):
            p = src / f"{LONG}k{i}.{ext}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"%d" % i * (i + 1))
            names.append(f"{LONG}k{i}.{ext}")
    for fmt in ("gnu", "posix", "ustar"):
        path = str(tmp_path / f"{fmt}.tar")
        done = subprocess.run(["tar", f"--format={fmt}", "-cf", path, "-C", str(src), *names], capture_output=True)
        if done.returncode != 0:  # ustar cannot hold names this long: GNU tar says so and writes nothing useful
            continue
        fast, slow = _both(path)
        assert fast == slow and len(fast) == 3, (fmt, fast, slow)


def test_a_shard_webdataset_wrote_indexes_as_tarfile_does(tmp_path):
    import webdataset as wds

    path = str(tmp_path / "wds.tar")
    with wds.TarWriter(path) as sink:
        for i in range(4):
            sink.write({"__key__": f"{LONG}k{i}", "txt": f"caption {i}", "cls": i})
    fast, slow = _both(path)
    assert fast == slow and len(fast) == 4


@pytest.mark.parametrize("damage", ["bad checksum", "truncated member", "no end blocks", "garbage after a member",
                                    "bad mode", "empty"])
def test_a_broken_shard_is_read_by_tarfile_and_refused_or_stopped_as_before(tmp_path, damage):
    path = _write(tmp_path / "a.tar", tarfile.GNU_FORMAT, [(f"k{i}.txt", b"x" * 700) for i in range(4)])
    data = bytearray(open(path, "rb").read())
    second = 512 + 1024  # the second header: after the first's data (700 bytes: two blocks)
    if damage == "bad checksum":
        data[second + 1] ^= 1
    elif damage == "truncated member":
        data = data[:second + 512 + 300]
    elif damage == "no end blocks":
        data = data[:4 * 1536]
    elif damage == "garbage after a member":
        data[second:second + 512] = b"\x7f" * 512
    elif damage == "bad mode":  # a checksum that matches a mode field tarfile cannot read
        data[second + 100:second + 108] = b"9999999\0"
        data[second + 148:second + 156] = b" " * 8
        data[second + 148:second + 155] = b"%06o\0" % sum(data[second:second + 512])
    else:
        data = bytearray()
    open(path, "wb").write(data)
    with pytest.raises(tar_headers.Unusual):
        list(shard_index._headers(path, None))
    try:
        expected = [(s.key, s.fields) for s in shard_index._samples(
            path, len(data), shard_index._tarfile_members(path, None))]
    except (ShardError, tarfile.TarError) as exc:
        with pytest.raises(ShardError) as got:
            shard_index.build_index(path)
        assert type(exc).__name__ in ("ShardError", "ReadError") and str(got.value)
    else:
        assert [(s.key, s.fields) for s in shard_index.build_index(path).samples] == expected
