"""The CUDA path: pinned ring, per-thread streams, events. Skipped where there is no GPU."""

import pytest
import torch
from helpers import id_shards

from feedline import StagingLoader

pytestmark = pytest.mark.cuda  # skipped without a CUDA device (conftest.py); scripts/gpu-check runs them

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
    # bin, cls and the key (side fields count too, as on the CPU: test_stats_report_queues_samples_and_bytes)
    assert s.bytes_total["transferred"] == 3 * 4 * 64 * (4096 + 8 + len("s0000000")) == s.bytes_total["decoded"]
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


def test_auto_runs_two_transfer_threads_on_a_gpu_host(gpu_shards):
    with StagingLoader(gpu_shards, batch_size=16, workers=2, transfer_threads="auto", spec=ID_SPEC,
                       device="cuda") as loader:
        assert loader.settings.transfer_threads == 2
        assert sorted(c for b in loader for c in b["cls"].tolist()) == list(range(4 * 64))


def test_a_state_saved_mid_epoch_on_the_gpu_resumes_the_same_batches(gpu_shards):
    def loader():
        return StagingLoader(gpu_shards, batch_size=16, workers=2, transfer_threads=2, spec=ID_SPEC, seed=3,
                             device="cuda")

    with loader() as whole:
        every = [b["cls"].cpu().tolist() for b in whole]
    with loader() as first:
        it = iter(first)
        head = [next(it)["cls"].cpu().tolist() for _ in range(5)]
        state = first.state_dict()
    with loader() as second:
        second.load_state_dict(state)
        tail = [b["cls"].cpu().tolist() for b in second]
    assert head + tail == every


def test_device_decode_on_the_gpu_crops_the_same_boxes_as_pillow_decode(tmp_path):
    """nvJPEG and Pillow's libjpeg differ by rounding only; the boxes (from seed, epoch, key) are the same."""
    from helpers import jpeg_bytes, write_tar

    path = write_tar(str(tmp_path / "photos.tar"), [(f"p{i:02d}", {"jpg": jpeg_bytes(i), "cls": b"1"})
                                                    for i in range(24)])

    def images(backend):
        with StagingLoader(path, batch_size=8, workers=1, seed=5, fields=["jpg", "cls"], device="cuda",
                           device_decode={"fields": ["jpg"], "size": 48, "crop": "random",
                                          "backend": backend}) as loader:
            return {k: img.cpu() for b in loader for k, img in zip(b["__key__"], b["jpg"])}

    gpu, cpu = images("auto"), images("pillow")
    assert gpu.keys() == cpu.keys() and len(gpu) == 24
    diffs = [float((gpu[k].float() - cpu[k].float()).abs().mean()) for k in gpu]
    assert max(diffs) < 4.0, diffs
