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

# webdataset's IMAGE_EXTENSIONS (what PIL opens), less the formats PIL only names (bufr grib h5 hdf wmf emf),
# MPEG video (mpg mpeg: bytes, like other video) and PostScript (ps eps: needs Ghostscript).
IMAGE_EXTENSIONS = frozenset("""
    apng blp bmp bw cur dcx dds dib fit fits flc fli ftc ftu gbr gif icb icns ico iim im j2c j2k jfif jp2 jpc jpe
    jpeg jpf jpg jpx msp pbm pcd pcx pgm png pnm ppm psd pxr ras rgb rgba sgi tga tif tiff vda vst webp xbm xpm
    """.split())
COMMON_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")  # tried first, in this order
_formats: tuple[str, ...] | None = None  # Pillow's formats of those extensions: all Image.open may try

_pillow_pixels: int | None = None  # the MAX_IMAGE_PIXELS this process set: the largest any decoder's bound allows
_bomb: type | None = None  # Pillow's DecompressionBombWarning, once limit_pillow set its filter
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
    global _pillow_pixels, _bomb
    if not _own_process:
        return
    pixels = max(1, bound // IMAGE_BYTES_PER_PIXEL)
    filters = warnings.filters
    if pixels == _pillow_pixels and filters and filters[0][0] == "error" and filters[0][2] is _bomb:
        return  # every image a worker decodes: the bound set and the filter first, as this call left them
    from PIL import Image

    if _pillow_pixels is None or pixels > _pillow_pixels:
        Image.MAX_IMAGE_PIXELS = _pillow_pixels = pixels
    _bomb = Image.DecompressionBombWarning
    if not any(f[0] == "error" and f[2] is _bomb for f in warnings.filters):
        warnings.simplefilter("error", _bomb)


_PILLOW_PIXELS = re.compile(r"\((\d+) pixels\)")


def image_formats() -> tuple[str, ...]:
    """The Pillow formats a dataset's image members can be (those of ``IMAGE_EXTENSIONS``, and MPO, a camera's
    JPEG): a member is sniffed by its content, so without this list a ``.jpg`` holding PostScript would open
    with the EPS plugin, which runs Ghostscript."""
    global _formats
    if _formats is None:
        from PIL import Image

        Image.init()
        known = Image.registered_extensions()
        wanted = {known[f".{e}"] for e in IMAGE_EXTENSIONS if f".{e}" in known} - {"EPS"} | {"MPO"}
        # Image.open tries them in this order. Image.ID's is the order the plugins were imported in: alphabetical
        # where Image.init() came first (Pillow 12), which put IM and IPTC, which have no signature check and try
        # a parse on every file, before JPEG: ~1 % of a JPEG sample's decode. So the common formats first, then
        # those that check a signature, then those that parse to find out; MPO opens through JPEG's factory where
        # it is not a format of its own
        found = [f for f in Image.ID if f in wanted]
        common = [f for f in COMMON_FORMATS if f in found]
        rest = [f for f in found if f not in common]
        _formats = tuple(common + [f for f in rest if Image.OPEN[f][1] is not None]
                         + [f for f in rest if Image.OPEN[f][1] is None])
    return _formats


def decode_image(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> Any:
    """A lazy PIL image, refused when its pixels (at 4 bytes each) would pass the bound once loaded."""
    from PIL import Image

    limit_pillow(bound)
    try:
        image = Image.open(io.BytesIO(data), formats=image_formats())
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
