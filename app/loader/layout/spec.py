"""The batch layout: which fields a batch has, their dtype and per-sample shape.

A spec is declared by the user or inferred from the first samples and then
enforced for every sample. Tensor fields live in the shared-memory ring;
variable-length ones are padded along their first axis to a capacity and get a
``<name>_len`` field holding the length. Fields that cannot be tensors — kinds
``text`` (str), ``json`` (any JSON value), ``bytes`` and ``tree`` (nested values
with arrays, tensors, bytes, tuples: msgpack, CBOR, ``.pth``, ``.npz`` members) — travel
beside the slot, encoded without pickle, and reach the loop as lists (``feedline.loader.layout.side``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ...formats import fastjpeg
from ...formats.bounds import SampleRejected
from ...formats.decoders import JSON_EXTENSIONS, TREE_EXTENSIONS, format_of

LENGTH_SUFFIX = "_len"
SIDE_KINDS = ("text", "json", "bytes", "tree")  # fields that travel beside the slot as plain data


@dataclass(frozen=True)
class Field:
    """One field of a batch: its dtype, per-sample shape, the sample key it reads, padding."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    source: str = ""  # key in the (decoded, transformed) sample; defaults to name
    variable: bool = False  # shape[0] is a capacity; lengths go to `<name>_len`

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "source", self.source or self.name)
        if self.dtype in SIDE_KINDS:
            if self.shape or self.variable:
                raise ValueError(f"spec field {self.name!r}: a {self.dtype} field has no shape; it arrives as a list")
            return
        try:
            object.__setattr__(self, "dtype", np.dtype(self.dtype).str)
        except TypeError:
            raise ValueError(f"spec field {self.name!r}: {self.dtype!r} is neither a numpy dtype nor one of "
                             f"{', '.join(SIDE_KINDS)}") from None
        if np.dtype(self.dtype).hasobject:
            raise ValueError(f"spec field {self.name!r}: object dtypes cannot live in shared memory")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"spec field {self.name!r}: negative dimension in shape {self.shape}")
        if self.variable and (not self.shape or self.shape[0] < 1):
            raise ValueError(f"spec field {self.name!r}: a variable field needs a capacity, shape=(capacity, ...)")

    @property
    def side(self) -> bool:
        """It travels beside the slot (text, json, bytes, tree), not as a tensor."""
        return self.dtype in SIDE_KINDS

    @cached_property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @cached_property
    def nbytes(self) -> int:  # on the per-sample path: computed once
        return int(np.prod(self.shape, dtype=np.int64)) * self.np_dtype.itemsize

    @cached_property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def length_name(self) -> str:
        return self.name + LENGTH_SUFFIX

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "source": self.source, "variable": self.variable}


def is_pil_image(value: Any) -> bool:
    """A PIL image, without importing PIL."""
    return hasattr(value, "getbands") and hasattr(value, "size")


