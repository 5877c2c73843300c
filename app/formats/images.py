"""Image members: a lazy PIL image, refused when its pixels would pass the bound once loaded.

Pillow learns an image's size from its header, before any pixel is decoded, so a PNG that declares
30000x30000 pixels in a few hundred bytes is refused for what it would take (4 bytes a pixel, as
Pillow stores RGB), not after. In the decode workers, Pillow's own bomb check is set to the same
bound and made an error; the training process's Pillow is the user's and is left alone.
"""

from __future__ import annotations

import io
import re
import warnings
from typing import Any

from .bounds import DEFAULT_MAX_MEMBER_BYTES, IMAGE_BYTES_PER_PIXEL, DecodeError, MemberTooLarge, about

_pillow_pixels: int | None = None  # the MAX_IMAGE_PIXELS this process set: the largest any decoder's bound allows
_own_process = False  # a decode worker's: Pillow's settings are ours to set (never the user's training process)


def own_pillow() -> None:
    """This process is feedline's own (a decode worker): image decoders may set Pillow's bomb limit here. The
    training process, which decodes a few samples to infer the spec, keeps Pillow as its user set it; the
    header check of ``decode_image`` holds the bound there."""
    global _own_process
    _own_process = True


def limit_pillow(bound: int) -> None:
    """Pillow's own bomb check at the bound, and an error rather than a warning, in a process of ours.

    ``Image.MAX_IMAGE_PIXELS`` is the process's: where decoders with several bounds share one, it is the
    largest, and each decoder's own check (``decode_image``) holds its smaller ones. The warnings filter is
    set again if something reset the filters since (``warnings.catch_warnings`` in the training process).
    """
    global _pillow_pixels
    if not _own_process:
        return
    from PIL import Image

    pixels = max(1, bound // IMAGE_BYTES_PER_PIXEL)
    if _pillow_pixels is None or pixels > _pillow_pixels:
        Image.MAX_IMAGE_PIXELS = _pillow_pixels = pixels
    bomb = Image.DecompressionBombWarning
    if not any(f[0] == "error" and f[2] is bomb for f in warnings.filters):
        warnings.simplefilter("error", bomb)


_PILLOW_PIXELS = re.compile(r"\((\d+) pixels\)")


def decode_image(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> Any:
    """A lazy PIL image, refused when its pixels (at 4 bytes each) would pass the bound once loaded."""
    from PIL import Image

    limit_pillow(bound)
    try:
        image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        m = _PILLOW_PIXELS.search(str(exc))
        pixels = f"{m.group(1)} pixels ({about(int(m.group(1)) * IMAGE_BYTES_PER_PIXEL)} at 4 bytes a pixel)" \
            if m else "more pixels than allowed"
        raise MemberTooLarge(f"declares {pixels},", bound) from None
    except Exception as exc:  # PIL raises many types for bad input
        raise DecodeError(f"not a readable image: {exc}") from None
    width, height = image.size
    need = width * height * IMAGE_BYTES_PER_PIXEL
    if need > bound:
        raise MemberTooLarge(f"declares {width}x{height} pixels ({about(need)} at 4 bytes a pixel),", bound)
    return image
