"""The CUDA path: pinned ring, one copy a slot into device buffers, events made once; the path before it
(h2d="fields"); the training process's budget on a real GPU. Skipped where there is no GPU (test_device_path.py
runs the same code against the stand-in device everywhere)."""

import time

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


PATHS = [(0, "slot"), (1, "slot"), (2, "slot"), (2, "fields")]


@pytest.mark.parametrize("threads,h2d", PATHS)
def test_batches_arrive_on_the_gpu_intact(gpu_shards, threads, h2d):
    with StagingLoader(gpu_shards, batch_size=16, workers=2, transfer_threads=threads, h2d=h2d, spec=ID_SPEC,
                       device="cuda") as loader:
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


@pytest.mark.parametrize("threads,h2d", [(0, "slot"), (2, "fields")])
def test_copies_are_timed_and_the_stream_wait_is_measured(gpu_shards, threads, h2d):
    with StagingLoader(gpu_shards, batch_size=16, workers=2, spec=ID_SPEC, device="cuda", transfer_threads=threads,
                       h2d=h2d) as loader:
        for _ in range(3):
            for batch in loader:
                torch.cuda.current_stream().synchronize()
        s = loader.stats()
    assert s.batches_total == 3 * 16
    if h2d == "fields":
        assert s.h2d_seconds.count == s.batches_total  # every batch timed, two events made for it
    else:
        assert 1 <= s.h2d_seconds.count <= s.batches_total // 16 + 1  # one batch in 16
    # bin, cls and the key (side fields count too, as on the CPU: test_stats_report_queues_samples_and_bytes)
    assert s.bytes_total["transferred"] == 3 * 4 * 64 * (4096 + 8 + len("s0000000")) == s.bytes_total["decoded"]
    assert s.h2d_wait_seconds_total >= 0.0


@pytest.mark.parametrize("threads,h2d", PATHS)
def test_device_tensors_survive_the_next_batches(gpu_shards, threads, h2d):
    """A batch the loop keeps keeps its values: no later copy lands in its memory (a slot's device buffer is
    replaced while the loop holds its batch; the allocator's blocks are recorded on the loop's stream)."""
    with StagingLoader(gpu_shards, batch_size=16, workers=2, transfer_threads=threads, h2d=h2d, spec=ID_SPEC,
                       device="cuda") as loader:
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


def test_auto_runs_no_transfer_thread_on_a_gpu_host(gpu_shards):
    with StagingLoader(gpu_shards, batch_size=16, workers=2, transfer_threads="auto", spec=ID_SPEC,
                       device="cuda") as loader:
        assert loader.settings.transfer_threads == 0
        assert sorted(c for b in loader for c in b["cls"].tolist()) == list(range(4 * 64))


@pytest.mark.parametrize("threads", [0, 1])
def test_a_fed_loop_pays_at_most_three_cuda_calls_and_no_object_or_sync_a_batch_on_the_gpu(gpu_shards, threads):
    """The training process's budget (DESIGN.md), read from the loader's counters on a real GPU: a step of a few
    milliseconds, so the batches are ready when next() comes."""
    x = torch.randn(256, 256, device="cuda")
    with StagingLoader(gpu_shards, batch_size=16, workers=2, spec=ID_SPEC, device="cuda",
                       transfer_threads=threads) as loader:
        it = iter(loader)
        for _ in range(4):
            next(it)
        before = loader.cost()
        for _ in range(10):  # of 16: the window ends before the epoch's end (its last next() releases a batch it
            batch = next(it)  # does not count), as the stand-in's test (test_device_path.py) measures
            for _ in range(20):  # a launch-bound step: small kernels, the host ahead of the device
                x = torch.tanh(x @ x) * 0.5
            assert batch["bin"].is_cuda
            time.sleep(0.003)
        per = loader.cost().since(before).per_batch()
    assert per["device_calls_loop"] <= 3.0 and per["device_objects"] == 0 and per["host_syncs"] == 0, per
    assert per["wakeups"] <= 2.0, per


def test_a_state_saved_mid_epoch_on_the_gpu_resumes_the_same_batches(gpu_shards):
    def loader():
        return StagingLoader(gpu_shards, batch_size=16, workers=2, spec=ID_SPEC, seed=3, device="cuda")

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


def test_a_plain_cuda_device_places_the_training_process_by_the_current_gpus_numa_node(gpu_shards, monkeypatch):
    """device="cuda" (no index) is the current GPU: placement looks up its NUMA node as for cuda:N."""
    from feedline.loader.cpus import placement

    asked = []
    monkeypatch.setattr(placement, "gpu_node", lambda root="/", address=None, index=None: asked.append(index))
    with StagingLoader(gpu_shards, batch_size=16, workers=2, spec=ID_SPEC, device="cuda") as loader:
        p = loader.placement
    if p.why_not.startswith("the batches stay") or p.why_not.startswith("this host's CPUs"):
        pytest.skip(p.why_not)
    assert asked == [torch.cuda.current_device()], p.describe()
