"""Picklable sample transforms that run in the worker processes.

A transform takes the decoded sample dict and returns a dict. Image fields
arrive as lazy PIL images, so a downsizing transform can ask libjpeg-turbo
for a reduced-size decode (JPEG draft mode) before any pixel is decoded.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Sequence
from typing import Any, Protocol

from . import fastjpeg
from .decoders import IMAGE_EXTENSIONS, format_of


# What a sample's transform may draw from: a worker seeds each from the sample before the transform runs
# (loader/plan/seeding.py), those a transform's class declares in ``generators`` or, where it declares none, all.
GENERATORS = frozenset({"random", "numpy", "torch"})


def generators_of(transform: Any) -> frozenset[str]:
    """The generators a sample's draws need seeded: none without a transform; those its class declares in
    ``generators`` (a class attribute or property); all three where it declares none. Read on the transform's
    own class, not inherited: a subclass that changes ``__call__`` may draw from others, so it declares anew."""
    if transform is None:
        return frozenset()
    if "generators" not in vars(type(transform)):
        return GENERATORS
    declared = frozenset(transform.generators)
    unknown = declared - GENERATORS
    if unknown:
        raise ValueError(f"{type(transform).__name__}.generators names {sorted(unknown)}: the generators a "
                         f"transform may draw from are {sorted(GENERATORS)}")
    return declared


class Uniform(Protocol):
    """Where crops draw from: the ``random`` module in the workers, a seeded ``random.Random`` elsewhere."""

    def uniform(self, a: float, b: float) -> float: ...


def random_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float],
               rng: Uniform) -> tuple[float, float, float, float]:
    """Inception's crop (x0, y0, x1, y1): a random share ``scale`` of the area at a random aspect ``ratio``;
    after ten misses, the centred square."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = math.sqrt(target * aspect)
        h = math.sqrt(target / aspect)
        if 0 < w <= width and 0 < h <= height:
            x = rng.uniform(0, width - w)
            y = rng.uniform(0, height - h)
            return x, y, x + w, y + h
    side = min(width, height)  # fall back to a centre crop
    x, y = (width - side) / 2, (height - side) / 2
    return x, y, x + side, y + side


def _image_fields(sample: dict[str, Any], fields: Sequence[str] | None) -> list[str]:
    if fields is not None:
        return list(fields)
    return [k for k in sample if format_of(k) in IMAGE_EXTENSIONS]


class RandomResizedCrop:
    """Inception-style random crop of a random area and aspect ratio, resized to a square.

    The box is drawn from the image's size, which the JPEG header gives before any pixel is
    decoded. With the ``_jpegcrop`` extension built (``feedline doctor`` says), a JPEG is then
    decoded only where the box and the filter need it, at the DCT scale Pillow's draft mode would
    pick, and resized with Pillow's BILINEAR arithmetic. Without it (or with ``fast=False``, or for
    CMYK and other images) Pillow decodes, in draft mode. Either way the result is a PIL RGB image
    (which the batch slot packs in one pass), and the same seed draws the same box and flip.
    """

    generators = ("random",)  # the box and the flip: a worker leaves np.random and torch unseeded for it

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        fields: Sequence[str] | None = None,
        draft: bool = True,
        flip: bool = True,
        fast: bool = True,
        dct_scales: tuple[int, ...] | None = None,
    ):
        if size < 1:
            raise ValueError(f"RandomResizedCrop size must be >= 1, got {size}")
        if dct_scales is not None and not (dct_scales and all(1 <= m <= 8 for m in dct_scales)):
            raise ValueError(f"RandomResizedCrop dct_scales are m of m/8, 1 to 8; got {dct_scales}")
        self.size = size
        self.scale = scale
        self.ratio = ratio
        self.fields = fields
        self.draft = draft
        self.flip = flip
        self.fast = fast
        self.dct_scales = dct_scales  # None: the scale Pillow's draft picks (the same pixels as the PIL path)

    def _box(self, width: int, height: int) -> tuple[float, float, float, float]:
        return random_box(width, height, self.scale, self.ratio, random)

    def _flipped(self) -> bool:
        return self.flip and random.random() < 0.5

    def crop(self, img: Any) -> Any:
        """The PIL path: a PIL image of ``size`` x ``size``."""
        width, height = img.size
        box = self._box(width, height)
        return self._pil(img, box, self._flipped())

    def _pil(self, img: Any, box: tuple[float, float, float, float], flip: bool) -> Any:
        from PIL import Image

        width, height = img.size
        x0, y0, x1, y1 = box
        if self.draft and img.format == "JPEG":
            # Ask for the smallest decode that still covers the crop at the target size.
            img.draft("RGB", fastjpeg.draft_request(width, height, box, self.size))
            sx, sy = img.size[0] / width, img.size[1] / height
            x0, y0, x1, y1 = x0 * sx, y0 * sy, x1 * sx, y1 * sy
        if img.mode != "RGB":
            img = img.convert("RGB")
        out = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(x0, y0, x1, y1))
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return out

    def _fast_source(self, img: Any) -> Any:
        """The JPEG's bytes when the fast path can decode it (a JPEG not yet decoded, RGB or grey), else None."""
        if not (self.fast and self.draft and fastjpeg.available()):
            return None
        if getattr(img, "format", None) != "JPEG" or img.mode not in ("RGB", "L") or getattr(img, "_im", 1) is not None:
            return None
        fp = getattr(img, "fp", None)
        return fp.getbuffer() if isinstance(fp, io.BytesIO) else None

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        for key in _image_fields(sample, self.fields):
            img = sample[key]
            data = self._fast_source(img)
            if data is None:
                sample[key] = self.crop(img)
                continue
            width, height = img.size
            box = self._box(width, height)
            flip = self._flipped()
            m = (fastjpeg.pillow_scale(width, height, box, self.size) if self.dct_scales is None
                 else fastjpeg.smallest_scale(box, self.size, self.dct_scales))
            try:
                sample[key] = fastjpeg.crop_resize(data, box, self.size, m, flip)
            except fastjpeg.Unsupported:
                sample[key] = self._pil(img, box, flip)
            finally:
                data.release()
        return sample


class Compose:
    """Apply transforms in order (picklable when each one is)."""

    def __init__(self, *transforms: Any):
        self.transforms = transforms

    @property
    def generators(self) -> frozenset[str]:
        """What its transforms draw from, together (all three where one of them declares nothing)."""
        return frozenset().union(*(generators_of(t) for t in self.transforms))

    @property
    def threads_per_worker(self) -> int:
        """The most decode threads any of its transforms runs in a worker (a ``VideoClip``'s)."""
        return max((int(getattr(t, "threads_per_worker", 1)) for t in self.transforms), default=1)

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        for t in self.transforms:
            sample = t(sample)
        return sample
