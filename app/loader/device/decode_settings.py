"""``DeviceDecode``: the settings of ``device_decode=``, checked where they are made.

Its own file so that the loader's settings name it without importing the decoder (and torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SettingError

CROPS = ("random", "center")
BACKENDS = ("auto", "nvjpeg", "nvimgcodec", "pillow")


@dataclass(frozen=True)
class DeviceDecode:
    """Which fields the batch stage decodes, and the size and crop every image gets.

    ``crop="random"`` is Inception's random-resized crop (``scale``, ``ratio``) with a random
    horizontal flip when ``flip``; ``"center"`` the largest centred crop of the output's aspect.
    ``backend="auto"``: nvJPEG (torchvision) or else nvImageCodec on CUDA, Pillow on a CPU.
    """

    fields: tuple[str, ...] = ("jpg",)
    size: int | tuple[int, int] = 224
    crop: str = "random"
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        fields = (self.fields,) if isinstance(self.fields, str) else tuple(self.fields)
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise SettingError("device_decode", f"fields must name the image fields to decode, got {self.fields!r}")
        object.__setattr__(self, "fields", fields)
        size = (self.size, self.size) if isinstance(self.size, int) else tuple(self.size)
        if len(size) != 2 or not all(isinstance(d, int) and d >= 1 for d in size):
            raise SettingError("device_decode", f"size must be an int or (height, width) >= 1, got {self.size!r}")
        object.__setattr__(self, "size", size)
        if self.crop not in CROPS:
            raise SettingError("device_decode", f"crop must be one of {', '.join(CROPS)}, got {self.crop!r}")
        if self.backend not in BACKENDS:
            raise SettingError("device_decode", f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1 or not 0 < self.ratio[0] <= self.ratio[1]:
            raise SettingError("device_decode", f"scale must lie in (0, 1] and ratio be positive, low to high; got "
                                                f"scale={self.scale}, ratio={self.ratio}")
