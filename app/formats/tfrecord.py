"""TFRecord shards: ``tf.train.Example`` records, read by offset as a tar's members are.

A TFRecord file is a run of records, each ``uint64 length``, ``uint32`` masked CRC32C of the
length, the data, ``uint32`` masked CRC32C of the data (little-endian). The index, built once and
stored beside the shard like a tar's (``<shard>.idx``), holds each record's data offset and length:
a worker slices the record out of its mapping, checks the data's CRC and parses it with protobuf
(the ``Example`` message built from TensorFlow's ``example.proto`` and ``feature.proto``, in a
descriptor pool of its own, so TensorFlow in the same process is never touched).

A record is a sample: its key is its file's name and its ordinal there; its features are its fields, named as
they are, lowercased (``image/encoded``, ``image/class/label``). ``bytes_list`` values that are
images decode as images do (a lazy PIL image); other bytes stay ``bytes`` unless ``decode=``
names the feature; ``int64_list`` and ``float_list`` give an ``int64`` / ``float32`` scalar for one
value, else a 1-D array (a field of several lengths batches as a variable one).
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np

from .bounds import DecodeError, MemberTooLarge
from .decoders import Decoder
from .sample_index import MAX_SAMPLES, TOO_MANY, SampleTableBuilder, ShardError, ShardIndex, open_shard
from .urls import is_tfrecord, shard_stem  # noqa: F401 (tfrecord.is_tfrecord is its public test)

RECORD = "tfrecord"  # the one field of a record's entry in the index: its data's (offset, length)
HEADER = struct.Struct("<QI")  # a record's length and the length's masked CRC
_CRC = struct.Struct("<I")
TRAILER = _CRC.size  # the data CRC after each record's data
_MASK_DELTA = 0xA282EAD8



PACKAGES = {"google.protobuf": "protobuf", "google_crc32c": "google-crc32c"}  # module: the package that has it


def masked_crc(data: Any) -> int:
    """TFRecord's CRC: CRC32C (Castagnoli), rotated right by 15 and offset, as TensorFlow's ``crc32c::Mask``."""
    import google_crc32c

    try:
        crc = google_crc32c.value(data)  # bytes, or a read-only view (a mapped shard's): no copy
    except TypeError:  # a writable buffer, which google_crc32c refuses
        crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def build_index(path: str, fd: int | None = None, name: str | None = None) -> ShardIndex:
    """Every record's data offset and length, each length's CRC checked; a frame that does not hold
    together (a bad length CRC, a record past the end of the file) makes the shard a ``ShardError``.

    A record's key is ``<file>/<ordinal>`` (``part-00003/00000017``), the file named by ``name`` (the
    shard a plain copy was made from) or ``path``, without its suffix: keys are unique across files."""
    stem = shard_stem(name or path)
    f, size = open_shard(path, fd)
    with f:
        if size == 0:
            return ShardIndex(path, 0, [])
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ShardError(path, f"cannot map: {exc}") from None
    with mm:
        samples = SampleTableBuilder()
        off = n = 0
        while off < size:
            if off + HEADER.size > size:
                raise ShardError(path, f"truncated: record {n} at byte {off} has {size - off} of its 12 header bytes")
            length, crc = HEADER.unpack_from(mm, off)
            if masked_crc(mm[off : off + 8]) != crc:
                if off == 0 and mm[:2] == b"\x1f\x8b":
                    raise ShardError(path, "a gzip file (TFRecordOptions(compression_type='GZIP')): name it "
                                           "<name>.tfrecord.gz, and it is decompressed once before it is read")
                raise ShardError(path, f"record {n} at byte {off}: the length's CRC does not match (not a TFRecord "
                                       f"file, or corrupt from there on)")
            end = off + HEADER.size + length + _CRC.size
            if end > size:
                raise ShardError(path, f"truncated: record {n} at byte {off} needs bytes up to {end}, the file has "
                                       f"{size}")
            if n >= MAX_SAMPLES:  # 16 bytes of frame a record: a small file of empty records, a huge index
                raise ShardError(path, TOO_MANY)
            samples.add(f"{stem}/{n:08d}", {RECORD: (off + HEADER.size, length)})
            off, n = end, n + 1
    return ShardIndex(path, size, samples.build())


def _example_class() -> Any:
    """TensorFlow's ``tf.train.Example`` (example.proto, feature.proto), from its descriptor, in a private pool."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="feedline/tensorflow_example.proto", package="tensorflow",
                                               syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> descriptor_pb2.DescriptorProto:
        m = proto.message_type.add(name=name)
        for fname, number, label, ftype, type_name in fields:
            f = m.field.add(name=fname, number=number, label=label, type=ftype)
            if type_name:
                f.type_name = type_name
        return m

    repeated, optional = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", ("value", 1, repeated, F.TYPE_BYTES, ""))
    message("FloatList", ("value", 1, repeated, F.TYPE_FLOAT, ""))
    message("Int64List", ("value", 1, repeated, F.TYPE_INT64, ""))
    feature = message("Feature", ("bytes_list", 1, optional, F.TYPE_MESSAGE, ".tensorflow.BytesList"),
                      ("float_list", 2, optional, F.TYPE_MESSAGE, ".tensorflow.FloatList"),
                      ("int64_list", 3, optional, F.TYPE_MESSAGE, ".tensorflow.Int64List"))
    feature.oneof_decl.add(name="kind")
    for f in feature.field:
        f.oneof_index = 0
    features = message("Features", ("feature", 1, repeated, F.TYPE_MESSAGE, ".tensorflow.Features.FeatureEntry"))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.field.add(name="key", number=1, label=optional, type=F.TYPE_STRING)
    entry.field.add(name="value", number=2, label=optional, type=F.TYPE_MESSAGE, type_name=".tensorflow.Feature")
    entry.options.map_entry = True
    message("Example", ("features", 1, optional, F.TYPE_MESSAGE, ".tensorflow.Features"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


_Example: Any = None


def read_features(data: memoryview, span: tuple[int, int], bound: int) -> dict[str, Any]:
    """The record at ``span`` of a mapped shard, checked and parsed: {feature name, lowercased: its values}
    (a list of bytes, or a numpy array), features without a kind left out."""
    global _Example
    off, length = span
    if length > bound:
        raise MemberTooLarge(f"is a {length}-byte record,", bound, member=RECORD)
    if off + length + _CRC.size > len(data):
        raise DecodeError(f"record data at byte {off} runs past the end of the shard")
    payload = data[off : off + length]  # parsed from the mapped shard: the only copies are protobuf's
    (stored,) = _CRC.unpack_from(data, off + length)
    if masked_crc(payload) != stored:
        raise DecodeError(f"the record's data CRC does not match (bytes {off}-{off + length} of the shard): corrupt")
    if _Example is None:
        _Example = _example_class()
    try:
        example = _Example.FromString(payload)
    except Exception as exc:  # protobuf's DecodeError
        raise DecodeError(f"the record is not a tf.train.Example: {exc}") from None
    out: dict[str, Any] = {}
    for name, feature in sorted(example.features.feature.items()):  # protobuf's map order differs by process
        kind = feature.WhichOneof("kind")
        if kind is None:
            continue
        key = name.lower()
        if key in out:
            raise DecodeError(f"features {name!r} and another differ only in case; they are fields by their "
                              f"lowercased names")
        if kind == "bytes_list":
            out[key] = list(feature.bytes_list.value)
        elif kind == "int64_list":
            out[key] = np.array(feature.int64_list.value, dtype=np.int64)
        else:
            out[key] = np.array(feature.float_list.value, dtype=np.float32)
    return out


def feature_value(name: str, values: Any, decoder: Decoder) -> Any:
    """A feature as a field: one value as itself (a scalar, an image, bytes), several as a list (bytes) or an
    array (numbers); bytes as ``Decoder.value`` decodes a record format's."""
    if isinstance(values, np.ndarray):
        return values[0] if values.shape == (1,) else values
    out = [decoder.value(name, v) for v in values]
    return out[0] if len(out) == 1 else out
