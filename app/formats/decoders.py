"""Field decoders, chosen by the member's extension, with webdataset's meanings.

| extension | decoded as |
|---|---|
| jpg jpeg jpe jfif png ppm pgm pbm pnm bmp gif webp tif tiff | a lazy PIL image (see below) |
| cls cls2 class count index inx id | int |
| txt text transcript | str |
| json jsn | the JSON value |
| npy | a zero-copy numpy view; object arrays refused |
| npz | dict of numpy arrays, ``allow_pickle=False`` |
| bin | raw bytes as a uint8 array (a spec may reinterpret them) |
| pkl pickle pyd pth | refused: loading them would unpickle, i.e. run code from the data |
| anything else | bytes |

Images are lazy, so a transform can ask libjpeg-turbo for a reduced-size decode (JPEG draft mode)
before any pixel is decoded. A multi-dot extension (``seg.png``, ``depth.npy``) decodes by its
last part, as webdataset groups it. Nothing here unpickles.
"""

from __future__ import annotations

import ast
import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

DecodeFn = Callable[[memoryview], Any]

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "jpe", "jfif", "png", "ppm", "pgm", "pbm", "pnm", "bmp", "gif", "webp",
                              "tif", "tiff"})
INT_EXTENSIONS = frozenset({"cls", "cls2", "class", "count", "index", "inx", "id"})
TEXT_EXTENSIONS = frozenset({"txt", "text", "transcript"})
JSON_EXTENSIONS = frozenset({"json", "jsn"})
UNSAFE_EXTENSIONS = frozenset({"pkl", "pickle", "pyd", "pth"})
_NPY_MAGIC = b"\x93NUMPY"


class DecodeError(Exception):
    """A member that cannot be decoded: the sample is skipped and counted as corrupt."""


class UnsafeMemberError(DecodeError):
    """A member whose only decoder would unpickle (run code from the data): never decoded."""


def unsafe_reason(ext: str) -> str:
    return (f"'.{ext}' members are Python pickles: loading one runs code from the data, so feedline never "
            f"decodes them. Leave the field out (fields=[...]), or pass decode={{'{ext}': your_function}} "
            f"if you trust the data")


def last_part(ext: str) -> str:
    """``seg.png`` -> ``png``: the part of a multi-dot extension that names the format."""
    return ext.rsplit(".", 1)[-1]


def decode_image(data: memoryview) -> Any:
    from PIL import Image

    try:
        return Image.open(io.BytesIO(data))
    except Exception as exc:  # PIL raises many types for bad input
        raise DecodeError(f"not a readable image: {exc}") from None


def decode_npy(data: memoryview) -> np.ndarray:
    """A zero-copy view of an ``.npy`` member; object arrays are refused."""
    if bytes(data[:6]) != _NPY_MAGIC or len(data) < 10:
        raise DecodeError("not an .npy file (bad magic)")
    major = data[6]
    if major == 1:
        hlen, hstart = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3):
        hlen, hstart = int.from_bytes(data[8:12], "little"), 12
    else:
        raise DecodeError(f"unsupported .npy version {major}")
    try:
        header = ast.literal_eval(bytes(data[hstart : hstart + hlen]).decode("latin1"))
        dtype = np.dtype(np.lib.format.descr_to_dtype(header["descr"]))
        shape = tuple(int(d) for d in header["shape"])
        fortran = bool(header["fortran_order"])
    except Exception as exc:
        raise DecodeError(f"bad .npy header: {exc}") from None
    if dtype.hasobject:
        raise DecodeError(".npy holds Python objects; loading it would unpickle, refused")
    count = int(np.prod(shape, dtype=np.int64))
    offset = hstart + hlen
    if offset + count * dtype.itemsize > len(data):
        raise DecodeError(".npy is truncated")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C")


def decode_cls(data: memoryview) -> int:
    try:
        return int(bytes(data).decode("ascii").strip())
    except ValueError:
        raise DecodeError("class label is not an integer") from None


def decode_text(data: memoryview) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"text is not UTF-8: {exc}") from None


def decode_json(data: memoryview) -> Any:
    try:
        return json.loads(bytes(data))
    except ValueError as exc:
        raise DecodeError(f"bad JSON: {exc}") from None


def decode_npz(data: memoryview) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` member; object arrays would unpickle and are refused."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except ValueError as exc:  # numpy's refusal of object arrays, or a bad archive
        raise DecodeError(f"bad .npz (object arrays are never unpickled): {exc}") from None
    except Exception as exc:  # zipfile errors and the like
        raise DecodeError(f"bad .npz: {exc}") from None


def decode_raw(data: memoryview) -> np.ndarray:
    """Raw bytes as a uint8 view; a spec field of the same size reinterprets them."""
    return np.frombuffer(data, dtype=np.uint8)


def decode_bytes(data: memoryview) -> bytes:
    return bytes(data)


class Refuse:
    """The "decoder" of pickle members: refuses, naming the safety reason (picklable, unlike a closure)."""

    def __init__(self, ext: str):
        self.ext = ext

    def __call__(self, data: memoryview) -> Any:
        raise UnsafeMemberError(unsafe_reason(self.ext))


DEFAULT_DECODERS: dict[str, DecodeFn] = {
    **{ext: decode_image for ext in IMAGE_EXTENSIONS},
    **{ext: decode_cls for ext in INT_EXTENSIONS},
    **{ext: decode_text for ext in TEXT_EXTENSIONS},
    **{ext: decode_json for ext in JSON_EXTENSIONS},
    **{ext: Refuse(ext) for ext in UNSAFE_EXTENSIONS},
    "npy": decode_npy,
    "npz": decode_npz,
    "bin": decode_raw,
}


class Decoder:
    """Maps an extension to its decode function; picklable when its overrides are."""

    def __init__(self, decode: bool | Mapping[str, DecodeFn] = True):
        if decode is False:
            self._table: dict[str, DecodeFn] = {}
        elif decode is True:
            self._table = dict(DEFAULT_DECODERS)
        elif isinstance(decode, Mapping):
            self._table = {**DEFAULT_DECODERS, **{k.lower().lstrip("."): v for k, v in decode.items()}}
        else:
            raise TypeError(
                f"decode: expected True, False or a dict of extension -> function, got {type(decode).__name__}"
            )

    def __call__(self, ext: str, data: memoryview) -> Any:
        return self.function(ext)(data)

    def function(self, ext: str) -> DecodeFn:
        """The decoder of an extension: its own, else its last part's (``seg.png``), else bytes."""
        fn = self._table.get(ext) or self._table.get(last_part(ext))
        if fn is not None:
            return fn
        return decode_bytes if self._table else decode_raw
