"""device_decode=: the workers copy compressed JPEG bytes; the batch stage decodes, crops and resizes them.

Without a GPU the stage runs with Pillow in the loop's thread, through the same crop-and-resize code
(test_cuda.py covers nvJPEG where a GPU is present).
"""

import io

import numpy as np
import pytest
import torch
from helpers import wds_shards, write_tar
from PIL import Image

from feedline import StagingLoader
from feedline.errors import SettingError
from feedline.loader.device.device_decode import DeviceDecoder, crop_box, pick_backend
from feedline.loader.settings import DeviceDecode

COLORS = [(220, 30, 30), (30, 200, 40), (40, 60, 220), (230, 220, 40), (200, 40, 210)]


def solid_jpeg(color, size) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


@pytest.fixture
def colored(tmp_path):
    """webdataset-written shards, 48 samples: each .jpg one color, its .cls the color's index; sizes vary."""
    sizes = [(64, 48), (48, 64), (80, 40), (33, 57)]
    extra = {i: {"jpg": solid_jpeg(COLORS[i % 5], sizes[i % 4])} for i in range(48)}
    return wds_shards(str(tmp_path / "colored"), shards=4, per_shard=12, extra=extra)


def _color_of(image: torch.Tensor) -> int:
    mean = image.float().mean(dim=(0, 1))
    return int(np.argmin([float(((mean - torch.tensor(c, dtype=torch.float32)) ** 2).sum()) for c in COLORS]))


def test_batches_hold_decoded_images_of_the_set_size_each_with_its_own_label(colored):
    with StagingLoader(colored, batch_size=8, workers=2, fields=["jpg", "cls"],
                       device_decode={"fields": ["jpg"], "size": 32}) as loader:
        batches = list(loader)
    assert sum(len(b["cls"]) for b in batches) == 48
    for b in batches:
        assert b["jpg"].dtype == torch.uint8 and b["jpg"].shape == (len(b["cls"]), 32, 32, 3)
        assert "jpg_len" not in b
        assert [_color_of(img) for img in b["jpg"]] == b["cls"].tolist()


def test_the_workers_write_only_the_compressed_bytes_into_the_ring(colored, tmp_path):
    with StagingLoader(colored, batch_size=8, workers=1, fields=["jpg", "cls"], shuffle=False,
                       device_decode=DeviceDecode(fields=("jpg",), size=32)) as loader:
        field = next(f for f in loader.spec.fields if f.name == "jpg")
        assert field.variable and field.dtype == "|u1"
        keys = [k for b in loader for k in b["__key__"]]
        written = loader.stats().bytes_total["decoded"]
    compressed = sum(len(solid_jpeg(COLORS[int(k) % 5], [(64, 48), (48, 64), (80, 40), (33, 57)][int(k) % 4]))
                     for k in keys)
    assert compressed <= written <= compressed + 48 * 16  # the JPEGs and the labels, never decoded pixels
    assert written < 48 * 32 * 32 * 3


def test_an_image_nothing_can_decode_is_dropped_with_its_row_and_counted(tmp_path):
    samples = [(f"k{i:03d}", {"jpg": solid_jpeg(COLORS[i % 5], (40, 30)), "cls": str(i % 5).encode()})
               for i in range(20)]
    samples[7][1]["jpg"] = b"\xff\xd8 this is not a jpeg at all" * 4
    path = write_tar(str(tmp_path / "one.tar"), samples)
    with StagingLoader(path, batch_size=6, workers=1, shuffle=False, fields=["jpg", "cls"],
                       device_decode={"fields": ["jpg"], "size": 16}) as loader:
        batches = list(loader)
        assert loader.stats().sample_errors_total["corrupt"] == 1
    keys = [k for b in batches for k in b["__key__"]]
    assert "k007" not in keys and len(keys) == 19
    for b in batches:
        assert len(b["__key__"]) == len(b["cls"]) == len(b["jpg"])
        assert [_color_of(img) for img in b["jpg"]] == b["cls"].tolist()


def test_the_same_seed_gives_the_same_random_crops_and_another_seed_others(tmp_path):
    from helpers import jpeg_bytes

    path = write_tar(str(tmp_path / "photos.tar"), [(f"p{i}", {"jpg": jpeg_bytes(i), "cls": b"1"}) for i in range(16)])

    def images(seed):
        with StagingLoader(path, batch_size=8, workers=1, seed=seed, fields=["jpg", "cls"],
                           device_decode={"fields": ["jpg"], "size": 24, "crop": "random"}) as loader:
            return torch.cat([b["jpg"] for b in loader])

    three = images(3)
    assert torch.equal(three, images(3))
    assert not torch.equal(three, images(4))


def test_a_center_crop_keeps_the_middle_of_a_wide_image():
    s = DeviceDecode(size=32, crop="center")
    assert crop_box(50, 100, s) == (0, 25, 50, 75)  # height 50, width 100: the middle square
    img = np.zeros((20, 60, 3), np.uint8)
    img[:, :20] = (255, 0, 0)  # left third red, middle green, right third blue
    img[:, 20:40] = (0, 255, 0)
    img[:, 40:] = (0, 0, 255)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    decoder = DeviceDecoder(s, torch.device("cpu"), seed=0)
    out, _ = decoder.apply({"jpg": data[None], "jpg_len": torch.tensor([len(data)], dtype=torch.int32)},
                           {"__key__": ["wide"]})
    assert out["jpg"].shape == (1, 32, 32, 3)
    assert out["jpg"][0, 16, 16].tolist() == [0, 255, 0]


