"""Parquet files: each row a sample, read a row group at a time with pyarrow (no pandas).

A Parquet file stores its rows in row groups, compressed column by column: no byte range holds one
row, so the index (built from the file's footer, stored beside it like a tar's) lists each row as
``(row group, row in it)``. A worker reads the row group a sample is in once, only the columns it
needs, and keeps the groups it read last, within a bound in bytes (``RowGroups``): the shuffle
buffer hands out samples of nearby rows, so each group is read about once an epoch.

Columns are fields, named as they are, lowercased: binary values that are images (told by their
first bytes) decode as image members do, other bytes stay ``bytes``; a Hugging Face ``Image``
column (a struct of ``bytes`` and ``path``) is its image; integers and floats are numpy scalars of
the column's type; strings ``str``; lists of numbers 1-D arrays; other values (lists, structs)
as Python values. A ``decode={"column": fn}`` decoder of the user's is given a binary value's bytes.

A file's footer is not trusted: it may declare rows and values its bytes cannot hold (nulls, a constant, a
dictionary value repeated: a few kilobytes that decode to gigabytes). So the rows it declares are checked
against its size before it is indexed (``MAX_ROWS_PER_BYTE``), and what a row group's columns take once
read against ``max_member_bytes`` before it is read (``group_bytes``); byte-array columns written with a
dictionary are read as dictionaries (each value once), and what they expand to is measured before any
row is taken from them (``dense_bytes``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Collection, Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from .bounds import DEFAULT_MAX_MEMBER_BYTES, DecodeError, MemberTooLarge, about
from .decoders import Decoder
from .parquet_pages import PageError, check_pages
from .parquet_sizes import dense_bytes, group_bytes, is_bytes, stored_bytes
from .sample_index import MAX_SAMPLES, LazySamples, Sample, ShardError, ShardIndex, open_shard
from .urls import is_parquet, shard_stem

__all__ = ["PACKAGES", "RECORD", "RowGroups", "build_index", "column_value", "is_parquet", "read_row",
           "row_group_bytes"]

RECORD = "parquet"  # the one field of a row's entry in the index: (row group, row in it), not a byte span
PACKAGES = {"pyarrow": "pyarrow"}  # module: the package that has it
GROUP_CACHE_BYTES = 128 << 20  # a worker's bound on the row groups it keeps decoded (at least the one in use)
# A row group past that bound (and max_member_bytes) is refused only when it would take INFLATION times what it
# stores: real data decompresses some 2-20 times (text, JSON under zstd); a footer's nulls or a repeated value
# inflate thousands of times. pyarrow's default row group of a million rows of text stays readable.
INFLATION = 64
# The most rows a file may declare per byte of it. A row is a sample, and every sample takes an entry in the
# index (about 450 bytes in memory), so a footer declaring 300 M rows in a 500 KB file (what pyarrow writes for
# a column of nulls: 540 rows a byte) would take 130 GB before a row is read. Measured with pyarrow (snappy,
# zstd; 2 M rows): a column whose every row carries a bit of its own packs at most 8 rows a byte (random
# booleans 7.8, a 2-class label 7.5, a 10-class one 2.3; ids 0.8); only runs of one value go past it
# (a 99 %-zero label 36, sorted labels 140, a constant 230, nulls 410-540), which no dataset's samples are.
MAX_ROWS_PER_BYTE = 8
# Past a shard index's MAX_SAMPLES (a tar's), a file's rows must average MIN_ROW_BYTES: so what a hostile footer can
# make an epoch's plan order is a million rows plus one row per 4 bytes the file really has (the index itself holds a
# number a row group: RowSamples). A ratings table of 5-byte rows, or a 500 MB file of 100-byte text rows, reads as
# it did; a 1 MB file declaring 8 M rows does not.
MIN_ROW_BYTES = 4
REFUSED_KEPT = 64  # row groups a worker remembers it refused (their other rows are refused without a read)
# A row group is read in batches of about this many bytes: read whole, pyarrow grows one buffer a column to the group's
# size, each doubling a copy of what it holds (a third of the time a 1 MiB row takes to read; a batch a row: half).
READ_BATCH_BYTES = 1 << 20


def build_index(path: str, fd: int | None = None, name: str | None = None) -> ShardIndex:
    """Every row as (row group, row), from the footer; a file pyarrow cannot read is a ``ShardError``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    f, size = open_shard(path, fd)
    with f:
        try:
            meta = pq.ParquetFile(f).metadata
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ShardError(path, f"not a readable Parquet file ({exc})") from None
    check_rows(path, meta, size)
    rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    return ShardIndex(path, size, RowSamples(shard_stem(name or path), rows))  # type: ignore[arg-type]


