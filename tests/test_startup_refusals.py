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


def bad_then_good(path: str, bad: list[bytes], good: int = 8) -> str:
    """A shard whose first samples' JPEGs are ``bad``, then ``good`` readable ones."""
    from helpers import jpeg_bytes

    samples = [(f"bad{i}", {"jpg": data, "cls": b"0"}) for i, data in enumerate(bad)]
    samples += [(f"good{i}", {"jpg": jpeg_bytes(i), "cls": b"1"}) for i in range(good)]
    return write_tar(path, samples)


def cut_and_random() -> list[bytes]:
    """A JPEG cut after its header, and random bytes: the issue's two bad first samples."""
    import random

    from helpers import jpeg_bytes

    return [jpeg_bytes(99)[:200], random.Random(0).randbytes(3000)]


def test_a_shard_whose_first_samples_are_bad_starts_when_the_failure_budget_lets_the_rest_be_read(tmp_path):
    path = bad_then_good(str(tmp_path / "s.tar"), cut_and_random())
    with StagingLoader(path, batch_size=2, workers=1, shuffle=False, max_sample_errors=10) as loader:
        keys = [k for batch in loader for k in batch["__key__"]]
    assert keys == [f"good{i}" for i in range(8)]
    errors = {k: v for k, v in loader.stats().sample_errors_total.items() if v}
    assert errors == {"corrupt": 2}, errors


def test_the_default_failure_budget_tries_past_two_bad_first_samples(tmp_path):
    path = bad_then_good(str(tmp_path / "s.tar"), cut_and_random(), good=40)  # 0.05 of 42 samples: 3 may go unread
    with StagingLoader(path, batch_size=2, workers=1, shuffle=False) as loader:
        assert next(iter(loader))["jpg"].shape[0] == 2


def test_a_shard_bad_past_the_failure_budget_is_refused_saying_how_many_samples_it_tried(tmp_path):
    path = bad_then_good(str(tmp_path / "s.tar"), cut_and_random() * 3)  # 6 bad first samples
    message = refusal(path, max_sample_errors=3)
    assert "(4 samples tried in 1 shard)" in message and "4 of them have a member that cannot be decoded" in message, \
        message


def rows_too_tight(path: str) -> str:
    """A Parquet file of a million rows in a few kilobytes: refused before indexing."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"bit": np.zeros(1_000_000, bool)}), path)
    return path


def test_a_refusal_says_its_reason_once_with_its_separators_and_nothing_logs_it_before(tmp_path, caplog):
    path = rows_too_tight(str(tmp_path / "bits.parquet"))
    message = refusal(path)
    assert message.count("declares 1000000 rows") == 1, message
    assert "(0 samples tried in 1 shard): no shard of them could be indexed: shard " in message, message
    assert message.endswith("(each row is a sample the index holds); check the shards"), message
    assert not [r for r in caplog.records if "declares 1000000 rows" in r.getMessage()]


def test_the_train_command_says_why_a_shard_is_skipped_once_and_ends_with_one_line_not_a_traceback(tmp_path):
    import subprocess
    import sys

    path = rows_too_tight(str(tmp_path / "bits.parquet"))
    out = subprocess.run([sys.executable, "-m", "feedline", "train", "--shards", path, "--epochs", "1",
                          "--metrics-port", "0"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    said = out.stdout + out.stderr
    assert out.returncode == 1, said
    assert said.count("declares 1000000 rows") == 1 and "Traceback" not in said, said
    assert "error: too many bad samples in epoch 0" in said, said
