"""A Parquet file's page headers, read from its bytes without pyarrow: what a page says it takes, before a page is
read.

A column chunk is a run of pages, each a Thrift ``PageHeader`` (compact protocol) then its compressed bytes; the
header says the page's size uncompressed, which a reader allocates before it decompresses. A footer's sizes are
checked (``parquet_sizes.group_bytes``), but a page may declare more than its chunk's footer entry: the pages of the
columns a worker reads are walked, and a chunk whose pages declare more than the footer says, or that run past
it, is refused before pyarrow reads it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

DICTIONARY_PAGE = 2  # parquet.thrift's PageType

# Thrift compact protocol's field types
_BOOL_TRUE, _BOOL_FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)


class PageError(Exception):
    """A page header that cannot be read, or pages that do not fit the footer's account of their chunk."""


class _Reader:
    """Thrift's compact protocol over a buffer: what a page header needs, and skipping the rest."""

    def __init__(self, view: memoryview, pos: int):
        self.view, self.pos = view, pos

    def byte(self) -> int:
        if self.pos >= len(self.view):
            raise PageError("a page header runs past the file's end")
        b = self.view[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise PageError("a varint longer than 64 bits")

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def skip(self, kind: int, depth: int = 0) -> None:
        if depth > 16:
            raise PageError("a page header nested too deep")
        if kind in (_BOOL_TRUE, _BOOL_FALSE):
            return
        if kind == _BYTE:
            self.byte()
        elif kind in (_I16, _I32, _I64):
            self.varint()
        elif kind == _DOUBLE:
            self.pos += 8
        elif kind == _BINARY:
            n = self.varint()  # (read first: it moves pos)
            self.pos += n
        elif kind in (_LIST, _SET):
            head = self.byte()
            n = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(n):
                if head & 0x0F in (_BOOL_TRUE, _BOOL_FALSE):  # a list's booleans take a byte each
                    self.byte()
                else:
                    self.skip(head & 0x0F, depth + 1)
        elif kind == _MAP:
            n = self.varint()
            if n:
                types = self.byte()
                for _ in range(n):
                    self.skip(types >> 4, depth + 1)
                    self.skip(types & 0x0F, depth + 1)
        elif kind == _STRUCT:
            self.struct(depth + 1)
        else:
            raise PageError(f"a page header holds an unknown Thrift type {kind}")

    def struct(self, depth: int = 0, want: Collection[int] = ()) -> dict[int, int]:
        """Skip a struct to its end; the i32 fields in ``want``, by field id."""
        field, out = 0, {}
        while True:
            head = self.byte()
            if head == 0:
                return out
            kind, delta = head & 0x0F, head >> 4
            field = field + delta if delta else self.zigzag()
            if field in want and kind == _I32:
                out[field] = self.zigzag()
            else:
                self.skip(kind, depth)


def page_header(data: Any, offset: int) -> tuple[int, int, int, int]:
    """(page type, uncompressed size, compressed size, the header's length) of the page at ``offset``."""
    reader = _Reader(memoryview(data), offset)
    fields = reader.struct(want=(1, 2, 3))
    if not {1, 2, 3} <= set(fields) or fields[2] < 0 or fields[3] < 0:
        raise PageError(f"the page header at byte {offset} lacks its type or sizes")
    return fields[1], fields[2], fields[3], reader.pos - offset


def dictionary_page_bytes(data: Any, offset: int | None) -> int | None:
    """The uncompressed size of the dictionary page at ``offset`` of the file ``data``; None where there is none or it
    cannot be read."""
    if not offset or offset < 0 or data is None:
        return None
    try:
        kind, size, _, _ = page_header(data, offset)
    except PageError:
        return None
    return size if kind == DICTIONARY_PAGE else None


def check_pages(data: Any, meta: Any, group: int, names: Collection[str] | None) -> None:
    """Walk the pages of a row group's columns ``names`` (None: all): a ``PageError`` where they declare more
    uncompressed bytes than the footer's entry for their chunk, or run past the bytes it gives them."""
    rg = meta.row_group(group)
    size = len(memoryview(data))
    for i in range(rg.num_columns):
        path = meta.schema.column(i).path
        if names is not None and not any(path == n or path.startswith(n + ".") for n in names):
            continue
        chunk = rg.column(i)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page and chunk.dictionary_page_offset else \
            chunk.data_page_offset
        end = start + chunk.total_compressed_size
        if start < 0 or end > size:
            raise PageError(f"column {path!r} of row group {group}: its pages at bytes {start}-{end} lie outside the "
                            f"file's {size}")
        pos, declared = start, 0
        while pos < end:
            _, uncompressed, compressed, head = page_header(data, pos)
            declared += uncompressed + head
            pos += head + compressed
            if pos > end:
                raise PageError(f"column {path!r} of row group {group}: a page runs past its chunk (byte {pos} of "
                                f"{end})")
            if declared > chunk.total_uncompressed_size:
                raise PageError(f"column {path!r} of row group {group}: its pages declare {declared} bytes "
                                f"uncompressed, more than the {chunk.total_uncompressed_size} its footer says")
