"""A loader that cannot read one sample of its first shards says why at start-up (issue 62, item 2): the bound
and its setting, the member and its size, the decode error, and the fix; never just "check the shards"."""

import io
import tarfile

import pytest
import torch
from helpers import write_tar

from feedline import SettingError, StagingLoader


def refusal(path: str, **settings) -> str:
    with pytest.raises(SettingError) as info:
        with StagingLoader(path, batch_size=2, workers=1, shuffle=False, **settings) as loader:
            next(iter(loader))
    return str(info.value)


def test_every_sample_holding_a_pth_view_past_the_bound_is_refused_naming_the_member_its_size_and_the_setting(
        tmp_path):
    view = io.BytesIO()
    torch.save({"big": torch.zeros(1).expand(1 << 29)}, view)  # 4 bytes stored, 2 GiB once materialised
    path = write_tar(str(tmp_path / "views.tar"),
                     [(f"k{i}", {"cls": str(i).encode(), "pth": view.getvalue()}) for i in range(4)])
    message = refusal(path, max_member_bytes=1 << 20)
    assert "member 'pth'" in message and "2147483648 bytes" in message, message
    assert "max_member_bytes=1 MiB" in message and "StagingLoader(max_member_bytes=...)" in message, message
    assert "sample 'k0'" in message and "views.tar" in message, message


def test_a_compressed_shard_whose_members_inflate_past_the_bound_is_refused_naming_the_member_and_the_setting(
        tmp_path):
    path = str(tmp_path / "text.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for i in range(3):
            for ext, data in (("cls", str(i).encode()), ("txt", b"a" * (4 << 20))):  # 4 MiB, a few KiB gzipped
                info = tarfile.TarInfo(f"k{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    message = refusal(path, max_member_bytes=1 << 20, decompress_dir=str(tmp_path / "plain"))
    assert "member 'txt' is 4194304 bytes" in message and "max_member_bytes=1 MiB" in message, message
    assert "leave the field out (fields=[...])" in message, message


def test_every_sample_holding_an_undecodable_member_is_refused_naming_the_member_and_the_decode_error(tmp_path):
    path = write_tar(str(tmp_path / "bad.tar"), [(f"k{i}", {"cls": b"1", "npy": b"not an array"}) for i in range(3)])
    message = refusal(path)
    assert "member 'npy'" in message and "not an .npy file" in message, message
    assert "decode={" in message and "max_member_bytes" not in message, message


def test_a_shard_of_no_sample_is_refused_saying_its_index_holds_none(tmp_path):
    path = str(tmp_path / "loose.tar")
    with tarfile.open(path, "w") as tar:  # members with no key.extension name
        info = tarfile.TarInfo("README")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    message = refusal(path)
    assert "loose.tar" in message and "holds no samples" in message and "key.extension" in message, message
