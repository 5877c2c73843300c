"""What a shard's index may cost (issue 62): bounded by the file's bytes, whatever its header or footer declares."""

import struct
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from feedline.formats import parquet, tfrecord
from feedline.formats.bounds import DecodeError
from feedline.formats.sample_index import MAX_SAMPLES, ShardError


def test_a_parquet_index_costs_a_number_a_row_group_not_bytes_a_row(tmp_path):
    """A million rows of one byte each: a 1 MB file whose index, built a Sample a row, took ~450 MB."""
    path = str(tmp_path / "tiny-rows.parquet")
    rows = np.random.default_rng(0).integers(-128, 128, MAX_SAMPLES, dtype=np.int8)  # a byte a row, as stored
    pq.write_table(pa.table({"b": pa.array(rows)}), path, row_group_size=1 << 17, compression="zstd")
    tracemalloc.start()
    try:
        index = parquet.build_index(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(index.samples) == MAX_SAMPLES and peak < 8 << 20, peak
    assert index.samples[MAX_SAMPLES - 1].fields[parquet.RECORD] == (7, (1 << 17) - 1)  # the last row of group 7
    assert index.samples[3].key == "tiny-rows/00000003"
    assert parquet.groups_of(index.samples)[(1 << 17) + 5] == 1


def _page_size_lie(path: str) -> bytes:
    """The file with its first data page declaring the most its header's varint can hold as its uncompressed size:
    more than the footer says, in the same number of bytes."""
    data = bytearray(open(path, "rb").read())
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(0)
    at = chunk.data_page_offset
    assert data[at] == 0x15 and data[at + 2] == 0x15  # field 1 (type) and field 2 (its uncompressed size), i32 each
    pos = at + 3
    end = pos
    while data[end] & 0x80:
        end += 1
    width = end - pos + 1
    most = (1 << (7 * width)) - 2  # zigzag of the largest value that fits in those bytes
    for k in range(width):
        data[pos + k] = (most >> (7 * k)) & 0x7F | (0x80 if k < width - 1 else 0)
    return bytes(data)


def test_a_page_declaring_more_than_its_footer_is_refused_before_it_is_read(tmp_path):
    path = str(tmp_path / "lies.parquet")
    pq.write_table(pa.table({"x": pa.array(range(5000), pa.int64())}), path, compression="none",
                   use_dictionary=False)
    lying = _page_size_lie(path)
    with pytest.raises(DecodeError, match="pages declare .* more than the .* its footer says"):
        parquet.RowGroups().table("lies.parquet", memoryview(lying), 0, None)
    honest = open(path, "rb").read()
    assert parquet.RowGroups().table("lies.parquet", memoryview(honest), 0, None).num_rows == 5000


def test_a_tfrecord_file_of_more_records_than_an_index_holds_is_refused(tmp_path):
    path = tmp_path / "many.tfrecord"
    empty = struct.pack("<QI", 0, tfrecord.masked_crc(struct.pack("<Q", 0))) + struct.pack("<I", tfrecord.masked_crc(b""))
    path.write_bytes(empty * (MAX_SAMPLES + 1))  # 16 MB of empty records
    with pytest.raises(ShardError, match="more than 1,048,576 samples"):
        tfrecord.build_index(str(path))
    path.write_bytes(empty * 1000)
    assert len(tfrecord.build_index(str(path)).samples) == 1000
