"""Picklable sample transforms that run in the worker processes.

A transform takes the decoded sample dict and returns a dict. Image fields
arrive as lazy PIL images, so a downsizing transform can ask libjpeg-turbo
for a reduced-size decode (JPEG draft mode) before any pixel is decoded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any, Protocol

from .decoders import IMAGE_EXTENSIONS, format_of


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

    Uses JPEG draft mode: the decoder scales by 1/2, 1/4 or 1/8 while decoding
    when the crop will be downsized anyway, which is most of the cost saved.
    """

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        fields: Sequence[str] | None = None,
        draft: bool = True,
        flip: bool = True,
    ):
        if size < 1:
            raise ValueError(f"RandomResizedCrop size must be >= 1, got {size}")
        self.size = size
        self.scale = scale
        self.ratio = ratio
        self.fields = fields
        self.draft = draft
        self.flip = flip

    def _box(self, width: int, height: int) -> tuple[float, float, float, float]:
        return random_box(width, height, self.scale, self.ratio, random)

    def crop(self, img: Any) -> Any:
        from PIL import Image

        width, height = img.size
        x0, y0, x1, y1 = self._box(width, height)
        if self.draft and img.format == "JPEG":
            # Ask for the smallest decode that still covers the crop at the target size.
            want = (
                max(1, math.ceil(width * self.size / (x1 - x0))),
                max(1, math.ceil(height * self.size / (y1 - y0))),
            )
            img.draft("RGB", want)
            sx, sy = img.size[0] / width, img.size[1] / height
            x0, y0, x1, y1 = x0 * sx, y0 * sy, x1 * sx, y1 * sy
        if img.mode != "RGB":
            img = img.convert("RGB")
        out = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(x0, y0, x1, y1))
        if self.flip and random.random() < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return out

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        for key in _image_fields(sample, self.fields):
            sample[key] = self.crop(sample[key])
        return sample


class Compose:
    """Apply transforms in order (picklable when each one is)."""

    def __init__(self, *transforms: Any):
        self.transforms = transforms

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        for t in self.transforms:
            sample = t(sample)
        return sample
