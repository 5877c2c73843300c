"""The bound on one member (``max_member_bytes``): what a member may take as stored and once decoded.

A worker holds one sample's decoded members at a time, so bounding each member bounds the
worker: a 6 MB ``.txt.gz`` that expands to 6 GiB, a PNG header declaring 30000x30000 pixels or a
msgpack array of a million empty arrays is refused (``MemberTooLarge``) before the memory is
taken, never after. Decoders that cannot allocate more than they are given (``.npy``, ``.ten``,
``.bin``: views into the member) are bounded by the member's stored size.

Tree formats (JSON, msgpack, CBOR) are bounded by an estimate: every decoded value costs
``ITEM_BYTES`` (a small Python object and the reference to it) plus the member's own bytes.
A member too small to pass the bound even if every byte were a value is decoded without counting.

Text takes up to four times its UTF-8 bytes: a ``str`` stores every character in 1, 2 or 4 bytes,
by its widest one (PEP 393), so 250 MB of ASCII and one emoji is a 1 GB string. Text members and
JSON are measured before decoding (``check_text``); a string inside msgpack or CBOR may declare a
quarter of the bound at most (``STRING_WIDTH``).

CBOR can also refer back: a shared value (tags 28/29) or a string (stringref, tag 25) is decoded once and
referenced many times, so a few kilobytes can hold a list that references a big one twice, itself referenced
twice, forty levels deep: small in memory, exponential once copied (packed for the side channel, collated,
turned to JSON). Such a member is measured as it would be copied (``check_shared``): every reference counts
what it refers to, whole; a value that contains itself is refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

DEFAULT_MAX_MEMBER_BYTES = 256 << 20  # one member, as stored or decoded: beyond it the sample is skipped and counted
ITEM_BYTES = 64  # one decoded JSON/msgpack/CBOR value: a small object (an int 28, a list 56) and its 8-byte reference
IMAGE_BYTES_PER_PIXEL = 4  # what Pillow stores an RGB(A) pixel in
STRING_WIDTH = 4  # the most bytes a str takes a character (PEP 393): msgpack/CBOR strings may declare bound // 4
_WIDE4 = re.compile(rb"[\xf0-\xf4]")  # UTF-8 lead bytes of characters past U+FFFF: 4 bytes a character
_WIDE2 = re.compile(rb"[\xc4-\xef]")  # lead bytes of U+0100..U+FFFF: 2 bytes a character
_NON_ASCII = re.compile(rb"[\x80-\xff]")
_CONTINUATION = bytes(range(0x80, 0xC0))


class SampleRejected(Exception):
    """This sample cannot go into a batch; ``reason`` is its sample-error label (``feedline_sample_errors_total``)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class DecodeError(Exception):
    """A member that cannot be decoded: the sample is skipped and counted as corrupt."""


class MemberTooLarge(DecodeError):
    """A member that is, or would decode to, more than ``max_member_bytes``: skipped and counted as
    ``member_too_large`` instead of taking the worker's memory. ``member`` (the extension) is filled in by
    the ``Decoder`` that was asked for it."""

    def __init__(self, what: str, bound: int, member: str | None = None):
        super().__init__(what, bound, member)
        self.what, self.bound, self.member = what, bound, member

    def __str__(self) -> str:
        who = f"member {self.member!r} " if self.member else ""
        return f"{who}{self.what} past max_member_bytes={size_text(self.bound)}"


def size_text(n: int) -> str:
    """``268435456`` -> ``256 MiB``: exact, as a setting is written; odd sizes in bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def about(n: int) -> str:
    """``3.4 GiB``: a size for reading, not for a setting."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def check_stored(size: int, bound: int) -> None:
    """Refuse a member larger than the bound as it is, before any decoder sees it."""
    if size > bound:
        raise MemberTooLarge(f"is {size} bytes ({about(size)}) as stored,", bound)


def check_text(data: bytes | memoryview, bound: int) -> None:
    """Refuse UTF-8 text whose ``str`` would take more than the bound (before it is decoded).

    ASCII (checked in C) is one byte a character, bounded by the stored size; other text is measured:
    its characters (bytes less continuation bytes) times the width of its widest one.
    """
    n = len(data)
    if n * STRING_WIDTH <= bound or not _NON_ASCII.search(data):
        return
    raw = data if isinstance(data, bytes) else bytes(data)  # copies of at most the member, freed before decoding
    width = 4 if _WIDE4.search(raw) else 2 if _WIDE2.search(raw) else 1
    chars = len(raw.translate(None, _CONTINUATION))
    if chars * width > bound:
        raise MemberTooLarge(f"decodes to a string of {chars} characters at {width} bytes each ({about(chars * width)}),",
                             bound)


def fits_uncounted(data_len: int, bound: int) -> bool:
    """True where even one value per byte stays within the bound: no need to count."""
    return data_len * (ITEM_BYTES + 1) <= bound


