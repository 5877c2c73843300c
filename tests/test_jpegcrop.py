"""RandomResizedCrop's crop decoder (app/formats/_jpegcrop.c): the PIL path's pixels, from only the box's part.

The photos are crops of scikit-image's sample photographs (the benchmark's), saved as the JPEGs users
have: baseline and progressive, 4:2:0, 4:2:2 and 4:4:4, colour and grey, with an EXIF orientation tag,
and CMYK (which the decoder leaves to Pillow).
"""

import io
import os
import random

import numpy as np
import pytest
from helpers import ROOT

from feedline.formats import fastjpeg
from feedline.formats.bounds import DecodeError
from feedline.formats.images import decode_image
from feedline.formats.transforms import RandomResizedCrop

KINDS = ("baseline", "progressive", "444", "422", "grey", "exif", "small")


@pytest.fixture(scope="module")
def photos():
    return make_photos()


def make_photos():
    """300 JPEGs: every kind of KINDS, cut at random places and sizes from the sample photographs."""
    from PIL import Image

    from feedline.demo.datasets import sample_photos

    rng = np.random.default_rng(7)
    out = []
    for i, img in enumerate(p for _ in range(34) for p in sample_photos(os.path.join(ROOT, ".cache"))):
        kind = KINDS[i % len(KINDS)]
        w, h = (int(rng.integers(24, 60)), int(rng.integers(24, 60))) if kind == "small" else \
            (int(rng.integers(200, 640)), int(rng.integers(160, 480)))
        w, h = min(w, img.width), min(h, img.height)
        x, y = int(rng.integers(img.width - w + 1)), int(rng.integers(img.height - h + 1))
        crop = img.crop((x, y, x + w, y + h))
        options = {"quality": int(rng.integers(70, 96))}
        if kind == "progressive":
            options["progressive"] = True
        elif kind in ("444", "422"):
            options["subsampling"] = {"444": 0, "422": 1}[kind]
        elif kind == "grey":
            crop = crop.convert("L")
        elif kind == "exif":
            exif = Image.Exif()
            exif[0x0112] = 6  # rotated: neither path applies it, both crop the stored pixels
            options["exif"] = exif
        buf = io.BytesIO()
        crop.save(buf, format="JPEG", **options)
        out.append((kind, buf.getvalue()))
        if len(out) == 300:
            break
    return out


def both_paths(data, size=64, seed=0, **kw):
    """The crop of ``data`` by the decoder and by Pillow, from the same seed (the same box and flip)."""
    random.seed(seed)
    fast = RandomResizedCrop(size, fields=["jpg"], **kw)({"jpg": decode_image(memoryview(data))})["jpg"]
    random.seed(seed)
    pil = RandomResizedCrop(size, fields=["jpg"], fast=False, **kw)({"jpg": decode_image(memoryview(data))})["jpg"]
    return fast, np.asarray(pil)


def test_the_decoder_is_built_where_setup_ran():
    assert fastjpeg.available(), fastjpeg.status()[1]


def test_at_pillows_scale_the_pixels_are_the_pil_paths_over_300_photos(photos):
    worst = []
    for i, (kind, data) in enumerate(photos):
        fast, pil = both_paths(data, size=224 if i % 2 else 64, seed=i)
        assert isinstance(fast, np.ndarray) and fast.shape == pil.shape and fast.dtype == np.uint8, kind
        diff = np.abs(fast.astype(int) - pil.astype(int))
        worst.append((diff.reshape(-1, 3).mean(axis=0).max(), diff.max(), kind, i))
    worst.sort(reverse=True)
    assert worst[0][0] <= 2.0, worst[:5]  # the bound, per channel
    assert np.mean([w[0] for w in worst]) < 0.1, worst[:5]  # in fact nearly every pixel is the same
    assert {w[2] for w in worst} == set(KINDS)


def test_the_smallest_power_of_two_scale_that_covers_the_output_keeps_the_pixels_within_two(photos):
    worst = 0.0
    for i, (kind, data) in enumerate(photos[:150]):
        fast, pil = both_paths(data, size=224 if i % 2 else 64, seed=i, dct_scales=fastjpeg.PIL_SCALES)
        worst = max(worst, np.abs(fast.astype(int) - pil.astype(int)).reshape(-1, 3).mean(axis=0).max())
    assert worst <= 2.0


def test_the_same_seed_gives_the_same_pixels(photos):
    kind, data = photos[1]
    a, _ = both_paths(data, seed=5)
    b, _ = both_paths(data, seed=5)
    c, _ = both_paths(data, seed=6)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("cut", [0.1, 0.9], ids=["in the box", "below the box"])
def test_a_truncated_jpeg_is_a_decode_error_wherever_it_is_cut(photos, cut):
    from PIL import Image

    kind, data = photos[0]  # a baseline JPEG: its rows are stored top to bottom
    w, h = Image.open(io.BytesIO(data)).size
    with pytest.raises(DecodeError, match="truncated"):  # the box: the top quarter's left quarter
        fastjpeg.crop_resize(data[:int(len(data) * cut)], (0.0, 0.0, w / 4, h / 4), 32)
    assert fastjpeg.crop_resize(data, (0.0, 0.0, w / 4, h / 4), 32).shape == (32, 32, 3)  # whole, it decodes


def test_garbage_after_the_header_is_a_decode_error(photos):
    kind, data = photos[0]
    rng = np.random.default_rng(1)
    start = len(data) // 3
    broken = data[:start] + rng.integers(0, 256, len(data) - start, dtype=np.uint8).tobytes()
    random.seed(0)
    with pytest.raises(DecodeError):
        RandomResizedCrop(32, fields=["jpg"])({"jpg": decode_image(memoryview(broken))})


def test_a_cmyk_jpeg_is_left_to_pillow(photos):
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(photos[0][1])).convert("CMYK").save(buf, format="JPEG")
    fast, pil = both_paths(buf.getvalue())
    assert isinstance(fast, Image.Image) and np.array_equal(np.asarray(fast), pil)


def test_without_the_decoder_the_crop_is_pillows(photos, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(fastjpeg, "_jpegcrop", None)
    fast, pil = both_paths(photos[0][1])
    assert isinstance(fast, Image.Image) and np.array_equal(np.asarray(fast), pil)
