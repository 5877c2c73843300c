"""One sample, from tar members to the dict a transform and the spec see.

``fields=`` chooses the members a sample is read from, like webdataset's
``rename``/``to_tuple``: a list of extensions keeps those, a mapping
``{name: "jpg;png"}`` names each field and lists the extensions that may hold
it (the first present wins). Members nobody asked for are never decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ...formats import parquet, tfrecord
from ...formats.decoders import Decoder
from ...formats.shard_index import Sample
from .spec import SampleRejected

Transform = Callable[[dict[str, Any]], dict[str, Any]]


class FieldSelection:
    """Which members make a sample, and the names they get; None keeps every member under its extension."""

    def __init__(self, fields: Sequence[str] | Mapping[str, str] | None):
        if fields is None:
            self.names: dict[str, tuple[str, ...]] | None = None
            return
        if isinstance(fields, str):
            raise TypeError("fields: give a list of extensions (['jpg', 'cls']) or a mapping "
                            "({'image': 'jpg;png', 'label': 'cls'}), not a string")
        pairs = fields.items() if isinstance(fields, Mapping) else ((f, f) for f in fields)
        self.names = {}
        for name, exts in pairs:
            alts = tuple(e.strip().lower().lstrip(".") for e in str(exts).split(";") if e.strip())
            if not alts:
                raise ValueError(f"fields: {name!r} names no extension")
            self.names[str(name)] = alts
        if not self.names:
            raise ValueError("fields: the selection is empty")

    @property
    def extensions(self) -> set[str] | None:
        """The member extensions to decode (None: all)."""
        return None if self.names is None else {e for alts in self.names.values() for e in alts}

    def sources_of(self, fields: Collection[str]) -> set[str]:
        """The members (columns, features) the named fields are read from."""
        if self.names is None:
            return set(fields)
        return {e for name, alts in self.names.items() if name in fields for e in alts}

    def describe(self) -> str:
        if self.names is None:
            return "every member"
        return ", ".join(n if alts == (n,) else f"{n}={';'.join(alts)}" for n, alts in self.names.items())

    def pick(self, present: Collection[str], decode: Callable[[str], Any]) -> dict[str, Any]:
        """{name: decoded member} for the selected fields; a missing one rejects the sample."""
        assert self.names is not None
        out = {}
        for name, alts in self.names.items():
            ext = next((e for e in alts if e in present), None)
            if ext is None:
                raise SampleRejected("missing_field", f"has no member {' or '.join('.' + e for e in alts)} for "
                                                      f"field {name!r} (it has {sorted(present)})")
            out[name] = decode(ext)
        return out


def load_sample(data: memoryview, path: str, ref: Sample, decoder: Decoder, selection: FieldSelection,
                wanted: set[str] | None, transform: Transform | None, required: set[str],
                source: str | None = None, views: Collection[str] = ()) -> tuple[dict[str, Any], int]:
    """Decode (only what is selected or wanted) and transform one sample; (sample, bytes read).

    ``wanted`` narrows the members further where nothing but the spec reads them (no transform);
    ``source`` (a mixture) is the sample's source name, which the transform sees as ``__source__``;
    ``views``: the members (columns) a Parquet row may hand over as views of its buffers, those that go
    straight into a batch slot's array with no transform between (``FieldSelection.sources_of``, once a worker).
    """
    read = 0
    if tfrecord.is_tfrecord(path):  # a record: its features are the sample's fields
        read = ref.fields[tfrecord.RECORD][1]
        features = tfrecord.read_features(data, ref.fields[tfrecord.RECORD], decoder.max_member_bytes)
        present: Collection[str] = features

        def decode(name: str) -> Any:
            return tfrecord.feature_value(name, features[name], decoder)
    elif parquet.is_parquet(path):  # a row: its columns are the sample's fields
        names = selection.extensions if selection.names is not None else wanted
        columns = parquet.read_row(path, data, ref.fields[parquet.RECORD], decoder.max_member_bytes, names, views)
        present = columns
        read = sum(len(v) for _, v in columns.values() if isinstance(v, (bytes, str, memoryview)))

        def decode(name: str) -> Any:
            return parquet.column_value(name, columns[name], decoder)
    else:
        present = ref.fields

        def decode(ext: str) -> Any:
            nonlocal read
            off, size = ref.fields[ext]
            read += size
            return decoder(ext, data[off : off + size])

    sample: dict[str, Any] = {"__key__": ref.key, "__shard__": path}
    if source is not None:
        sample["__source__"] = source
    if selection.names is not None:
        sample.update(selection.pick(present, decode))
    else:
        for ext in present:
            if wanted is None or ext in wanted:
                sample[ext] = decode(ext)
    if transform is not None:
        sample = transform(sample)
        if not isinstance(sample, dict):
            raise TypeError(f"the transform returned a {type(sample).__name__}, not a dict")
    missing = required.difference(sample)
    if missing:
        have = sorted(k for k in sample if not k.startswith("__"))
        raise SampleRejected("missing_field", f"has no field {sorted(missing)} (it has {have})")
    return sample, read
