"""Field decoders, chosen by the member's extension: what webdataset's default decoding gives.

| extension | decoded as |
|---|---|
| images: jpg jpeg png webp tif gif bmp ppm ... (webdataset's list, see ``IMAGE_EXTENSIONS``) | a lazy PIL image |
| cls cls2 index inx id (and class count) | int |
| txt text transcript | str |
| json jsn | the JSON value |
| npy | a zero-copy numpy view; object arrays refused |
| npz | dict of numpy arrays, ``allow_pickle=False`` |
| mp msg (and msgpack messagepack) | the msgpack value (``msgpack.unpackb``, as webdataset) |
| cbor | the CBOR value (``cbor2``) |
| ten tb | webdataset's tenbin: a list of arrays (zero-copy views) |
| pth | ``torch.load(weights_only=True)``: tensors and plain containers; anything else refused |
| ``<ext>.gz`` | gunzipped, then decoded as ``<ext>`` (``txt.gz`` -> str, ``jpg.gz`` -> image) |
| bin | raw bytes as a uint8 array (a spec may reinterpret them) |
| pkl pickle pyd | refused: loading them would unpickle, i.e. run code from the data |
| anything else (audio, video, ...) | bytes, for a decoder of the user's (``decode={"flac": fn}``) |

Images are lazy, so a transform can ask libjpeg-turbo for a reduced-size decode (JPEG draft mode)
before any pixel is decoded. A multi-dot extension (``seg.png``, ``depth.npy``) decodes by its
last part, as webdataset's handlers do; a user's decoder for the whole of it comes first.
Nothing here unpickles.
"""

from __future__ import annotations

import ast
import gzip
import importlib
import io
import json
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from . import tenbin

DecodeFn = Callable[[memoryview], Any]

# webdataset's IMAGE_EXTENSIONS (what PIL opens), less the formats PIL only names (bufr grib h5 hdf wmf emf),
# MPEG video (mpg mpeg: bytes, like other video) and PostScript (ps eps: needs Ghostscript).
IMAGE_EXTENSIONS = frozenset("""
    apng blp bmp bw cur dcx dds dib fit fits flc fli ftc ftu gbr gif icb icns ico iim im j2c j2k jfif jp2 jpc jpe
    jpeg jpf jpg jpx msp pbm pcd pcx pgm png pnm ppm psd pxr ras rgb rgba sgi tga tif tiff vda vst webp xbm xpm
    """.split())
INT_EXTENSIONS = frozenset({"cls", "cls2", "class", "count", "index", "inx", "id"})
TEXT_EXTENSIONS = frozenset({"txt", "text", "transcript"})
JSON_EXTENSIONS = frozenset({"json", "jsn"})
MSGPACK_EXTENSIONS = frozenset({"mp", "msg", "msgpack", "messagepack"})
TENBIN_EXTENSIONS = frozenset({"ten", "tb", "tenbin"})
UNSAFE_EXTENSIONS = frozenset({"pkl", "pickle", "pyd"})
# Members that decode to nested values (dicts, lists, arrays): they travel beside the slot as a tree.
TREE_EXTENSIONS = MSGPACK_EXTENSIONS | TENBIN_EXTENSIONS | frozenset({"cbor", "pth", "npz"})
GZIP_SUFFIX = ".gz"
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


def format_of(ext: str) -> str:
    """The format a member's content has once decoded: ``seg.png`` -> ``png``, ``txt.gz`` -> ``txt``."""
    if ext.endswith(GZIP_SUFFIX):
        ext = ext[: -len(GZIP_SUFFIX)]
    return last_part(ext)


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



def decode_msgpack(data: memoryview) -> Any:
    """``msgpack.unpackb`` with its defaults, as webdataset calls it (str keys, lists, no code run)."""
    import msgpack

    try:
        return msgpack.unpackb(data)
    except Exception as exc:  # ExtraData, FormatError, StackError, unhashable keys ...
        raise DecodeError(f"bad msgpack: {exc}") from None


decode_msgpack.package = "msgpack"  # type: ignore[attr-defined]


def decode_cbor(data: memoryview) -> Any:
    import cbor2

    try:
        return cbor2.loads(data)
    except Exception as exc:  # CBORDecodeError and what a tag's own decoding raises
        raise DecodeError(f"bad CBOR: {exc}") from None