def test_device_decode_settings_are_refused_with_the_setting_named(colored):
    for bad in ({"crop": "zoom"}, {"size": 0}, {"backend": "magic"}, {"colour": 1}):
        with pytest.raises(SettingError, match="device_decode"):
            StagingLoader(colored, fields=["jpg", "cls"], device_decode=bad)
    with pytest.raises(SettingError, match="device_decode.*CUDA"):
        pick_backend("nvjpeg", torch.device("cpu"))
    with pytest.raises(SettingError, match="device_decode.*not among fields"):
        StagingLoader(colored, fields=["cls"], device_decode={"fields": ["jpg"]})
    with pytest.raises(SettingError, match="device_decode.*declare it"):
        StagingLoader(colored, fields=["jpg", "cls"], spec={"jpg": "text", "cls": "int64"},
                      device_decode={"fields": ["jpg"]})


def test_images_nothing_can_decode_count_against_the_failure_budget(tmp_path):
    from feedline import LoaderError

    samples = [(f"k{i:03d}", {"jpg": solid_jpeg(COLORS[0], (16, 16)) if i % 2 else b"\xff\xd8 broken" * 4,
                              "cls": b"0"}) for i in range(40)]
    path = write_tar(str(tmp_path / "half-bad.tar"), samples)
    with pytest.raises(LoaderError, match="too many bad samples.*corrupt"):
        with StagingLoader(path, batch_size=4, workers=1, fields=["jpg", "cls"], max_sample_errors=5,
                           device_decode={"fields": ["jpg"], "size": 8}) as loader:
            for _ in loader:
                pass


def test_the_batched_crop_resize_matches_torchs_antialiased_resize_of_each_crop():
    """resize_crops (two batched matrix products for the whole batch) against F.interpolate(antialias=True) on
    each image's crop alone: the same pixels, at most one level apart (float rounding)."""
    import torch.nn.functional as F

    from feedline.loader.device.device_decode import _padded, resize_crops

    gen = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), generator=gen, dtype=torch.uint8)
              for h, w in ((48, 64), (64, 40), (30, 30), (20, 90))]
    boxes = torch.tensor([[5, 7, 45, 60], [0, 0, 64, 40], [10, 12, 14, 20], [2, 30, 18, 88]])  # down, both, up
    flips = torch.tensor([False, True, False, True])
    out = resize_crops(_padded(images), boxes, (24, 32), flips)
    assert out.shape == (4, 24, 32, 3) and out.dtype == torch.uint8
    for img, (t, left, b, r), flip, got in zip(images, boxes.tolist(), flips.tolist(), out):
        crop = img[:, t:b, left:r].unsqueeze(0).float()
        want = F.interpolate(crop, size=(24, 32), mode="bilinear", antialias=True, align_corners=False)[0]
        want = want.flip(-1) if flip else want
        want = want.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0)
        assert (got.int() - want.int()).abs().max() <= 1


def test_crops_are_drawn_for_the_whole_batch_in_the_ranges_asked_for_and_by_key():
    from feedline.loader.device.device_decode import draw_boxes, key_seeds

    s = DeviceDecode(size=32, scale=(0.25, 0.5), ratio=(0.75, 1.3333))
    heights, widths = np.full(500, 300), np.full(500, 400)
    boxes, flips = draw_boxes(heights, widths, s, key_seeds(0, 0, "jpg", [f"k{i}" for i in range(500)]))
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) / (300 * 400)
    assert ((area > 0.22) & (area < 0.53)).all()  # the scale asked for (whole pixels round it a little)
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 2] <= 300).all() and (boxes[:, 3] <= 400).all()
    assert 0.4 < flips.mean() < 0.6 and len({tuple(b) for b in boxes.tolist()}) > 450
    again, _ = draw_boxes(heights[:3], widths[:3], s, key_seeds(0, 0, "jpg", ["k0", "k1", "k2"]))
    assert (again == boxes[:3]).all()  # a key's crop does not depend on its batch
    other, _ = draw_boxes(heights[:3], widths[:3], s, key_seeds(0, 1, "jpg", ["k0", "k1", "k2"]))
    assert not (other == boxes[:3]).all()  # another epoch, other crops


@pytest.mark.parametrize("threads", [0, 1])
def test_device_decode_on_the_stand_in_device_path_keeps_labels_aligned(colored, threads):
    with StagingLoader(colored, batch_size=8, workers=2, fields=["jpg", "cls"], device="standin",
                       transfer_threads=threads, device_decode={"fields": ["jpg"], "size": 32}) as loader:
        batches = list(loader)
    assert sum(len(b["cls"]) for b in batches) == 48
    for b in batches:
        assert b["jpg"].shape == (len(b["cls"]), 32, 32, 3) and "jpg_len" not in b
        assert [_color_of(img) for img in b["jpg"]] == b["cls"].tolist()
