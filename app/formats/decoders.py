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
| ``<ext>.gz`` ``.bz2`` ``.xz`` ``.zst`` | decompressed, then decoded as ``<ext>`` (``txt.gz`` -> str, ``jpg.xz`` -> image) |
| bin | raw bytes as a uint8 array (a spec may reinterpret them) |
| pkl pickle pyd | refused: loading them would unpickle, i.e. run code from the data |
| video: mp4 webm mkv avi mov | a ``VideoMember``: its bytes, which ``VideoClip`` turns into clips (``video.py``) |
| anything else (audio, ...) | bytes, for a decoder of the user's (``decode={"flac": fn}``) |

Images are lazy, so a transform can ask libjpeg-turbo for a reduced-size decode (JPEG draft mode)
before any pixel is decoded. A multi-dot extension (``seg.png``, ``depth.npy``) decodes by its
last part, as webdataset's handlers do; a user's decoder for the whole of it comes first.
Nothing here unpickles.

Every member is bounded by the decoder's ``max_member_bytes`` (``bounds.py``): as stored, and as
decoded — decompressed bytes, image pixels, the values of JSON/msgpack/CBOR, the sizes ``.npy``,
``.ten`` and ``.npz`` declare, CBOR's shared values once per reference. Past it a member is
``MemberTooLarge`` before the memory is taken (before a copy of it is, for CBOR's shared values).
"""

from __future__ import annotations

import importlib
import io
import json
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from . import tenbin
from .arrays import decode_npy, decode_npz
from .bounds import (
    DEFAULT_MAX_MEMBER_BYTES,
    DecodeError,
    MemberTooLarge,
    MsgpackTally,
    check_cbor,
    check_json,
    check_text,
    check_msgpack,
    check_stored,
    check_shared,
    fits_uncounted,
    may_share,
    msgpack_limits,
)
from .images import IMAGE_EXTENSIONS, decode_image
from .inflate import INFLATE, PACKAGES, split_suffix
from .video import VIDEO_EXTENSIONS, decode_video

__all__ = ["DEFAULT_MAX_MEMBER_BYTES", "DecodeError", "Decoder", "MemberTooLarge", "UnsafeMemberError", "decode_image",
           "decode_npy", "decode_npz"]

DecodeFn = Callable[[memoryview], Any]

INT_EXTENSIONS = frozenset({"cls", "cls2", "class", "count", "index", "inx", "id"})
TEXT_EXTENSIONS = frozenset({"txt", "text", "transcript"})
JSON_EXTENSIONS = frozenset({"json", "jsn"})
MSGPACK_EXTENSIONS = frozenset({"mp", "msg", "msgpack", "messagepack"})
TENBIN_EXTENSIONS = frozenset({"ten", "tb", "tenbin"})
UNSAFE_EXTENSIONS = frozenset({"pkl", "pickle", "pyd"})
# Members that decode to nested values (dicts, lists, arrays): they travel beside the slot as a tree.
TREE_EXTENSIONS = MSGPACK_EXTENSIONS | TENBIN_EXTENSIONS | frozenset({"cbor", "pth", "npz"})

# What bytes start with when they are an image Pillow opens (BMP's "BM" is too common a start to tell by).
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*")


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
    """The format a member's content has once decoded: ``seg.png`` -> ``png``, ``txt.gz.xz`` -> ``txt``."""
    split = split_suffix(ext)
    while split is not None and split[0]:
        ext = split[0]
        split = split_suffix(ext)
    return last_part(ext)


def decode_cls(data: memoryview) -> int:
    try:
        return int(bytes(data).decode("ascii").strip())
    except ValueError:
        raise DecodeError("class label is not an integer") from None


def decode_text(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> str:
    check_text(data, bound)
    try:
        return str(data, "utf-8")  # straight from the member's buffer: no copy of its bytes first
    except UnicodeDecodeError as exc:
        raise DecodeError(f"text is not UTF-8: {exc}") from None


def decode_json(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> Any:
    raw = bytes(data)
    check_text(raw, bound)  # json.loads decodes the whole member to one str first
    check_json(raw, bound)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"bad JSON: {exc}") from None


def decode_raw(data: memoryview) -> np.ndarray:
    """Raw bytes as a uint8 view; a spec field of the same size reinterprets them."""
    return np.frombuffer(data, dtype=np.uint8)


def decode_bytes(data: memoryview) -> bytes:
    return bytes(data)



def decode_msgpack(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> Any:
    """``msgpack.unpackb`` with its defaults, as webdataset calls it (str keys, lists, no code run), and the
    bound: declared lengths past it refused, values counted where the member could hold too many."""
    import msgpack

    from .member_ext import MemberExtType

    hooks: dict[str, Any] = {"ext_hook": MemberExtType}  # a member's extensions stay data (member_ext.py)
    if not fits_uncounted(len(data), bound):
        tally = MsgpackTally(len(data), bound)
        hooks.update(list_hook=tally.list_hook, object_hook=tally.object_hook)
    try:
        return msgpack.unpackb(data, **msgpack_limits(bound), **hooks)
    except MemberTooLarge:
        raise
    except Exception as exc:  # ExtraData, FormatError, StackError (deep nesting), unhashable keys ...
        check_msgpack(data, bound)  # a declared length past the bound says why
        raise DecodeError(f"bad msgpack: {exc or type(exc).__name__}") from None


decode_msgpack.package = "msgpack"  # type: ignore[attr-defined]


def decode_cbor(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> Any:
    """``cbor2.loads`` (which refuses nesting deeper than 400), after the bound's walk of the item heads; a member
    that may refer back to values (shared values, string references) is measured as it would be copied."""
    import cbor2

    check_cbor(data, bound)
    try:
        value = cbor2.loads(data)
    except Exception as exc:  # CBORDecodeError and what a tag's own decoding raises
        check_cbor(data, bound, small_too=True)  # a declared length past the bound says why
        raise DecodeError(f"bad CBOR: {exc}") from None
    if may_share(data):  # in memory each shared value is there once; copied, once per reference
        check_shared(value, bound)
    return value


decode_cbor.package = "cbor2"  # type: ignore[attr-defined]


def decode_tenbin(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> list[np.ndarray]:
    try:
        return tenbin.decode(data, bound)
    except tenbin.TenbinError as exc:
        raise DecodeError(f"bad tenbin (.ten): {exc}") from None


def decode_pth(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> Any:
    """Tensors and plain containers only: ``weights_only=True`` loads no class the data names. A tensor can be a
    view larger than what the member stores (``zeros(1).expand(2**31)``: 4 bytes stored, 8 GiB once copied), so
    every tensor counts at its elements x element size, views included, against the bound."""
    import pickle

    import torch

    try:
        value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        text = str(exc)
        first = text[text.index("Unsupported"):].split(" was ")[0] if "Unsupported" in text else type(exc).__name__
        raise UnsafeMemberError(
            f"'.pth' member holds more than tensors and plain containers, and loading the rest would unpickle "
            f"(run code from the data): torch.load(weights_only=True) refused it ({first}). Leave the field out "
            f"(fields=[...]), or pass decode={{'pth': your_function}} if you trust the data") from None
    except (RuntimeError, EOFError, ValueError, zlib.error) as exc:
        raise DecodeError(f"bad .pth: {exc}") from None
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
            if total > bound:
                raise MemberTooLarge(f"holds tensors of {total} bytes once materialised (views counted whole),",
                                     bound)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
    return value


class Refuse:
    """The "decoder" of pickle members: refuses, naming the safety reason (picklable, unlike a closure)."""

    def __init__(self, ext: str):
        self.ext = ext

    def __call__(self, data: memoryview) -> Any:
        raise UnsafeMemberError(unsafe_reason(self.ext))


class Bounded:
    """A default decoder that takes the bound, with the bound of its ``Decoder`` (picklable, unlike a closure)."""

    def __init__(self, fn: Callable[[memoryview, int], Any], bound: int):
        self.fn, self.bound = fn, bound
        self.package = getattr(fn, "package", None)

    def __call__(self, data: memoryview) -> Any:
        return self.fn(data, self.bound)


class Decompress:
    """A ``<ext>.gz`` (``.bz2``, ``.xz``, ``.zst``) member: decompressed within the bound, then decoded by
    ``<ext>``'s decoder (webdataset's gzfilter, for each compressor); ``<ext>`` may be compressed again."""

    def __init__(self, suffix: str, inner: DecodeFn, bound: int):
        self.suffix, self.inner, self.bound = suffix, inner, bound
        self.packages = tuple(p for p in (PACKAGES.get(suffix), getattr(inner, "package", None),
                                          *getattr(inner, "packages", ())) if p)

    def __call__(self, data: memoryview) -> Any:
        return self.inner(memoryview(INFLATE[self.suffix](data, self.bound)))


_BOUNDED = {"cbor": decode_cbor, "npy": decode_npy, "npz": decode_npz, **{e: decode_image for e in IMAGE_EXTENSIONS},
            **{e: decode_json for e in JSON_EXTENSIONS}, **{e: decode_msgpack for e in MSGPACK_EXTENSIONS},
            **{e: decode_tenbin for e in TENBIN_EXTENSIONS}, **{e: decode_video for e in VIDEO_EXTENSIONS}}


def default_decoders(bound: int = DEFAULT_MAX_MEMBER_BYTES) -> dict[str, DecodeFn]:
    """webdataset's table, each decoder that could take more than it is given bounded by ``bound``."""
    return {
        **{ext: Bounded(fn, bound) for ext, fn in _BOUNDED.items()},
        **{ext: decode_cls for ext in INT_EXTENSIONS},
        **{ext: Bounded(decode_text, bound) for ext in TEXT_EXTENSIONS},
        **{ext: Refuse(ext) for ext in UNSAFE_EXTENSIONS},
        "pth": Bounded(decode_pth, bound),  # views count at their full size
        "bin": decode_raw,
    }


class Decoder:
    """Maps an extension to its decode function, every member bounded by ``max_member_bytes``; picklable when
    its overrides are."""

    def __init__(self, decode: bool | Mapping[str, DecodeFn] = True,
                 max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES):
        self.max_member_bytes = max_member_bytes
        self._user: set[str] = set()  # the extensions decode= named
        defaults = default_decoders(max_member_bytes)
        if decode is False:
            self._table: dict[str, DecodeFn] = {}
        elif decode is True:
            self._table = defaults
        elif isinstance(decode, Mapping):
            self._user = {k.lower().lstrip(".") for k in decode}
            self._table = {**defaults, **{k.lower().lstrip("."): v for k, v in decode.items()}}
        else:
            raise TypeError(
                f"decode: expected True, False or a dict of extension -> function, got {type(decode).__name__}"
            )
        self._resolved: dict[str, DecodeFn] = {}  # extension -> its decoder, worked out once per extension

    def __call__(self, ext: str, data: memoryview) -> Any:
        """The member decoded; ``MemberTooLarge`` (naming it) when it is, or would decode to, more than the bound."""
        fn = self.function(ext)
        try:
            check_stored(len(data), self.max_member_bytes)
            return fn(data)
        except DecodeError as exc:  # MemberTooLarge names it in its message; any other, for who reports it
            if getattr(exc, "member", None) is None:
                exc.member = ext  # type: ignore[attr-defined]
            raise

    def overrides(self, ext: str) -> bool:
        """Whether ``decode=`` named ``ext`` (or was False: every member raw); a TFRecord feature is decoded
        by the user's function for its name, never by a default that shares it."""
        return ext in self._user or not self._table

    def value(self, name: str, data: bytes | memoryview) -> Any:
        """A bytes value of a record format (a TFRecord feature, a Parquet column), which has a name, not an
        extension: the user's decoder for the name where ``decode=`` gives one (``decode=False``: a raw array),
        an image where the bytes are one (Pillow tells the format from them; a user's ``jpg``/``png`` decoder
        first), else the bytes as they are (a view stays a view: ``parquet.read_row`` gives one only where
        nothing but a batch slot reads it). A default never applies by name: a string named ``id`` is no
        ``.id`` member."""
        if self.overrides(name):
            return self(name, memoryview(data))
        head = bytes(data[:12])
        if head.startswith(_IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
            return self("jpg" if head[:3] == b"\xff\xd8\xff" else "png", memoryview(data))
        return data

    def function(self, ext: str) -> DecodeFn:
        """The decoder of an extension, in webdataset's order.

        The table's own entry for the whole extension (a user's ``seg.png`` or ``txt.gz``) first; then a
        ``.gz`` (``.bz2``, ``.xz``, ``.zst``) member is decompressed and decoded by what it wraps; then the
        last part (``seg.png`` -> png); else bytes.
        """
        fn = self._resolved.get(ext)
        if fn is None:
            fn = self._resolved[ext] = self._resolve(ext)
        return fn

    def _resolve(self, ext: str) -> DecodeFn:
        split = split_suffix(ext)
        if ext not in self._table and self._table and split is not None:
            inner, suffix = split
            return Decompress(suffix, self.function(inner) if inner else decode_bytes, self.max_member_bytes)
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
            fn = self.function(ext)
            for package in (getattr(fn, "package", None), *getattr(fn, "packages", ())):
                if package and ext not in out:
                    try:
                        importlib.import_module(package)
                    except ImportError:
                        out[ext] = package
        return out
