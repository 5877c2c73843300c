"""The CUDA path: pinned ring, per-thread streams, events. Skipped where there is no GPU."""

import pytest
import torch
from helpers import id_shards

from feedline import StagingLoader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

ID_SPEC = {"cls": "int64", "bin": ("uint8", (4096,))}


@pytest.fixture
def gpu_shards(tmp_path):
    """4 shards of 64 samples with 4 KiB payloads: copies big enough to time."""
    return id_shards(str(tmp_path / "ids"), shards=4, per_shard=64, payload=4096)


def test_batches_arrive_on_the_gpu_intact(gpu_shards):
    with StagingLoader(gpu_shards, batch_size=16, workers=2, transfer_threads=2, spec=ID_SPEC, device="cuda") as loader:
        seen = []
        for batch in loader:
            assert batch["bin"].is_cuda and batch["cls"].is_cuda
            expected = (batch["cls"] % 251).to(torch.uint8)
            assert torch.equal(batch["bin"][:, 0], expected) and torch.equal(batch["bin"][:, -1], expected)
            seen.extend(batch["cls"].tolist())
        assert sorted(seen) == list(range(4 * 64))


def test_the_ring_is_page_locked_once(gpu_shards):
    with StagingLoader(gpu_shards, batch_size=16, workers=2, spec=ID_SPEC, device="cuda") as loader:
        ring = loader._pipeline.ring
        view = torch.from_numpy(ring.slot(0)["bin"])
        assert view.is_pinned()


def test_copies_are_timed_and_the_stream_wait_is_measured(gpu_shards):
    with StagingLoader(gpu_shards, batch_size=16, workers=2, spec=ID_SPEC, device="cuda") as loader:
        for _ in range(3):
            for batch in loader:
                torch.cuda.current_stream().synchronize()
        s = loader.stats()
    assert s.h2d_seconds.count == s.batches_total == 3 * 16
    assert s.bytes_total["transferred"] == 3 * 4 * 64 * (4096 + 8)
    assert s.h2d_wait_seconds_total >= 0.0


def test_device_tensors_survive_the_next_batches(gpu_shards):
    """The caching allocator must not hand a batch's memory to a later copy while the loop holds it."""
    with StagingLoader(gpu_shards, batch_size=16, workers=2, transfer_threads=2, spec=ID_SPEC, device="cuda") as loader:
        kept = [(b["cls"].clone(), b["bin"]) for b in loader]
        torch.cuda.synchronize()
        for cls, data in kept:
            assert torch.equal(data[:, 7], (cls % 251).to(torch.uint8))


def test_device_decode_decodes_jpegs_on_the_gpu_with_labels_aligned(tmp_path):
    from test_device_decode import COLORS, _color_of, solid_jpeg

    from feedline.loader.device.device_decode import pick_backend

    try:
        pick_backend("auto", torch.device("cuda"))
    except Exception as exc:  # SettingError: neither torchvision's decode_jpeg nor nvImageCodec here
        pytest.skip(str(exc))
    from helpers import write_tar

    samples = [(f"k{i:03d}", {"jpg": solid_jpeg(COLORS[i % 5], (64 + i, 48)), "cls": str(i % 5).encode()})
               for i in range(40)]
    samples[9][1]["jpg"] = b"\xff\xd8 not a jpeg" * 8
    path = write_tar(str(tmp_path / "colors.tar"), samples)
    with StagingLoader(path, batch_size=8, workers=2, device="cuda", fields=["jpg", "cls"],
                       device_decode={"fields": ["jpg"], "size": 32}) as loader:
        batches = list(loader)
        assert loader.stats().sample_errors_total["corrupt"] == 1
    assert sum(len(b["cls"]) for b in batches) == 39
    for b in batches:
        assert b["jpg"].is_cuda and b["jpg"].shape[1:] == (32, 32, 3)
        assert [_color_of(img.cpu()) for img in b["jpg"]] == b["cls"].tolist()
