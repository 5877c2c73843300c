"""Decode only a JPEG's crop box, at a reduced DCT scale, with libjpeg-turbo (the ``_jpegcrop`` extension).

RandomResizedCrop draws its box from the image's size, which the header gives before any pixel is
decoded; the extension then skips the rows above the box, decodes only the iMCU columns it covers
and stops below it, resizing the rows as they come with Pillow's arithmetic for the whole image (so
Pillow's pixels), mirrored in the write where the crop is flipped. Where the extension was not built
(no compiler or no libjpeg headers at install), or a JPEG is one it does not decode (CMYK, YCCK),
the PIL path is used: same boxes, same draws, the same pixels.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .bounds import DecodeError

try:
    from . import _jpegcrop
except ImportError as exc:  # not built: the PIL path
    _jpegcrop = None  # type: ignore[assignment]
    _missing = str(exc)
else:
    _missing = ""

# The scales the decode may use, as m of m/8. Pillow's draft uses 1/8, 1/4, 1/2 and 1; libjpeg-turbo's
# scaled IDCTs at those four are SIMD, the others plain C (and move pixels: docs/loader.md).
PIL_SCALES = (1, 2, 4, 8)
ALL_SCALES = (1, 2, 3, 4, 5, 6, 7, 8)


def available() -> bool:
    """Whether the extension is built and loads."""
    return _jpegcrop is not None


def status() -> tuple[bool, str]:
    """(built, what it is or why not), for ``feedline doctor``."""
    if _jpegcrop is None:
        return False, f"not built ({_missing}): RandomResizedCrop decodes the whole JPEG with Pillow"
    turbo = getattr(_jpegcrop, "LIBJPEG_TURBO_VERSION", "no")
    return True, (f"libjpeg-turbo {turbo} (API {_jpegcrop.JPEG_LIB_VERSION}): RandomResizedCrop decodes only its box "
                  f"and resizes it with {_jpegcrop.simd()}")


def draft_request(width: int, height: int, box: tuple[float, float, float, float], size: int) -> tuple[int, int]:
    """The smallest full-image size whose box still covers ``size`` pixels: what the PIL path asks ``draft`` for."""
    x0, y0, x1, y1 = box
    return max(1, math.ceil(width * size / (x1 - x0))), max(1, math.ceil(height * size / (y1 - y0)))


def pillow_scale(width: int, height: int, box: tuple[float, float, float, float], size: int) -> int:
    """The m of the m/8 scale Pillow's ``draft`` picks for this box and output size (the PIL path's)."""
    want = draft_request(width, height, box, size)
    fits = min(width // want[0], height // want[1])
    for s in (8, 4, 2, 1):
        if fits >= s:
            return 8 // s
    return 8


def smallest_scale(box: tuple[float, float, float, float], size: int, scales: tuple[int, ...] = ALL_SCALES) -> int:
    """The smallest m of ``scales`` at which the box still covers ``size`` pixels both ways (8 if none does)."""
    x0, y0, x1, y1 = box
    for m in sorted(scales):
        if (x1 - x0) * m / 8 >= size and (y1 - y0) * m / 8 >= size:
            return m
    return 8


class Unsupported(Exception):
    """A JPEG this path does not decode (CMYK, YCCK, sampling over 2): the caller uses Pillow."""


def crop_resize(data: Any, box: tuple[float, float, float, float], size: int, m: int = 8,
                flip: bool = False) -> Any:
    """The box of the JPEG ``data`` decoded at m/8 and resized to ``size`` x ``size`` with Pillow's BILINEAR
    arithmetic, mirrored if ``flip``: a PIL RGB image, which the batch slot packs in one pass (``pack_into``)."""
    if _jpegcrop is None:
        raise Unsupported(f"the _jpegcrop extension is not built ({_missing})")
    from PIL import Image

    try:
        rgbx = _jpegcrop.crop_resize(data, size, size, *box, m, flip)
    except _jpegcrop.Unsupported as exc:
        raise Unsupported(str(exc)) from None
    except _jpegcrop.Error as exc:
        raise DecodeError(f"not a readable JPEG: {exc}") from None
    # RGBX, as Pillow holds RGB: the image is made on the pixels, not copied, and read as RGB in place (the same
    # 4 bytes a pixel); read-only, so what would change it copies it first
    out = Image.frombuffer("RGBX", (size, size), rgbx, "raw", "RGBX", 0, 1)
    try:
        out.im.setmode("RGB")
    except (AttributeError, ValueError):  # a Pillow without it: converted (a pass more)
        return out.convert("RGB")
    rgb = out._new(out.im)  # the image's mode is read from its core, now RGB
    rgb.readonly = 1
    return rgb


def pack_into(img: Any, out: np.ndarray, stream: bool = False) -> bool:
    """Write the PIL RGB image ``img`` into ``out`` (height x width x 3 uint8, C-contiguous) in one pass.

    numpy's way (``np.asarray(img)``, then a copy into the slot) packs the pixels into a bytes object first:
    two passes over them. False, having written nothing, where this one does not apply (another mode or
    layout, the extension not built): the caller copies as before. ``stream``: ``out`` is a batch slot, which
    this core does not read again: its rows go past the caches where they can (``out`` 32-byte aligned, a
    width that is a multiple of 32), so that the decoder's cached lines stay (a worker's samples a CPU-second
    rose about 4 % on JPEG at 224 x 224); a buffer used again at once (a loop's one slot) is better cached.
    """
    pack = getattr(_jpegcrop, "pack_rgb", None)  # None: not built, or built before it had pack_rgb
    if pack is None or getattr(img, "mode", None) != "RGB" or not hasattr(img, "getim"):
        return False
    width, height = img.size
    if (width < 1 or height < 1 or out.shape != (height, width, 3) or out.dtype != np.uint8
            or not out.flags.c_contiguous):
        return False
    try:
        pack(img.getim(), width, height, out, stream)
    except _jpegcrop.Unsupported:
        return False
    return True
