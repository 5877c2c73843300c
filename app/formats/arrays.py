""".npy and .npz members: arrays, refused when their headers declare more than the bound.

An ``.npy`` member is read as a zero-copy view, so it never takes more than it holds; its header is
still checked, in Python integers, so no shape can overflow into a small size. An ``.npz`` is a zip:
its entries' declared sizes bound what ``zipfile`` unzips (a lie is a CRC error), and its arrays'
headers what ``np.load`` allocates, both before anything is read.
"""

from __future__ import annotations

import ast
import io
import math
import zipfile

import numpy as np

from .bounds import DEFAULT_MAX_MEMBER_BYTES, DecodeError, MemberTooLarge, about

_NPY_MAGIC = b"\x93NUMPY"
NPY_MAX_HEADER = 10_000  # numpy's own max_header_size: real headers are a few hundred bytes
_NPZ_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}  # what np.savez writes


def npy_header(data: memoryview | bytes) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """(dtype, shape, Fortran order, offset of the data) of an ``.npy`` buffer's header."""
    if bytes(data[:6]) != _NPY_MAGIC or len(data) < 10:
        raise DecodeError("not an .npy file (bad magic)")
    major = data[6]
    if major == 1:
        hlen, hstart = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3):
        hlen, hstart = int.from_bytes(data[8:12], "little"), 12
    else:
        raise DecodeError(f"unsupported .npy version {major}")
    if hlen > NPY_MAX_HEADER:  # parsed with literal_eval: a huge header is a huge parse, whatever it declares
        raise DecodeError(f"bad .npy header: {hlen} bytes, over numpy's limit of {NPY_MAX_HEADER}")
    try:
        header = ast.literal_eval(bytes(data[hstart : hstart + hlen]).decode("latin1"))
        dtype = np.dtype(np.lib.format.descr_to_dtype(header["descr"]))
        shape = tuple(int(d) for d in header["shape"])
        fortran = bool(header["fortran_order"])
    except Exception as exc:
        raise DecodeError(f"bad .npy header: {exc}") from None
    if any(d < 0 for d in shape):
        raise DecodeError(f"bad .npy header: negative dimension in {shape}")
    return dtype, shape, fortran, hstart + hlen


def declared_bytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """What an array of that shape takes, in Python integers: no overflow can make a huge shape look small."""
    return math.prod(shape) * dtype.itemsize


def decode_npy(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> np.ndarray:
    """A zero-copy view of an ``.npy`` member; object arrays are refused, and headers declaring past the bound."""
    dtype, shape, fortran, offset = npy_header(data)
    if dtype.hasobject:
        raise DecodeError(".npy holds Python objects; loading it would unpickle, refused")
    nbytes = declared_bytes(dtype, shape)
    if nbytes > bound:
        raise MemberTooLarge(f"declares a {shape} {dtype} array ({about(nbytes)}),", bound)
    if offset + nbytes > len(data):
        raise DecodeError(".npy is truncated")
    arr = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C")


def check_npz(z: zipfile.ZipFile, bound: int) -> None:
    """Refuse an ``.npz`` whose entries unzip, or whose arrays' headers declare, more than the bound in all.

    ``zipfile`` stops each entry at the size it declares (a lie is a CRC error), so the declared sizes bound
    what ``np.load`` unzips; the headers bound the arrays it allocates before reading them.
    """
    infos = z.infolist()
    for info in infos:  # zipfile inflates a bzip2 or lzma entry a whole chunk at a time, past its declared size
        if info.compress_type not in _NPZ_METHODS:
            raise DecodeError(f"bad .npz: entry {info.filename!r} is compressed with method {info.compress_type}; "
                              f"np.savez writes stored or deflated entries only")
    unzipped = sum(i.file_size for i in infos)
    if unzipped > bound:
        big = max(infos, key=lambda i: i.file_size)
        raise MemberTooLarge(f"unzips to {about(unzipped)} ({big.filename!r}: {about(big.file_size)}),", bound)
    arrays = 0
    for info in infos:
        with z.open(info) as f:
            head = f.read(12)
            if head[:6] != _NPY_MAGIC or len(head) < 12:
                continue
            v1 = head[6] == 1  # a 2-byte header length (10 bytes before the header), else 4 (12 bytes)
            hlen = int.from_bytes(head[8:10] if v1 else head[8:12], "little")
            if hlen > NPY_MAX_HEADER:
                raise DecodeError(f"bad .npz: {info.filename!r} has a {hlen}-byte .npy header, over numpy's limit")
            head += f.read(max(0, hlen - 2 if v1 else hlen))
        dtype, shape, _, _ = npy_header(head)
        arrays += declared_bytes(dtype, shape)
        if arrays > bound:
            raise MemberTooLarge(f"declares arrays of {about(arrays)} ({info.filename!r}: {shape} {dtype}),", bound)


def decode_npz(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` member; object arrays would unpickle and are refused."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            check_npz(z, bound)
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except DecodeError:
        raise
    except ValueError as exc:  # numpy's refusal of object arrays, or a bad archive
        raise DecodeError(f"bad .npz (object arrays are never unpickled): {exc}") from None
    except Exception as exc:  # zipfile errors and the like
        raise DecodeError(f"bad .npz: {exc}") from None
