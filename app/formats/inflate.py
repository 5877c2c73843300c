"""Compressed members (``<ext>.gz``, ``.bz2``, ``.xz``, ``.zst``) decompressed within a bound.

``gzip.decompress`` and its kin give back everything a member expands to: 6 MB of gzip can ask
for 6 GiB. Here the input is fed a slice at a time and each call may return at most a step of
output, so decompression stops at ``bound + 1`` bytes (``MemberTooLarge``) having held little
more than the bound. Several streams in one member (``cat a.gz b.gz``) decompress as the
standard modules do: gzip allows zero padding after a member and nothing else; bz2 and xz ignore
what follows a complete stream if it is not another; zstd reads every frame and refuses garbage.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from collections.abc import Callable
from typing import Any

from .bounds import DecodeError, MemberTooLarge

STEP = 1 << 20  # the most output one call may return: the result grows by steps, never past bound + STEP
FEED = 1 << 16  # the most input handed over per call: what a finished stream leaves over is copied
FIRST_FEED = 512  # a stream's first slice, doubled up to FEED: a member of many tiny streams copies little
ZSTD_BLOCK = 128 << 10  # a zstd block expands to at most this, from at least 4 bytes of input
XZ_MEMORY = 72 << 20  # xz's decoder memory (its dictionary) allowed under a smaller bound: every preset fits (-9: 65 MiB)
ZSTD_WINDOW = 8 << 20  # likewise zstd's window: every level up to 19 fits

SUFFIXES = ("gz", "bz2", "xz", "zst")  # compressed member suffixes, as in ``txt.gz``, ``json.bz2``, ``npy.zst``
NAMES = {"gz": "gzip", "bz2": "bzip2", "xz": "xz", "zst": "zstd"}
PACKAGES = {"zst": "zstandard"}  # what a suffix needs installed


def _grown(out: bytearray, piece: bytes, bound: int) -> None:
    out += piece
    if len(out) > bound:
        raise MemberTooLarge("expands", bound)


def _room(out: bytearray, bound: int) -> int:
    return min(STEP, bound + 1 - len(out))


def _skip_zeros(data: memoryview, pos: int) -> int:
    """The first non-zero byte at or after ``pos`` (gzip's padding between members), a slice at a time."""
    while pos < len(data):
        if data[pos]:
            return pos
        chunk = bytes(data[pos : pos + FEED])
        rest = chunk.lstrip(b"\0")
        if rest:
            return pos + len(chunk) - len(rest)
        pos += len(chunk)
    return pos


def gunzip(data: memoryview, bound: int) -> bytearray:
    """What ``gzip.decompress`` gives, at most ``bound`` bytes of it."""
    out, pos, n = bytearray(), 0, len(data)
    while True:
        if out or pos:
            pos = _skip_zeros(data, pos)
        if pos >= n:
            return out
        d, tail = zlib.decompressobj(wbits=31), b""  # 31: a gzip header and trailer, CRC and length checked
        feed = FIRST_FEED
        while not d.eof:
            if not tail and pos < n:
                tail = data[pos : pos + feed]
                pos += len(tail)
                feed = min(FEED, 2 * feed)
            try:
                piece = d.decompress(tail, _room(out, bound))
            except zlib.error as exc:
                raise DecodeError(f"bad gzip member: {exc}") from None
            tail = d.unconsumed_tail
            if not piece and not tail and pos >= n and not d.eof:
                raise DecodeError("bad gzip member: it ends before its end-of-stream marker")
            _grown(out, piece, bound)
        pos -= len(d.unused_data)


def _streams(data: memoryview, bound: int, new: Callable[[], Any], errors: tuple[type[Exception], ...],
             name: str, first_required: bool) -> bytearray:
    """bz2's and lzma's decompressors, stream after stream, as ``bz2.decompress`` and ``lzma.decompress`` do."""
    out, pos, n, streams = bytearray(), 0, len(data), 0
    while pos < n or (first_required and not streams):
        d, start, feed = new(), len(out), FIRST_FEED
        try:
            while not d.eof:
                if d.needs_input:
                    if pos >= n:
                        raise DecodeError(f"bad {name} member: it ends before its end-of-stream marker")
                    chunk = data[pos : pos + feed]
                    pos += len(chunk)
                    feed = min(FEED, 2 * feed)
                else:
                    chunk = b""
                _grown(out, d.decompress(chunk, _room(out, bound)), bound)
        except errors as exc:
            if "memory" in str(exc).lower():
                raise MemberTooLarge(f"needs more decoder memory than allowed ({exc}),", bound) from None
            if streams:  # what follows a complete stream is not another: ignored, as the standard modules do
                del out[start:]
                return out
            raise DecodeError(f"bad {name} member: {exc}") from None
        pos -= len(d.unused_data)
        streams += 1
    return out


def bunzip2(data: memoryview, bound: int) -> bytearray:
    """What ``bz2.decompress`` gives, at most ``bound`` bytes of it."""
    return _streams(data, bound, bz2.BZ2Decompressor, (OSError, EOFError, ValueError), "bzip2", False)


def unxz(data: memoryview, bound: int) -> bytearray:
    """xz (or legacy .lzma); the decoder's memory is limited too: a stream may declare a 1.5 GiB dictionary."""
    memlimit = max(bound, XZ_MEMORY)
    return _streams(data, bound, lambda: lzma.LZMADecompressor(memlimit=memlimit), (lzma.LZMAError, EOFError),
                    "xz", True)


def unzstd(data: memoryview, bound: int) -> bytearray:
    """Every zstd frame; its window is limited, and input is fed a few bytes per possible block of output."""
    try:
        import zstandard
    except ImportError:
        raise DecodeError("a .zst member needs the zstandard package: pip install zstandard") from None
    dctx = zstandard.ZstdDecompressor(max_window_size=1 << (max(ZSTD_WINDOW, bound) - 1).bit_length())
    out, pos, n = bytearray(), 0, len(data)
    while pos < n:
        d, grown = dctx.decompressobj(), FIRST_FEED
        while not d.eof:
            if pos >= n:
                raise DecodeError("bad zstd member: it ends before its last frame does")
            room = bound + 1 - len(out)  # a call returns at most 128 KiB per 4 bytes fed: an eighth of the room
            feed = max(16, min(grown, 4 * max(STEP, room // 8) // ZSTD_BLOCK))
            grown = min(FEED, 2 * grown)
            chunk = data[pos : pos + feed]
            pos += len(chunk)
            try:
                piece = d.decompress(chunk)
            except zstandard.ZstdError as exc:
                if "memory" in str(exc).lower():
                    raise MemberTooLarge(f"needs a larger zstd window than allowed ({exc}),", bound) from None
                raise DecodeError(f"bad zstd member: {exc}") from None
            _grown(out, piece, bound)
        pos -= len(d.unused_data)
    return out


INFLATE: dict[str, Callable[[memoryview, int], bytearray]] = {"gz": gunzip, "bz2": bunzip2, "xz": unxz,
                                                               "zst": unzstd}


def split_suffix(ext: str) -> tuple[str, str] | None:
    """``txt.gz`` -> (``txt``, ``gz``); ``gz`` -> (``""``, ``gz``); None when not compressed."""
    inner, _, last = ext.rpartition(".")
    return (inner, last) if last in INFLATE else None
