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
    """The crop of ``data`` by the decoder and by Pillow, from the same seed (the same box and flip), as arrays,
    and whether the decoder made the first (else it was left to Pillow)."""
    decoded = []
    real = fastjpeg.crop_resize

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        decoded.append(True)
        return out

    fastjpeg.crop_resize = counted
    try:
        random.seed(seed)
        fast = RandomResizedCrop(size, fields=["jpg"], **kw)({"jpg": decode_image(memoryview(data))})["jpg"]
    finally:
        fastjpeg.crop_resize = real
    random.seed(seed)
    pil = RandomResizedCrop(size, fields=["jpg"], fast=False, **kw)({"jpg": decode_image(memoryview(data))})["jpg"]
    assert fast.mode == pil.mode == "RGB"  # either path: a PIL RGB image, packed into the slot in one pass
    return np.asarray(fast), np.asarray(pil), bool(decoded)


def test_the_decoder_is_built_where_setup_ran():
    assert fastjpeg.available(), fastjpeg.status()[1]


def test_at_pillows_scale_the_pixels_are_the_pil_paths_over_300_photos(photos):
    worst = []
    for i, (kind, data) in enumerate(photos):
        fast, pil, decoded = both_paths(data, size=224 if i % 2 else 64, seed=i)
        assert decoded and fast.shape == pil.shape and fast.dtype == np.uint8, kind
        diff = np.abs(fast.astype(int) - pil.astype(int))
        worst.append((diff.reshape(-1, 3).mean(axis=0).max(), diff.max(), kind, i))
    worst.sort(reverse=True)
    assert worst[0][0] <= 2.0, worst[:5]  # the bound, per channel
    assert worst[0][1] == 0, worst[:5]  # in fact every pixel is the same
    assert {w[2] for w in worst} == set(KINDS)


def test_the_smallest_power_of_two_scale_that_covers_the_output_keeps_the_pixels_within_two(photos):
    worst = 0.0
    for i, (kind, data) in enumerate(photos[:150]):
        fast, pil, _ = both_paths(data, size=224 if i % 2 else 64, seed=i, dct_scales=fastjpeg.PIL_SCALES)
        worst = max(worst, np.abs(fast.astype(int) - pil.astype(int)).reshape(-1, 3).mean(axis=0).max())
    assert worst <= 2.0


def test_the_same_seed_gives_the_same_pixels(photos):
    kind, data = photos[1]
    a, _, _ = both_paths(data, seed=5)
    b, _, _ = both_paths(data, seed=5)
    c, _, _ = both_paths(data, seed=6)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("cut", [0.1, 0.9], ids=["in the box", "below the box"])
def test_a_truncated_jpeg_is_a_decode_error_wherever_it_is_cut(photos, cut):
    from PIL import Image

    kind, data = photos[0]  # a baseline JPEG: its rows are stored top to bottom
    w, h = Image.open(io.BytesIO(data)).size
    with pytest.raises(DecodeError, match="truncated"):  # the box: the top quarter's left quarter
        fastjpeg.crop_resize(data[:int(len(data) * cut)], (0.0, 0.0, w / 4, h / 4), 32)
    assert fastjpeg.crop_resize(data, (0.0, 0.0, w / 4, h / 4), 32).size == (32, 32)  # whole, it decodes


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
    fast, pil, decoded = both_paths(buf.getvalue())
    assert not decoded and np.array_equal(fast, pil)


def test_without_the_decoder_the_crop_is_pillows(photos, monkeypatch):
    monkeypatch.setattr(fastjpeg, "_jpegcrop", None)
    fast, pil, decoded = both_paths(photos[0][1])
    assert not decoded and np.array_equal(fast, pil)


