"""Fields that are not tensors travel beside the ring slot: text, JSON, bytes and trees, never pickled.

Each slot has a side region of ``side_bytes`` per sample and a row of lengths
per sample (one int32 per side field). The worker filling the slot packs each
sample's side values back to back — the sample key first, always — and the
trainer reads the used bytes once, into lists (``batch["__key__"]``,
``batch["txt"]``, ...), before the slot is reused. Text travels as UTF-8, JSON
as JSON text, bytes as they are, trees as msgpack (``feedline.loader.layout.tree``). A sample's values may take ``side_bytes`` in all.
"""

from __future__ import annotations

import json
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np

from . import tree
from .spec import Field, SampleRejected, is_pil_image

KEY = Field("__key__", "text")  # every batch has the keys of its samples
SOURCE = Field("__source__", "text")  # a mixture's batches: each sample's source, by its name
SIDE_LEN = "__side_len"  # (batch, fields) int32: each value's length
SIDE_DATA = "__side"  # (batch, side_bytes) uint8: the values, back to back
KEY_ONLY_SIDE_BYTES = 1024  # per sample, when the key is the only side field
DEFAULT_SIDE_BYTES = 16384  # per sample, when captions or metadata travel too


def encode(field: Field, value: Any) -> bytes:
    """One value in its wire form; a value of the wrong kind is rejected with the field named."""
    if field.dtype == "text":
        if isinstance(value, str):
            return value.encode("utf-8")
        raise SampleRejected("shape_mismatch", f"field {field.name!r} is text but holds a {type(value).__name__}")
    if field.dtype == "json":
        try:
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise SampleRejected("shape_mismatch", f"field {field.name!r} cannot travel as JSON ({exc}); convert "
                                                   f"it in your transform") from None
    if field.dtype == "tree":
        try:
            return tree.pack(value)
        except tree.TreeError as exc:
            raise SampleRejected("shape_mismatch", f"field {field.name!r}: {exc}; convert it in your "
                                                   f"transform") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if is_pil_image(value):  # RandomResizedCrop's output: its pixels
        value = np.asarray(value)
    if isinstance(value, np.ndarray) and value.dtype == np.uint8:
        return value.tobytes()
    raise SampleRejected("shape_mismatch", f"field {field.name!r} is bytes but holds a {type(value).__name__}")


class SideWriter:
    """Packs the side values of a batch's samples back to back into its slot (in a worker, one batch at a time)."""

    def __init__(self, fields: tuple[Field, ...], side_bytes: int):
        self.fields = fields
        self.side_bytes = side_bytes
        self.offset = 0
        # the last slot written, as flat memoryviews: a memoryview's slice assignment costs a fraction of numpy's
        # (a few µs a sample, cold, beside the decode: issue 68)
        self._views: dict[str, np.ndarray] | None = None
        self._region: SideRegion | None = None

    def begin(self) -> None:
        """A new batch: pack from the start of the slot's side region."""
        self.offset = 0

    def write(self, views: dict[str, np.ndarray], i: int, key: str, sample: dict[str, Any],
              source: str | None = None) -> int:
        """Bytes written for sample row ``i``; over ``side_bytes`` it is ``too_large``, naming the field.

        ``source`` (a mixture's sample: its source's name) goes right after the key, as the layout says."""
        values = [key.encode("utf-8")] + ([source.encode("utf-8")] if source is not None else [])
        total = sum(len(v) for v in values)
        for f in self.fields[len(values):]:
            data = encode(f, sample[f.source])
            total += len(data)
            if total > self.side_bytes:
                raise SampleRejected(
                    "too_large", f"field {f.name!r} ({len(data)} bytes) does not fit: the sample's text, JSON and "
                                 f"bytes fields need {total}+ bytes, over side_bytes={self.side_bytes} per sample "
                                 f"(raise side_bytes)")
            values.append(data)
        if total > self.side_bytes:
            raise SampleRejected("too_large", f"the sample key takes {total} bytes, over side_bytes="
                                              f"{self.side_bytes} per sample (raise side_bytes)")
        if views is not self._views:
            self._views, self._region = views, SideRegion.of(views)
        lengths, region = self._region  # type: ignore[misc]
        off, at = self.offset, i * len(self.fields)
        for data in values:
            end = off + len(data)
            region[off:end] = data
            lengths[at] = len(data)
            off, at = end, at + 1
        self.offset = off
        return total


class SideRegion(NamedTuple):
    """A slot's side region as flat memoryviews: what ``read`` slices, without a numpy call (each costs microseconds
    more than a memoryview's, tens of microseconds when the loop comes back from a long step to cold caches)."""

    lengths: memoryview  # int32, sample-major: (batch, fields) flattened
    data: memoryview  # the values, back to back

    @classmethod
    def of(cls, views: dict[str, np.ndarray]) -> "SideRegion":
        return cls(memoryview(views[SIDE_LEN]).cast("B").cast("i"), memoryview(views[SIDE_DATA]).cast("B"))


def read(views: "dict[str, np.ndarray] | SideRegion", n: int,
         fields: tuple[Field, ...]) -> tuple[dict[str, list[Any]], int]:
    """(the side values of the first ``n`` samples of a slot, one list per field; their bytes) — in the trainer,
    on every batch: text that is ASCII (keys almost always are) is decoded once and sliced. ``views``: the slot's
    arrays, or its ``SideRegion`` (made once a slot by a caller that reads it batch after batch)."""
    if not fields:  # most batches: tensors only
        return {}, 0
    region = views if isinstance(views, SideRegion) else SideRegion.of(views)
    flat = region.lengths[: n * len(fields)].tolist()  # sample-major: the order the worker packed them in
    ends = list(accumulate(flat))
    total = ends[-1] if ends else 0
    blob = region.data[:total].tobytes()  # one copy of what is used
    width = len(fields)
    text: str | None = None
    out: dict[str, list[Any]] = {}
    for j, f in enumerate(fields):
        stops = ends if width == 1 else ends[j::width]
        starts = [0, *ends[:-1]] if width == 1 else [e - k for e, k in zip(stops, flat[j::width])]
        spans = zip(starts, stops)
        if f.dtype == "text":
            if text is None:
                text = blob.decode("ascii") if blob.isascii() else ""
            out[f.name] = ([text[a:b] for a, b in spans] if text or not blob
                           else [blob[a:b].decode("utf-8") for a, b in spans])
        elif f.dtype == "json":
            out[f.name] = [json.loads(blob[a:b]) for a, b in spans]
        elif f.dtype == "tree":
            out[f.name] = [tree.unpack(blob[a:b]) for a, b in spans]
        else:
            out[f.name] = [blob[a:b] for a, b in spans]
    return out, total
