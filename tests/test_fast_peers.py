"""The benchmark's fastest peers, NVIDIA DALI's CPU pipeline and SPDL (issue 63): each delivers every sample of the
bench's tar shards once, at the crop size, from .venv-fast; the label text DALI cannot parse is read right."""

import argparse
import os

import pytest
import torch

from helpers import id_samples, jpeg_bytes, write_tar

from feedline.bench.fast_peers import CLS_BYTES, _ascii_ints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_PY = os.path.join(ROOT, ".venv-fast", "bin", "python")
LABELS = sorted(k * 100 + i for k in range(2) for i in range(20))


def test_a_padded_label_text_reads_as_its_number():
    texts = [b"0", b"7", b"42", b"12345678", b"905"]
    padded = torch.tensor([list(t.ljust(CLS_BYTES, b"\0")) for t in texts], dtype=torch.uint8)
    assert _ascii_ints(padded).tolist() == [0, 7, 42, 12345678, 905]


needs_fast = pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".venv-fast", ".feedline-fast")),
                                reason="needs .venv-fast: ./scripts/setup-fast-peers (./scripts/bench installs it; "
                                       "CI does not: DALI's wheel and its CUDA libraries are 1.5 GB)")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("fast")
    for k in range(2):
        write_tar(str(d / f"j-{k}.tar"), [(f"k{k}{i:03d}", {"jpg": jpeg_bytes(k * 100 + i, (48, 40)),
                                                            "cls": str(k * 100 + i).encode()}) for i in range(20)])
        write_tar(str(d / f"r-{k}.tar"), id_samples(k * 100, 20, payload=4096))
    return d


def _first_epoch(name, workload, pattern):
    from feedline.bench import contend

    args = argparse.Namespace(workers=2, batch_size=8, seconds=0.5, sample_size="4KiB")
    return contend._venv_contender(name, workload, pattern, args, FAST_PY, None, "--image-size", "32",
                                   "--report-epoch")["first_epoch"]


@needs_fast
@pytest.mark.parametrize("name", ["dali", "spdl"])
def test_a_fast_peer_delivers_every_jpeg_sample_once_at_the_crop_size(shards, name):
    got = _first_epoch(name, "jpeg", str(shards / "j-*.tar"))
    assert got["complete"] and got["labels"] == LABELS
    assert got["shapes"] == [[32, 32, 3, "torch.uint8"]]


@needs_fast
@pytest.mark.parametrize("name", ["dali", "spdl"])
def test_a_fast_peer_delivers_every_raw_sample_once_as_its_bytes(shards, name):
    got = _first_epoch(name, "raw", str(shards / "r-*.tar"))
    assert got["complete"] and got["labels"] == LABELS
    assert got["shapes"] == [[4096, "torch.uint8"]]