@pytest.mark.parametrize("size", [(224, 224), (33, 17), (3, 5), (1, 1)], ids=str)
def test_a_pil_rgb_image_is_packed_into_a_slot_row_with_numpys_pixels(size):
    from PIL import Image

    pixels = np.random.default_rng(sum(size)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    slot = np.zeros((3, size[1], size[0], 3), np.uint8)
    assert fastjpeg.pack_into(Image.fromarray(pixels), slot[1])
    assert np.array_equal(slot[1], pixels) and not slot[0].any() and not slot[2].any()


@pytest.mark.parametrize("width", [224, 112])
@pytest.mark.parametrize("shift", [0, 1, 16])
def test_a_slot_row_packed_past_the_caches_has_the_pixels_of_one_packed_through_them(width, shift):
    from PIL import Image

    from feedline.formats import _jpegcrop

    pixels = np.random.default_rng(width + shift).integers(0, 256, (width, width, 3), dtype=np.uint8)
    n = width * width * 3
    raw = np.zeros(3 * n + 64, np.uint8)
    at = (-raw.ctypes.data) % 32 + shift  # rows 32-byte aligned at shift 0 (a ring slot's are)
    slot = raw[at : at + 3 * n].reshape(3, width, width, 3)
    assert fastjpeg.pack_into(Image.fromarray(pixels), slot[1], stream=True)
    assert np.array_equal(slot[1], pixels) and not slot[0].any() and not slot[2].any()
    streams = _jpegcrop.simd() == "AVX2" and shift == 0 and width % 32 == 0  # else rows as without stream
    assert _jpegcrop.can_stream(slot[1], width) == streams


def test_what_cannot_be_packed_in_one_pass_is_left_untouched_for_numpys_copy():
    from PIL import Image

    rgb = Image.new("RGB", (8, 6), (1, 2, 3))
    for img, out in [(rgb.convert("L"), np.zeros((6, 8, 3), np.uint8)),  # another mode
                     (rgb.convert("RGBA"), np.zeros((6, 8, 3), np.uint8)),
                     (rgb, np.zeros((6, 9, 3), np.uint8)),  # another size
                     (rgb, np.zeros((6, 8, 3), np.float32)),  # another dtype
                     (rgb, np.zeros((6, 16, 3), np.uint8)[:, ::2])]:  # not contiguous
        assert not fastjpeg.pack_into(img, out) and not out.any()


@pytest.fixture
def without_avx2():
    from feedline.formats import _jpegcrop

    if not _jpegcrop.use_avx2(True):
        pytest.skip(f"this CPU's resize is {_jpegcrop.simd()}: no AVX2 to compare with")
    _jpegcrop.use_avx2(False)
    assert _jpegcrop.simd() == "SSE2"
    yield
    _jpegcrop.use_avx2(True)


@pytest.mark.parametrize("size", [224, 37, 7, 1])
def test_the_sse2_resize_has_the_avx2_ones_pixels(photos, size, without_avx2):
    from feedline.formats import _jpegcrop

    with_sse2 = [crop_of(data, size, seed=i) for i, (kind, data) in enumerate(photos[:40])]
    assert _jpegcrop.use_avx2(True) and _jpegcrop.simd() == "AVX2"
    assert all(np.array_equal(crop_of(data, size, seed=i), want) for i, ((kind, data), want)
               in enumerate(zip(photos[:40], with_sse2)))


def test_the_plain_c_resize_has_the_simd_ones_pixels(photos, tmp_path):
    """What a host without SSE2 (ARM) runs: the extension built without SIMD, in a process of its own."""
    import subprocess
    import sys
    import sysconfig

    src = os.path.join(ROOT, "app", "formats")
    lib = tmp_path / f"_jpegcrop{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-std=c11", "-DFEEDLINE_NO_SIMD",
                    f"-I{sysconfig.get_paths()['include']}", os.path.join(src, "_jpegcrop.c"),
                    os.path.join(src, "_resample.c"), "-ljpeg", "-lm", "-o", str(lib)], check=True)
    cases = [(data, i) for i, (kind, data) in enumerate(photos[:30])]
    np.save(tmp_path / "want.npy", np.stack([np.asarray(crop_of(data, 37, seed=i)) for data, i in cases]))
    (tmp_path / "cases.py").write_text(f"""
import importlib.util, sys
import numpy as np
sys.path.insert(0, {os.path.dirname(__file__)!r})
spec = importlib.util.spec_from_file_location("_jpegcrop", {str(lib)!r})
plain = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plain)
assert plain.simd() == "plain C", plain.simd()
from feedline.formats import fastjpeg
fastjpeg._jpegcrop = plain
from test_jpegcrop import make_photos, crop_of
photos = make_photos()
got = np.stack([np.asarray(crop_of(data, 37, seed=i)) for i, (kind, data) in enumerate(photos[:30])])
assert np.array_equal(got, np.load({str(tmp_path / "want.npy")!r}))
""")
    subprocess.run([sys.executable, str(tmp_path / "cases.py")], check=True, cwd=ROOT)