def _over(items: int, data_len: int, bound: int) -> bool:
    return items * ITEM_BYTES + data_len > bound


def _too_many(items: int, bound: int) -> MemberTooLarge:
    return MemberTooLarge(f"decodes to more than {items} values (about {ITEM_BYTES} bytes each),", bound)


def check_json(raw: bytes, bound: int) -> None:
    """Refuse JSON whose values would take more than the bound (before ``json.loads`` builds them).

    Every value but a container's first follows a ``,`` or a ``:``, and every first one a ``[`` or ``{``:
    their count (one pass each, in C) is at least the number of values.
    """
    if fits_uncounted(len(raw), bound):
        return
    items = 1 + sum(raw.count(c) for c in (b",", b":", b"[", b"{"))
    if _over(items, len(raw), bound):
        raise _too_many(items, bound)


class MsgpackTally:
    """msgpack's ``list_hook``/``object_hook``: counts the values of each container as it is built, and stops
    the unpacking (``MemberTooLarge``) once they pass the bound."""

    def __init__(self, data_len: int, bound: int):
        self.data_len, self.bound, self.items = data_len, bound, 0

    def _count(self, n: int) -> None:
        self.items += n + 1
        if _over(self.items, self.data_len, self.bound):
            raise _too_many(self.items, self.bound)

    def list_hook(self, value: list[Any]) -> list[Any]:
        self._count(len(value))
        return value

    def object_hook(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self._count(2 * len(value))
        return value


def msgpack_limits(bound: int) -> dict[str, int]:
    """``msgpack.unpackb``'s declared-length limits: no string, array or map past the bound (values counted at
    ``ITEM_BYTES``), so no list is allocated for more values than the bound holds."""
    return {"max_str_len": max(1, bound // STRING_WIDTH), "max_bin_len": bound, "max_ext_len": bound,
            "max_array_len": max(1, bound // ITEM_BYTES), "max_map_len": max(1, bound // (2 * ITEM_BYTES))}


# msgpack heads: bytes that follow a fixed-size one; (width of the length, what it sizes) for strings,
# byte strings and extensions (which also carry a type byte); (width of the count, values per count) for containers
_MP_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2,
             0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_MP_SIZED = {0xC4: (1, "a byte string"), 0xC5: (2, "a byte string"), 0xC6: (4, "a byte string"),
             0xC7: (1, "an extension"), 0xC8: (2, "an extension"), 0xC9: (4, "an extension"),
             0xD9: (1, "a string"), 0xDA: (2, "a string"), 0xDB: (4, "a string")}
_MP_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def check_msgpack(data: memoryview, bound: int) -> None:
    """Refuse msgpack that declares a string, array or map past the bound, or more values than it holds.

    Walks the heads only (asked once ``msgpack`` failed on a member: a declared length past the bound,
    which is also past the member's end, is why); what is malformed is left to ``msgpack`` to report.
    """
    pos, n, items = 0, len(data), 0
    while pos < n:
        head = data[pos]
        pos += 1
        if 0xA0 <= head <= 0xBF:  # fixstr
            pos += head & 0x1F
        elif head in _MP_SIZED:
            width, kind = _MP_SIZED[head]
            value = int.from_bytes(data[pos : pos + width], "big")
            if value > (bound // STRING_WIDTH if kind == "a string" else bound):
                raise MemberTooLarge(f"declares {kind} of {value} bytes,", bound)
            pos += width + value + (kind == "an extension")
        elif head in _MP_COUNTED:
            width, per = _MP_COUNTED[head]
            value = int.from_bytes(data[pos : pos + width], "big")
            if _over(value * per, 0, bound):
                raise MemberTooLarge(f"declares {'an array' if per == 1 else 'a map'} of {value} items,", bound)
            pos += width
        else:  # fixint, fixmap, fixarray, nil, booleans, numbers, fixext (0xC1 is never used: malformed)
            pos += _MP_FIXED.get(head, 0)
        items += 1
        if _over(items, n, bound):
            raise _too_many(items, bound)


def check_cbor(data: memoryview, bound: int, small_too: bool = False) -> None:
    """Refuse CBOR that declares, or holds, more than the bound (before ``cbor2`` builds anything).

    Walks the item heads only, skipping the strings' bytes: a string past the bound, an array or map
    declaring more values than the bound holds, or more values in all than it holds, is refused. What
    is malformed is left to ``cbor2`` to report. A member too small to pass the bound is walked only with
    ``small_too`` (once ``cbor2`` failed on it: a declared length past the bound is why).
    """
    n = len(data)
    if fits_uncounted(n, bound) and not small_too:
        return
    raw = bytes(data)  # indexing bytes is quicker than a memoryview
    budget = (bound - n) // ITEM_BYTES  # values the bound holds besides the member's own bytes
    pos = items = 0
    while pos < n:
        head = raw[pos]
        pos += 1
        info = head & 0x1F
        if info < 24:
            value = info
        elif info < 28:
            width = 1 << (info - 24)
            value = int.from_bytes(raw[pos : pos + width], "big")
            pos += width
        elif info == 31:  # the start of an indefinite-length item, or a break (which is no value)
            items += head != 0xFF
            continue
        else:
            return  # reserved: malformed, cbor2 says so
        major = head >> 5
        if major == 2 or major == 3:  # a byte or text string: its bytes are skipped
            if value > (bound if major == 2 else bound // STRING_WIDTH):
                raise MemberTooLarge(f"declares a {'byte' if major == 2 else 'text'} string of {value} bytes,", bound)
            pos += value
        elif (major == 4 or major == 5) and value * (major - 3) > budget:
            raise MemberTooLarge(f"declares {'an array' if major == 4 else 'a map'} of {value} items,", bound)
        items += 1
        if items > budget:
            raise _too_many(items, bound)


# CBOR's tags that refer back (25: stringref, 28: shareable, 29: sharedref), their heads in every width cbor2 accepts
_CBOR_SHARING = re.compile(rb"(?:\xd8|\xd9\x00|\xda\x00{3}|\xdb\x00{7})[\x19\x1c\x1d]")


def may_share(data: bytes | memoryview) -> bool:
    """Whether CBOR bytes may refer back to a value (a tag 25, 28 or 29 head; or those bytes inside a string):
    only then can the decoded value hold one object in several places (``check_shared``)."""
    return _CBOR_SHARING.search(data) is not None


def _children(value: Any) -> Iterator[Any] | None:
    """The values a container holds (a map's keys and values); None for a leaf."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return iter(value)
    if isinstance(value, Mapping):  # dict, and cbor2's frozendict (a map that is a key)
        return (v for item in value.items() for v in item)
    if isinstance(getattr(value, "tag", None), int) and hasattr(value, "value"):  # cbor2's CBORTag: a tag it keeps
        return iter((value.value,))
    return None


def _leaf_bytes(value: Any) -> int:
    if isinstance(value, str):
        return ITEM_BYTES + len(value) * (1 if value.isascii() else STRING_WIDTH)
    if isinstance(value, (bytes, bytearray)):
        return ITEM_BYTES + len(value)
    if isinstance(value, int):
        return ITEM_BYTES + value.bit_length() // 8
    return ITEM_BYTES


def _flat_bytes(value: Any) -> int | None:
    """The cost of a list or tuple of numbers or of strings, counted in C (an array of a million floats walks
    in milliseconds); None for any other container."""
    if not isinstance(value, (list, tuple)):
        return None
    kinds = set(map(type, value))
    if kinds <= {float, type(None)}:
        return ITEM_BYTES * (1 + len(value))
    if kinds <= {int, bool}:
        return ITEM_BYTES * (1 + len(value)) + sum(map(int.bit_length, value)) // 8
    if kinds == {str}:
        return ITEM_BYTES * (1 + len(value)) + sum(map(len, value)) * (1 if all(map(str.isascii, value)) else
                                                                       STRING_WIDTH)
    return None


def check_shared(value: Any, bound: int) -> None:
    """Refuse a decoded tree that would take more than the bound once every reference in it is copied.

    Each container is walked once (its cost kept by identity) and every reference to it counts that cost
    again, so the walk takes the time of the tree as it is in memory, not as it would be copied. A value
    that contains itself can never be copied: a ``DecodeError``.
    """
    known: dict[int, int] = {}  # a walked container's id: its cost as copied
    walking: set[int] = set()  # the containers being walked: one met again inside itself contains itself
    stack: list[list[Any]] = []  # [container, its values not yet met, its cost so far]

    def cost_of(v: Any) -> int | None:
        """What ``v`` costs, where that is known now (a leaf, a container walked before); else it is walked."""
        values = _children(v)
        if values is None:
            return _leaf_bytes(v)
        if id(v) in known:
            return known[id(v)]
        flat = _flat_bytes(v)
        if flat is not None:
            known[id(v)] = flat
            return flat
        if id(v) in walking:
            raise DecodeError("a value that contains itself (a CBOR shared reference to an enclosing value)")
        walking.add(id(v))
        stack.append([v, values, ITEM_BYTES])
        return None

    total = cost_of(value)
    while stack:
        frame = stack[-1]
        v = next(frame[1], _END)
        if v is _END:  # the container is walked: its cost is known, and counts in its parent's
            stack.pop()
            walking.discard(id(frame[0]))
            cost = known[id(frame[0])] = frame[2]
            if not stack:
                total = cost
                break
            frame = stack[-1]
        else:
            cost = cost_of(v)
            if cost is None:
                continue
        frame[2] += cost
        if frame[2] > bound:  # a part past the bound: the whole is too
            raise MemberTooLarge(f"holds shared values that copied would take more than {about(frame[2])},", bound)
    if total is not None and total > bound:
        raise MemberTooLarge(f"holds shared values that copied would take {about(total)},", bound)


_END = object()