class RowSamples(LazySamples):
    """A Parquet file's rows as an index's samples, made when asked for from the row groups' sizes: the index holds
    a number a row group, not ~450 bytes a row, so what a footer can make it hold is bounded by the file's bytes
    (a row group's entry in the footer takes some)."""

    def __init__(self, stem: str, rows: list[int]):
        self._stem = stem
        self.starts = list(accumulate(rows, initial=0))  # the first row of each group, and the total last

    def __len__(self) -> int:
        return self.starts[-1]

    def _sample(self, i: int) -> Sample:
        group = bisect_right(self.starts, i) - 1
        return Sample(f"{self._stem}/{i:08d}", {RECORD: (group, i - self.starts[group])})

    def groups(self) -> list[int]:
        """Each row's row group (what splitting a file between workers by whole groups reads)."""
        return [g for g, (a, b) in enumerate(zip(self.starts, self.starts[1:])) for _ in range(b - a)]


def groups_of(samples: Sequence[Sample]) -> list[int]:
    """Each row's row group, from a Parquet index's samples (made without a ``Sample`` a row where it can)."""
    if isinstance(samples, RowSamples):
        return samples.groups()
    return [s.fields[RECORD][0] for s in samples]


def row_group_bytes(data: Any) -> list[int]:
    """Each row group's size once read, from the footer (``total_byte_size``), of a mapping or a path: what the
    epoch shuffle's windows of row groups hold (``loader.plan.stream``); [] for a file pyarrow cannot read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(data) if isinstance(data, str) else pq.ParquetFile(
            pa.BufferReader(pa.py_buffer(data))).metadata
        return [max(0, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
    except (pa.ArrowException, OSError, ValueError):
        return []


def check_rows(path: str, meta: Any, size: int) -> None:
    """Refuse (``ShardError``) a footer declaring more rows than the file's bytes can hold, before they are indexed."""
    rows = 0
    for group in range(meta.num_row_groups):
        n = meta.row_group(group).num_rows
        if n < 0:
            raise ShardError(path, f"row group {group} declares {n} rows (not a readable Parquet file)")
        rows += n
    if rows > size * MAX_ROWS_PER_BYTE:
        raise ShardError(path, f"declares {rows} rows in {size} bytes, more than {MAX_ROWS_PER_BYTE} rows a byte: "
                               f"only runs of one value (nulls, a constant) pack so tight, never a dataset's samples; "
                               f"refused before indexing (each row is a sample the index holds)")
    if rows > max(MAX_SAMPLES, size // MIN_ROW_BYTES):  # the index's memory: a million rows, more in a file of more
        raise ShardError(path, f"declares {rows} rows in {size} bytes: past {MAX_SAMPLES:,} rows a file holds "
                               f"{MIN_ROW_BYTES} bytes a row at least (each row is a sample every epoch's plan "
                               f"orders); write the rows into smaller or more files")


class RowGroups:
    """The row groups a worker read last, newest kept, within ``max_bytes`` (the group in use always).

    A group is read from the worker's mapping of the file, not by its path: a cached file evicted (unlinked)
    while an epoch reads it still reads whole, as tar and TFRecord shards do, and nothing is opened per row. A
    group read from one mapping is reused only for that mapping (a file replaced under its name is mapped
    anew); the cache holds the mappings of the groups it keeps."""

    def __init__(self, max_bytes: int = GROUP_CACHE_BYTES):
        self.max_bytes = max_bytes
        self._groups: OrderedDict[tuple[Any, ...], tuple[Any, Any]] = OrderedDict()
        self._bytes = 0
        self._refused: OrderedDict[tuple[Any, ...], tuple[Any, int, str]] = OrderedDict()  # the groups refused

    def _refuse(self, key: tuple[Any, ...], base: Any, bound: int, what: str) -> None:
        """Refuse a row group past the bound, and remember it: its other rows are refused without a read."""
        self._refused[key] = (base, bound, what)
        while len(self._refused) > REFUSED_KEPT:
            self._refused.popitem(last=False)
        raise MemberTooLarge(what, bound)

    def table(self, path: str, data: memoryview, group: int, columns: tuple[str, ...] | None,
              bound: int = DEFAULT_MAX_MEMBER_BYTES) -> Any:
        """The columns (lowercased names; None: all) of a row group, read whole. A worker reads a group at once and
        keeps ``max_bytes`` of them, so a group may take the larger of that and ``bound``: a footer declaring more
        (``group_bytes``), or dictionary values that in place would take more (``dense_bytes``), is refused
        (``MemberTooLarge``) before the memory is taken; each cell is then bounded by ``bound`` (``read_row``)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        base = data.obj if data.obj is not None else data  # the mapping itself: a view of it may be released
        key = (path, group, columns)
        hit = self._groups.get(key)
        if hit is not None and hit[0] is base:
            self._groups.move_to_end(key)
            return hit[1]
        refused = self._refused.get(key)
        if refused is not None and refused[0] is base and refused[1] == bound:
            raise MemberTooLarge(refused[2], bound)
        limit = max(bound, self.max_bytes)
        try:
            pf = pq.ParquetFile(pa.BufferReader(pa.py_buffer(base)))
            names = {n.lower(): n for n in pf.schema_arrow.names}
            wanted = None if columns is None else [names[c] for c in columns if c in names]
            need, dictionaries = group_bytes(pf.metadata, group, wanted, base, limit)
            try:
                check_pages(base, pf.metadata, group, wanted)  # what each page declares, before pyarrow allocates it
            except PageError as exc:
                raise DecodeError(f"row group {group} is not read: {exc}") from None
            rows = pf.metadata.row_group(group).num_rows
            stored = stored_bytes(pf.metadata, group, wanted)
            if need > limit and need > INFLATION * stored:
                self._refuse(key, base, bound, f"row group {group} ({rows} rows) would take {about(need)} once read, "
                                               f"more than the {about(limit)} a worker reads at once (write the file "
                                               f"in smaller row groups: pyarrow's row_group_size),")
            if dictionaries:
                pf = pq.ParquetFile(pa.BufferReader(pa.py_buffer(base)), metadata=pf.metadata,
                                    read_dictionary=dictionaries)
                table = pf.read_row_group(group, columns=wanted, use_threads=False)
            elif rows > 1:  # the table's chunks are the batches' (not copied)
                size = max(1, rows * READ_BATCH_BYTES // max(need, 1))
                table = pa.Table.from_batches(list(pf.iter_batches(size, row_groups=[group], columns=wanted,
                                                                   use_threads=False)))
            else:
                table = pf.read_row_group(group, columns=wanted, use_threads=False)
        except (pa.ArrowException, OSError, ValueError, IndexError, KeyError) as exc:
            raise DecodeError(f"row group {group} cannot be read: {exc}") from None
        if dictionaries:
            dense = sum(dense_bytes(c) for c in table.columns)
            if dense > limit and dense > INFLATION * stored:
                self._refuse(key, base, bound, f"row group {group} ({rows} rows) holds dictionary values that in "
                                               f"place would take {about(dense)}, more than the {about(limit)} a "
                                               f"worker reads at once,")
        if hit is not None:
            self._bytes -= self._groups.pop(key)[1].nbytes
        self._groups[key] = (base, table)
        self._bytes += table.nbytes
        while self._bytes > self.max_bytes and len(self._groups) > 1:
            _, (_, old) = self._groups.popitem(last=False)
            self._bytes -= old.nbytes
        return table

    def clear(self) -> None:
        """Drop every group (and so the mappings they hold): the trainer's probe keeps none."""
        self._groups.clear()
        self._refused.clear()
        self._bytes = 0


ROW_GROUPS = RowGroups()  # the worker's (one per process)


def read_row(path: str, data: memoryview, span: tuple[int, int], bound: int, columns: Collection[str] | None = None,
             views: Collection[str] = ()) -> dict[str, Any]:
    """The row at ``span`` (row group, row) of the file mapped at ``data``: {column name, lowercased: (arrow type,
    value)}.

    A binary value of a column in ``views`` is a read-only view of the row group's buffer, not a copy: for
    values that only go into a batch slot (no transform sees them), a 1 MiB cell is then copied once, not
    twice."""
    import pyarrow as pa

    group, row = span
    table = ROW_GROUPS.table(path, data, group, None if columns is None else tuple(sorted(columns)), bound)
    out: dict[str, Any] = {}
    for field, column in zip(table.schema, table.columns):
        key = field.name.lower()
        if key in out:
            raise DecodeError(f"columns {field.name!r} and another differ only in case; they are fields by their "
                              f"lowercased names")
        kind = field.type
        if key in views and (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
            value: Any = _binary_view(column, row)  # not column[row]: arrow's scalar of a binary value is a copy of it
            if value is not None and len(value) > bound:
                raise MemberTooLarge(f"is a {len(value)}-byte value,", bound, member=key)
            out[key] = (kind, value)
            continue
        cell = column[row]
        if pa.types.is_dictionary(kind) and is_bytes(kind.value_type):  # read as a dictionary: the value it indexes
            kind = kind.value_type
            cell = cell.value if cell.is_valid else pa.scalar(None, kind)
        if key in views and cell.is_valid and (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
            value = memoryview(cell.as_buffer())
        else:
            value = cell.as_py()
        if isinstance(value, (bytes, str, memoryview)) and len(value) > bound:
            raise MemberTooLarge(f"is a {len(value)}-byte value,", bound, member=key)
        out[key] = (kind, value)
    return out


def _binary_view(column: Any, row: int) -> memoryview | None:
    """A binary cell as a view of its chunk's data buffer (None: a null)."""
    import pyarrow as pa

    for chunk in column.chunks:
        if row < len(chunk):
            break
        row -= len(chunk)
    if chunk.null_count and not chunk[row].is_valid:
        return None
    _, offsets, data = chunk.buffers()
    width = 8 if pa.types.is_large_binary(chunk.type) else 4
    start, end = np.frombuffer(offsets, dtype=f"<i{width}", count=2, offset=(chunk.offset + row) * width)
    return memoryview(data if data is not None else b"")[start:end]


def column_value(name: str, typed: tuple[Any, Any], decoder: Decoder) -> Any:
    """A column's value as a field (see the module's docstring)."""
    import pyarrow as pa

    kind, value = typed
    if value is None:
        return None
    if isinstance(value, dict) and "bytes" in value and isinstance(value["bytes"], bytes):  # a Hugging Face Image
        value = value["bytes"]
    elif isinstance(value, dict) and "bytes" in value and value.get("path"):
        raise DecodeError(f"column {name!r} holds an image by path only ({value['path']!r}), not its bytes: "
                          f"write the dataset with its images embedded")
    if isinstance(value, (bytes, memoryview)):
        return decoder.value(name, value)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return np.array(value, dtype=kind.to_pandas_dtype())[()]
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) and (
            pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)):
        if any(v is None for v in value):
            raise DecodeError(f"column {name!r}: a list of numbers holds a null")
        return np.array(value, dtype=kind.value_type.to_pandas_dtype())
    return value