def crop_of(data, size, seed):
    """The crop decoder's crop of ``data`` at a box drawn from ``seed``, mirrored for odd seeds."""
    from PIL import Image

    w, h = Image.open(io.BytesIO(data)).size
    box = random_box_for(w, h, seed)
    return fastjpeg.crop_resize(data, box, size, fastjpeg.pillow_scale(w, h, box, size), flip=seed % 2 == 1)


def random_box_for(width, height, seed):
    from feedline.formats.transforms import random_box

    return random_box(width, height, (0.08, 1.0), (3 / 4, 4 / 3), random.Random(seed))


def test_a_crop_can_be_changed_like_any_pillow_image(photos):
    """It is made on the decoder's pixels, read-only: a change copies them first."""
    kind, data = photos[0]
    img = fastjpeg.crop_resize(data, (0.0, 0.0, 40.0, 40.0), 16)
    core, before = img.im, np.asarray(img).copy()
    assert img.readonly
    img.putpixel((0, 0), (1, 2, 3))
    after = np.asarray(img)
    assert tuple(after[0, 0]) == (1, 2, 3) and np.array_equal(after[1:], before[1:])
    assert img.im is not core and core.getpixel((0, 0)) == tuple(before[0, 0])  # the decoder's pixels untouched


@pytest.mark.parametrize("size", [224, 37, 16, 13, 7, 3, 1])
@pytest.mark.parametrize("flip", [False, True], ids=["as is", "mirrored"])
def test_the_pixels_are_pillows_resize_of_the_whole_image_exactly(photos, size, flip):
    """The coefficients are Pillow's for the box in the whole image; the decoded part's pixels are the whole
    decode's: so every pixel equals the PIL path's, for boxes of any size (from 3 pixels up to a whole photo)."""
    from PIL import Image

    for i, (kind, data) in enumerate(photos[:70]):  # every kind: grey too
        w, h = Image.open(io.BytesIO(data)).size
        boxes = (random_box_for(w, h, seed=i), (0.0, 0.0, float(w), float(h)), (w / 3, h / 2, w / 3 + 3, h / 2 + 3))
        for box in boxes:
            m = fastjpeg.pillow_scale(w, h, box, size)
            fast = np.asarray(fastjpeg.crop_resize(data, box, size, m, flip))
            pil = np.asarray(RandomResizedCrop(size)._pil(Image.open(io.BytesIO(data)), box, flip))
            assert np.array_equal(fast, pil), (kind, i, box, size)


def test_a_box_past_the_image_is_refused(photos):
    from PIL import Image

    kind, data = photos[0]
    w, h = Image.open(io.BytesIO(data)).size
    with pytest.raises(ValueError, match="passes the"):
        fastjpeg.crop_resize(data, (0.0, 0.0, w + 1.0, h / 2), 16)
    with pytest.raises(ValueError, match="passes the"):
        fastjpeg.crop_resize(data, (0.0, 0.0, 1.2e9, h / 2), 1)


def test_the_extension_imported_under_both_its_names_raises_what_either_copy_catches():
    """The package is ``feedline`` installed and ``app`` in the source tree: a process may import both (the suite
    does), and a second import of the extension must not make new error classes the first copy cannot catch."""
    import importlib

    tree = importlib.import_module("app.formats._jpegcrop")
    installed = importlib.import_module("feedline.formats._jpegcrop")
    assert tree.Error is installed.Error and tree.Unsupported is installed.Unsupported
    with pytest.raises(importlib.import_module("app.formats.bounds").DecodeError):  # (the tree's copy's class)
        importlib.import_module("app.formats.fastjpeg").crop_resize(b"\xff\xd8\xff\xdb" + bytes(64), (0, 0, 8, 8), 8)
