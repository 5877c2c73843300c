"""Field decoders, chosen by the member's extension.

Nothing here unpickles: ``.npy`` refuses object arrays, ``.pyd``/``.pickle``
members are never decoded (they stay raw bytes). Images are returned as lazy
PIL images so a transform can use JPEG draft mode before pixels are decoded.
"""

from __future__ import annotations

import ast
import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

DecodeFn = Callable[[memoryview], Any]

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "ppm", "pgm", "pbm", "bmp", "webp", "tif", "tiff"})
_NPY_MAGIC = b"\x93NUMPY"


class DecodeError(Exception):
    """A member that cannot be decoded: the sample is skipped and counted as corrupt."""


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


def decode_raw(data: memoryview) -> np.ndarray:
    """Raw bytes as a uint8 view; a spec field of the same size reinterprets them."""
    return np.frombuffer(data, dtype=np.uint8)


DEFAULT_DECODERS: dict[str, DecodeFn] = {
    **{ext: decode_image for ext in IMAGE_EXTENSIONS},
    "npy": decode_npy,
    "cls": decode_cls,
    "cls2": decode_cls,
    "index": decode_cls,
    "txt": decode_text,
    "text": decode_text,
    "json": decode_json,
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
        fn = self._table.get(ext) or self._table.get(ext.rsplit(".", 1)[-1], decode_raw)
        return fn(data)