def as_array(value: Any, image_mode: str = "RGB") -> np.ndarray:
    """The array form of a decoded/transformed value; raises TypeError for the unrepresentable."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (bool, int, float, np.generic)):
        return np.asarray(value)
    if isinstance(value, str):
        return np.frombuffer(value.encode("utf-8"), dtype=np.uint8)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return np.frombuffer(value, dtype=np.uint8)
    if is_pil_image(value):
        if value.mode != image_mode:
            value = value.convert(image_mode)
        return np.asarray(value)
    if hasattr(value, "numpy") and hasattr(value, "detach"):  # a torch tensor
        return value.detach().cpu().numpy()
    raise TypeError(f"a {type(value).__name__} cannot go into a tensor; convert it in your transform")


def _image_mode(field: Field) -> str:
    if len(field.shape) == 2:
        return "L"
    if len(field.shape) == 3 and field.shape[-1] == 4:
        return "RGBA"
    return "RGB"


_INT64 = (-(1 << 63), (1 << 63) - 1)


def fill(field: Field, dst: np.ndarray, value: Any, lengths: np.ndarray | None, i: int) -> int:
    """Write one sample's value into row ``i`` of the field's slot array; returns bytes written."""
    if type(value) is int and field.dtype == "<i8" and not field.shape and _INT64[0] <= value <= _INT64[1]:
        dst[i] = value  # a label: what the general path below does, without its four numpy calls
        return 8
    try:
        if not field.variable and fastjpeg.pack_into(value, dst[i], stream=True):  # PIL RGB: one pass, past
            # the caches (a slot is read by another process or the device)
            return field.nbytes
        arr = as_array(value, _image_mode(field))
    except TypeError as exc:
        raise SampleRejected("shape_mismatch", f"field {field.name!r}: {exc}") from None
    except Exception as exc:  # lazy image decode happens here
        raise SampleRejected("corrupt", f"field {field.name!r}: cannot decode: {exc}") from None
    if field.variable:
        n = arr.shape[0] if arr.ndim else 1
        if n > field.shape[0]:
            raise SampleRejected(
                "too_large",
                f"field {field.name!r} has length {n}, over its capacity {field.shape[0]} "
                f"(declare a larger capacity in the spec)",
            )
        if arr.shape[1:] != field.shape[1:]:
            raise SampleRejected("shape_mismatch", f"field {field.name!r}: shape {arr.shape} does not fit {field.shape}")
        row = dst[i]
        np.copyto(row[:n], arr.reshape((n,) + field.shape[1:]), casting="same_kind")
        row[n:] = 0
        assert lengths is not None
        lengths[i] = n
        return n * (field.nbytes // field.shape[0])
    if arr.shape != field.shape:
        if arr.dtype == np.uint8 and arr.ndim == 1 and arr.nbytes == field.nbytes:
            arr = arr.view(field.np_dtype).reshape(field.shape)  # raw bytes with a declared layout
        elif arr.size > field.count:
            raise SampleRejected("too_large", f"field {field.name!r}: shape {arr.shape} is larger than {field.shape}")
        else:
            raise SampleRejected("shape_mismatch", f"field {field.name!r}: shape {arr.shape}, the spec says {field.shape}")
    try:
        np.copyto(dst[i, ...], arr, casting="same_kind")
    except TypeError:
        raise SampleRejected(
            "shape_mismatch", f"field {field.name!r}: dtype {arr.dtype} cannot be stored as {field.np_dtype}"
        ) from None
    return field.nbytes


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Spec:
    """The batch layout: every field a batch holds, declared or inferred, then enforced."""

    fields: tuple[Field, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        names += [f.length_name for f in self.fields if f.variable]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"spec: duplicate field names {sorted(dup)}")
        if not self.fields:
            raise ValueError("spec: at least one field is needed")

    @property
    def sources(self) -> set[str]:
        return {f.source for f in self.fields}

    @property
    def tensor_fields(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if not f.side)

    @property
    def side_fields(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.side)

    @property
    def sample_bytes(self) -> int:
        return sum(f.nbytes + (4 if f.variable else 0) for f in self.tensor_fields)

    def to_json(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self.fields]

    @classmethod
    def from_json(cls, doc: Sequence[Mapping[str, Any]]) -> "Spec":
        return cls(tuple(Field(d["name"], d["dtype"], tuple(d["shape"]), d["source"], d["variable"]) for d in doc))

    @classmethod
    def parse(cls, spec: "Spec | Mapping[str, Any] | Sequence[Field]") -> "Spec":
        """Accepts a Spec, a list of Fields, or ``{name: dtype | (dtype, shape) | {dtype, shape, ...}}``."""
        if isinstance(spec, Spec):
            return spec
        if isinstance(spec, Mapping):
            fields = []
            for name, desc in spec.items():
                if isinstance(desc, Field):
                    fields.append(desc)
                elif isinstance(desc, str):
                    fields.append(Field(name, desc))
                elif isinstance(desc, Mapping):
                    fields.append(Field(name, desc["dtype"], tuple(desc.get("shape", ())),
                                        desc.get("source", ""), bool(desc.get("variable", False))))
                elif isinstance(desc, Sequence) and len(desc) == 2:
                    fields.append(Field(name, desc[0], tuple(desc[1])))
                else:
                    raise ValueError(
                        f"spec field {name!r}: expected a dtype, (dtype, shape) or a dict, got {desc!r}"
                    )
            return cls(tuple(fields))
        return cls(tuple(spec))

    @classmethod
    def infer(cls, samples: Mapping[str, Any] | Sequence[Mapping[str, Any]],
              capacities: Mapping[str, int] | None = None) -> "Spec":
        """The layout the given samples share (see ``infer_field``); ``capacities`` bound variable fields."""
        if isinstance(samples, Mapping):
            samples = [samples]
        first = samples[0]
        fields = []
        for key in first:
            if key.startswith("__"):
                continue
            values = [s[key] for s in samples if key in s]
            fields.append(infer_field(key, values, (capacities or {}).get(key, 0)))
        return cls(tuple(sorted(fields, key=lambda f: f.name)))


def _is_image(value: Any) -> bool:
    return hasattr(value, "getbands") and hasattr(value, "size")


def _json_safe(value: Any) -> bool:
    """JSON carries it and gives it back equal (no tuples, bytes, arrays or non-str keys)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value) in (type(None), bool, int, float, str)
    if type(value) is list:
        return all(_json_safe(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _json_safe(v) for k, v in value.items())
    return False


def _side_kind(key: str, value: Any) -> str | None:
    fmt = format_of(key)
    if fmt in JSON_EXTENSIONS:
        return "json"
    if isinstance(value, str):
        return "text"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    if value is None or isinstance(value, (list, tuple, dict, set, frozenset)):
        return "tree" if fmt in TREE_EXTENSIONS or not _json_safe(value) else "json"
    return None


def infer_field(key: str, values: Sequence[Any], capacity: int = 0) -> Field:
    """One field from its values in several samples.

    Strings become ``text``, bytes ``bytes``, JSON members and dicts/lists JSON carries ``json``,
    other nested values (msgpack, CBOR, ``.pth``, ``.npz``, ``.ten`` members, tuples, arrays inside) ``tree``;
    everything else must be an array of one dtype. Arrays of one shape make a fixed field;
    1-D arrays of several lengths (and scalars among them, as one value: a TFRecord's lists) a variable one, with room for 1.25x the longest seen (or
    ``capacity``, the longest member the shard indexes know of), rounded up to a power of two.
    Images or arrays of several shapes cannot be batched: refused, with the fix named.
    """
    kinds = {_side_kind(key, v) for v in values}
    if kinds == {"json", "tree"}:  # some samples' values need more than JSON: all travel as trees
        kinds = {"tree"}
    if len(kinds) > 1:
        raise ValueError(f"field {key!r} holds values of different kinds in different samples "
                         f"({', '.join(sorted(str(k or 'array') for k in kinds))}); pass spec= to say which")
    kind = kinds.pop()
    if kind is not None:
        return Field(key, kind)
    try:
        arrays = [as_array(v) for v in values]
    except TypeError as exc:
        raise ValueError(f"cannot infer a spec for field {key!r}: {exc}; pass spec=") from None
    dtypes = {a.dtype.str for a in arrays}
    if len(dtypes) > 1:
        raise ValueError(f"field {key!r} has dtypes {sorted(dtypes)} in different samples; declare one in spec=")
    shapes = sorted({a.shape for a in arrays})
    if len(shapes) == 1:
        return Field(key, arrays[0].dtype.str, shapes[0])
    if all(len(sh) <= 1 for sh in shapes) and not any(_is_image(v) for v in values):  # a scalar: one value
        longest = max(max(sh[0] if sh else 1 for sh in shapes), capacity)
        return Field(key, arrays[0].dtype.str, (next_pow2(max(64, int(longest * 1.25))),), variable=True)
    seen = ", ".join("x".join(map(str, sh)) for sh in shapes[:4])
    if any(_is_image(v) for v in values):
        raise ValueError(
            f"field {key!r} holds images of different sizes ({seen}, ...): a batch needs one size. Add a transform "
            f"that resizes or crops them, e.g. transform=RandomResizedCrop(224, fields=[{key!r}]) "
            f"(feedline.formats.transforms), or declare the field in spec= with a transform that fits it")
    raise ValueError(f"field {key!r} has arrays of different shapes ({seen}, ...); a batch needs one shape: "
                     f"make them one shape in a transform, or declare a variable field in spec=")
