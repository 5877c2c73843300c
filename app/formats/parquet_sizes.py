"""What a Parquet row group's columns take once pyarrow reads them, from the footer (and a dictionary page's
header), before a byte is read: the bounds ``parquet.RowGroups`` holds a group to (``INFLATION``, ``max_member_bytes``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .parquet_pages import dictionary_page_bytes

# What a value takes once pyarrow reads it, by physical type: its slot (a null takes one too) and a byte for
# its validity bit (rounded up); a FIXED_LEN_BYTE_ARRAY value its length more, a decimal 32 (decimal256) and
# a BYTE_ARRAY value its offset (or dictionary index), its bytes counted in the chunk's uncompressed size
_VALUE_BYTES = {"BOOLEAN": 2, "INT32": 5, "INT64": 9, "INT96": 13, "FLOAT": 5, "DOUBLE": 9, "BYTE_ARRAY": 5,
                "FIXED_LEN_BYTE_ARRAY": 1}
_WIDEST = 33  # a decimal, or a type this table does not name
_AS_DICTIONARY = ("NONE", "STRING", "ENUM")  # byte-array logical types pyarrow reads as dictionaries (binary, str)


def group_bytes(meta: Any, group: int, names: Collection[str] | None, data: Any = None,
                limit: int = 0) -> tuple[int, list[str]]:
    """What the columns ``names`` (None: all) of a row group take once read, from the footer, and the paths of
    their byte-array columns written with a dictionary, to read as dictionaries: read densely, each row would
    hold its value again (a 10 KB string in 200 000 rows is 2 GB, from 10 KB of data).

    A dictionary column (not a list's) is read densely after all where the file (``data``) shows that bounded
    within ``limit``: each row holds a value of a plain page (their bytes are the chunk's) or one of the
    dictionary, no larger than its page. A writer falls back to plain pages once the dictionary fills (pyarrow:
    at 1 MiB), so a column of distinct large values — images, tensors — is mostly plain; read as a dictionary,
    each value would be hashed into one (a third of the samples/s of 1 MiB rows)."""
    rg = meta.row_group(group)
    total, dictionaries = 0, []
    for i in range(rg.num_columns):
        chunk, column = rg.column(i), meta.schema.column(i)
        path = column.path
        if names is not None and not any(path == n or path.startswith(n + ".") for n in names):
            continue
        kind, logical = chunk.physical_type, column.logical_type.type
        width = _VALUE_BYTES.get(kind, _WIDEST)
        if logical == "DECIMAL":
            width = _WIDEST
        elif kind == "FIXED_LEN_BYTE_ARRAY":
            width += column.length
        values = max(chunk.num_values, rg.num_rows)
        if kind == "BYTE_ARRAY":
            total += chunk.total_uncompressed_size + values * width
            if chunk.has_dictionary_page:
                flat = column.max_repetition_level == 0  # a value a row at most: the rows bound the values
                page = dictionary_page_bytes(data, chunk.dictionary_page_offset) if data is not None and flat \
                    else None
                dense = values * (page if page is not None else chunk.total_uncompressed_size)
                if logical not in _AS_DICTIONARY or (page is not None and total + dense <= limit):
                    total += dense  # read densely: every value may be the dictionary's largest
                else:
                    dictionaries.append(path)
        else:
            total += max(chunk.total_uncompressed_size, values * width)
        total += rg.num_rows * 4 * column.max_repetition_level  # list offsets
    return total, dictionaries


def stored_bytes(meta: Any, group: int, names: Collection[str] | None) -> int:
    """The bytes the columns ``names`` (None: all) of a row group take in the file (compressed): what a group
    read whole is measured against — a large group of real data reads as it always did, one whose footer
    declares far more than it stores (nulls of a 16 MiB type, one long string repeated) is refused."""
    rg = meta.row_group(group)
    total = 0
    for i in range(rg.num_columns):
        path = meta.schema.column(i).path
        if names is None or any(path == n or path.startswith(n + ".") for n in names):
            total += max(0, rg.column(i).total_compressed_size)
    return max(1, total)


def dense_bytes(column: Any) -> int:
    """What a column read with dictionaries would take with every value in place (as rows hand them out)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        return sum(dense_bytes(c) for c in column.chunks)
    kind = column.type
    if pa.types.is_dictionary(kind) and is_bytes(kind.value_type):  # each index: the length of its value
        taken = pc.sum(pc.take(pc.binary_length(column.dictionary), column.indices)).as_py()
        return column.indices.nbytes + (taken or 0)
    if pa.types.is_dictionary(kind):  # fixed-width values (a pandas category of numbers): the mean entry each
        values = column.dictionary
        return column.indices.nbytes + len(column) * -(-values.nbytes // max(1, len(values)))
    if pa.types.is_map(kind):
        return column.offsets.nbytes + dense_bytes(column.keys) + dense_bytes(column.items)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return column.offsets.nbytes + dense_bytes(column.flatten())
    if pa.types.is_fixed_size_list(kind):
        return dense_bytes(column.flatten())
    if pa.types.is_struct(kind):
        return sum(dense_bytes(c) for c in column.flatten())
    return column.nbytes


def is_bytes(kind: Any) -> bool:
    import pyarrow as pa

    return (pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_string(kind)
            or pa.types.is_large_string(kind))
