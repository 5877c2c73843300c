"""Nested values beside the slot: dicts, lists, tuples, sets, strings, bytes, numbers, arrays and tensors.

A msgpack member, a CBOR one, a ``.pth`` state dict, a tenbin list of arrays or an ``.npz``
decodes to a tree that JSON cannot carry (bytes, arrays, tuples, int keys). It travels as
msgpack with a few extension types of feedline's own, so the loop gets back what the
worker decoded — the same types, equal values — and nothing is ever pickled: a tree can
only ever hold the plain types listed here.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import Any

import msgpack
import numpy as np

_MAGIC = b"FLt1"  # our extension payloads start with it; a user's own msgpack ExtType passes through as is
_ARRAY, _SCALAR, _TUPLE, _TENSOR, _SET, _FROZENSET, _MEMBER = range(96, 103)


class TreeError(TypeError):
    """A value that cannot travel as a tree (a class of its own, an object array, ...)."""


def _header(meta: list[Any]) -> bytes:
    head = msgpack.packb(meta)
    return _MAGIC + struct.pack("<I", len(head)) + head


def _array_payload(a: np.ndarray) -> bytes:
    if a.dtype.hasobject or a.dtype.fields is not None:
        raise TreeError(f"a {a.dtype} array (objects or records) cannot travel beside the slot")
    return _header([a.dtype.str, list(a.shape)]) + np.ascontiguousarray(a).tobytes()


def _default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return msgpack.ExtType(_ARRAY, _array_payload(value))
    if isinstance(value, np.generic):
        return msgpack.ExtType(_SCALAR, _array_payload(np.asarray(value)))
    if isinstance(value, msgpack.ExtType):  # before tuple (it is one): a member's own extension, wrapped
        return msgpack.ExtType(_MEMBER, _MAGIC + pack([value.code, value.data]))  # whole, never read as ours
    if isinstance(value, tuple):  # torch.Size and named tuples arrive as plain tuples
        return msgpack.ExtType(_TUPLE, _MAGIC + pack(list(value)))
    if isinstance(value, (set, frozenset)):
        return msgpack.ExtType(_FROZENSET if isinstance(value, frozenset) else _SET, _MAGIC + pack(list(value)))
    if isinstance(value, dict):  # OrderedDict (state dicts), Counter ...: a plain dict of the same items
        return dict(value)
    if isinstance(value, list):
        return list(value)
    for base in (bool, int, float, str, bytes):
        if isinstance(value, base):
            return base(value)
    torch = sys.modules.get("torch")  # a tensor means torch is imported
    if torch is not None and isinstance(value, torch.Tensor):
        return msgpack.ExtType(_TENSOR, _tensor_payload(value))
    raise TreeError(f"a {type(value).__module__}.{type(value).__qualname__} cannot travel beside the slot "
                    f"(dicts, lists, tuples, sets, str, bytes, numbers, numpy arrays and torch tensors can)")


def _tensor_payload(t: Any) -> bytes:
    import torch

    if t.layout != torch.strided or t.is_quantized:
        raise TreeError(f"a {t.layout} tensor cannot travel beside the slot; make it dense in your transform")
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return _header([str(t.dtype).removeprefix("torch."), list(t.shape)]) + raw


def pack(value: Any) -> bytes:
    """The wire form of a tree; raises ``TreeError`` naming what cannot travel."""
    try:
        return msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True, datetime=False)
    except (OverflowError, ValueError) as exc:  # ints past 64 bits, nesting too deep
        raise TreeError(f"cannot travel beside the slot: {exc}") from None


def _split(data: bytes) -> tuple[list[Any], memoryview]:
    (n,) = struct.unpack_from("<I", data, len(_MAGIC))
    start = len(_MAGIC) + 4
    return msgpack.unpackb(data[start : start + n]), memoryview(data)[start + n :]


def _checked(shape: Any, itemsize: int, raw: memoryview) -> list[int]:
    """The shape, once it is a list of counts whose bytes are exactly the payload's: nothing is allocated for
    more than the wire carries."""
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        raise ValueError(f"not a shape: {shape!r}")
    if math.prod(shape) * itemsize != len(raw):
        raise ValueError(f"an array of shape {shape} and {itemsize}-byte items, but {len(raw)} bytes")
    return shape


def _array(data: bytes) -> np.ndarray:
    (name, shape), raw = _split(data)
    dtype = np.dtype(name)
    if dtype.hasobject:
        raise ValueError(f"not a plain dtype: {name!r}")
    out = np.empty(_checked(shape, dtype.itemsize, raw), dtype)
    out.reshape(-1).view(np.uint8)[:] = np.frombuffer(raw, np.uint8)
    return out


def _tensor(data: bytes) -> Any:
    import torch

    (name, shape), raw = _split(data)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    out = torch.empty(_checked(shape, dtype.itemsize, raw), dtype=dtype)
    if out.numel():
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(raw, np.uint8)
    return out


def _ext_hook(code: int, data: bytes) -> Any:
    if not data.startswith(_MAGIC):
        return msgpack.ExtType(code, data)
    if code == _ARRAY:
        return _array(data)
    if code == _SCALAR:
        return _array(data)[()]
    if code == _TENSOR:
        return _tensor(data)
    if code == _MEMBER:
        member_code, member_data = unpack(data[len(_MAGIC):])
        return msgpack.ExtType(member_code, member_data)
    if code in (_TUPLE, _SET, _FROZENSET):
        items = unpack(data[len(_MAGIC):])
        return tuple(items) if code == _TUPLE else set(items) if code == _SET else frozenset(items)
    return msgpack.ExtType(code, data)


def unpack(data: bytes) -> Any:
    """The tree packed by ``pack``."""
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True,
                           timestamp=0)