decode_cbor.package = "cbor2"  # type: ignore[attr-defined]


def decode_tenbin(data: memoryview) -> list[np.ndarray]:
    try:
        return tenbin.decode(data)
    except tenbin.TenbinError as exc:
        raise DecodeError(f"bad tenbin (.ten): {exc}") from None


def decode_pth(data: memoryview) -> Any:
    """Tensors and plain containers only: ``weights_only=True`` loads no class the data names."""
    import pickle

    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        text = str(exc)
        first = text[text.index("Unsupported"):].split(" was ")[0] if "Unsupported" in text else type(exc).__name__
        raise UnsafeMemberError(
            f"'.pth' member holds more than tensors and plain containers, and loading the rest would unpickle "
            f"(run code from the data): torch.load(weights_only=True) refused it ({first}). Leave the field out "
            f"(fields=[...]), or pass decode={{'pth': your_function}} if you trust the data") from None
    except (RuntimeError, EOFError, ValueError, zlib.error) as exc:
        raise DecodeError(f"bad .pth: {exc}") from None


class Refuse:
    """The "decoder" of pickle members: refuses, naming the safety reason (picklable, unlike a closure)."""

    def __init__(self, ext: str):
        self.ext = ext

    def __call__(self, data: memoryview) -> Any:
        raise UnsafeMemberError(unsafe_reason(self.ext))


class Gunzip:
    """A ``<ext>.gz`` member: decompressed, then decoded by ``<ext>``'s decoder (webdataset's gzfilter)."""

    def __init__(self, inner: DecodeFn):
        self.inner = inner
        self.package = getattr(inner, "package", None)

    def __call__(self, data: memoryview) -> Any:
        try:
            plain = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise DecodeError(f"bad gzip member: {exc}") from None
        return self.inner(memoryview(plain))


DEFAULT_DECODERS: dict[str, DecodeFn] = {
    **{ext: decode_image for ext in IMAGE_EXTENSIONS},
    **{ext: decode_cls for ext in INT_EXTENSIONS},
    **{ext: decode_text for ext in TEXT_EXTENSIONS},
    **{ext: decode_json for ext in JSON_EXTENSIONS},
    **{ext: decode_msgpack for ext in MSGPACK_EXTENSIONS},
    **{ext: decode_tenbin for ext in TENBIN_EXTENSIONS},
    **{ext: Refuse(ext) for ext in UNSAFE_EXTENSIONS},
    "cbor": decode_cbor,
    "pth": decode_pth,
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
        self._resolved: dict[str, DecodeFn] = {}  # extension -> its decoder, worked out once per extension

    def __call__(self, ext: str, data: memoryview) -> Any:
        return self.function(ext)(data)

    def function(self, ext: str) -> DecodeFn:
        """The decoder of an extension, in webdataset's order.

        The table's own entry for the whole extension (a user's ``seg.png`` or ``txt.gz``) first; then a
        ``.gz`` member is gunzipped and decoded by what it wraps; then the last part (``seg.png`` -> png);
        else bytes.
        """
        fn = self._resolved.get(ext)
        if fn is None:
            fn = self._resolved[ext] = self._resolve(ext)
        return fn

    def _resolve(self, ext: str) -> DecodeFn:
        if ext not in self._table and self._table and (ext == "gz" or ext.endswith(GZIP_SUFFIX)):
            inner = ext[: -len(GZIP_SUFFIX)]
            return Gunzip(self._plain(inner) if inner else decode_bytes)
        return self._plain(ext)

    def _plain(self, ext: str) -> DecodeFn:
        fn = self._table.get(ext) or self._table.get(last_part(ext))
        if fn is not None:
            return fn
        return decode_bytes if self._table else decode_raw

    def missing_packages(self, extensions: Iterable[str]) -> dict[str, str]:
        """{extension: package} for the members whose decoder needs a package that is not installed."""
        out = {}
        for ext in extensions:
            package = getattr(self.function(ext), "package", None)
            if package:
                try:
                    importlib.import_module(package)
                except ImportError:
                    out[ext] = package
        return out
