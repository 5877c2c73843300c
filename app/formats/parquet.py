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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from typing import Any

import numpy as np

from .bounds import DecodeError, MemberTooLarge
from .decoders import Decoder
from .sample_index import Sample, ShardError, ShardIndex, open_shard
from .urls import is_parquet, shard_stem

__all__ = ["PACKAGES", "RECORD", "RowGroups", "build_index", "column_value", "is_parquet", "read_row"]

RECORD = "parquet"  # the one field of a row's entry in the index: (row group, row in it), not a byte span
PACKAGES = {"pyarrow": "pyarrow"}  # module: the package that has it
GROUP_CACHE_BYTES = 128 << 20  # a worker's bound on the row groups it keeps decoded (at least the one in use)


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
    stem = shard_stem(name or path)
    samples, n = [], 0
    for group in range(meta.num_row_groups):
        for row in range(meta.row_group(group).num_rows):
            samples.append(Sample(f"{stem}/{n:08d}", {RECORD: (group, row)}))
            n += 1
    return ShardIndex(path, size, samples)


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

    def table(self, path: str, data: memoryview, group: int, columns: tuple[str, ...] | None) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        base = data.obj if data.obj is not None else data  # the mapping itself: a view of it may be released
        key = (path, group, columns)
        hit = self._groups.get(key)
        if hit is not None and hit[0] is base:
            self._groups.move_to_end(key)
            return hit[1]
        try:
            pf = pq.ParquetFile(pa.BufferReader(pa.py_buffer(base)))
            names = {n.lower(): n for n in pf.schema_arrow.names}
            wanted = None if columns is None else [names[c] for c in columns if c in names]
            table = pf.read_row_group(group, columns=wanted, use_threads=False)
        except (pa.ArrowException, OSError, ValueError, IndexError) as exc:
            raise DecodeError(f"row group {group} cannot be read: {exc}") from None
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
    table = ROW_GROUPS.table(path, data, group, None if columns is None else tuple(sorted(columns)))
    out: dict[str, Any] = {}
    for field, column in zip(table.schema, table.columns):
        key = field.name.lower()
        if key in out:
            raise DecodeError(f"columns {field.name!r} and another differ only in case; they are fields by their "
                              f"lowercased names")
        cell = column[row]
        if key in views and cell.is_valid and (pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type)):
            value: Any = memoryview(cell.as_buffer())
        else:
            value = cell.as_py()
        if isinstance(value, (bytes, str, memoryview)) and len(value) > bound:
            raise MemberTooLarge(f"is a {len(value)}-byte value,", bound, member=key)
        out[key] = (field.type, value)
    return out


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
