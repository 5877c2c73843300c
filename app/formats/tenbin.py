"""webdataset's tenbin format (``.ten``, ``.tb``): a list of arrays, read as zero-copy views.

The format is a run of chunks, each ``~TenBin~`` (8 bytes), a native int64 length and
the data padded to 64 bytes. Arrays come in pairs of chunks: a header (int64s: the dtype's
short name as 8 ASCII bytes, an 8-byte info string, the rank, the dimensions) and the data.
This reader gives what ``webdataset.tenbin.decode_buffer`` gives — a list of arrays,
one per pair — and checks every length against the buffer, so a damaged member is an error,
never a read past its end. A header declaring more bytes than the member may take
(``max_member_bytes``) is ``MemberTooLarge``, however few bytes follow it.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from .bounds import MemberTooLarge, about

MAGIC = b"~TenBin~"
_DTYPES = {"f2": "float16", "f4": "float32", "f8": "float64", "i1": "int8", "i2": "int16", "i4": "int32",
           "i8": "int64", "u1": "uint8", "u2": "uint16", "u8": "uint64"}  # webdataset's table (no u4)


class TenbinError(ValueError):
    """Not a tenbin buffer, or a damaged one."""


def _chunks(buf: memoryview) -> list[memoryview]:
    out = []
    offset, total = 0, len(buf)
    while offset < total:
        if bytes(buf[offset : offset + 8]) != MAGIC:
            raise TenbinError(f"no tenbin magic at byte {offset}")
        if offset + 16 > total:
            raise TenbinError("truncated chunk length")
        (size,) = struct.unpack("@q", buf[offset + 8 : offset + 16])
        start = offset + 16
        if size < 0 or start + size > total:
            raise TenbinError(f"chunk at byte {offset} claims {size} bytes, past the end")
        out.append(buf[start : start + size])
        offset = start + (size + 63) // 64 * 64
    return out


def _ascii(word: int) -> str:
    try:
        return struct.pack("@q", word).decode("ascii").strip("\0")
    except UnicodeDecodeError:
        raise TenbinError("a header's dtype is not ASCII") from None


def decode(data: memoryview, bound: int | None = None) -> list[np.ndarray]:
    """The arrays of a tenbin buffer, in order (views into ``data``); none declaring more than ``bound``."""
    chunks = _chunks(memoryview(data).cast("B"))
    if len(chunks) % 2:
        raise TenbinError("an array header without its data")
    arrays = []
    for header, body in zip(chunks[::2], chunks[1::2]):
        if len(header) < 24 or len(header) % 8:
            raise TenbinError("array header too short")
        words = np.frombuffer(header, dtype="i8")
        name = _DTYPES.get(_ascii(int(words[0])))
        rank = int(words[2])
        if name is None:
            raise TenbinError(f"unsupported dtype {_ascii(int(words[0]))!r}")
        if not 0 <= rank < 10 or len(words) < 3 + rank:
            raise TenbinError(f"bad rank {rank}")
        shape = tuple(int(d) for d in words[3 : 3 + rank])
        if any(d < 0 for d in shape):
            raise TenbinError(f"negative dimension in {shape}")
        dtype = np.dtype(name)
        count = math.prod(shape)  # a Python integer: no shape overflows into a small size
        if bound is not None and count * dtype.itemsize > bound:
            raise MemberTooLarge(f"declares a {shape} {name} array ({about(count * dtype.itemsize)}),", bound)
        if count * dtype.itemsize > len(body):
            raise TenbinError(f"array {shape} {name} needs {count * dtype.itemsize} bytes, the chunk has {len(body)}")
        arrays.append(np.frombuffer(body, dtype=dtype, count=count).reshape(shape))
    return arrays
