"""The batch layout: which fields a batch has, their dtype and per-sample shape.

A spec is declared by the user or inferred from the first sample and then
enforced for every sample. Variable-length fields are padded along their first
axis to a declared capacity and get a ``<name>_len`` field holding the length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

LENGTH_SUFFIX = "_len"


class SampleRejected(Exception):
    """This sample cannot go into a slot; ``reason`` is its sample-error label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    source: str = ""  # key in the (decoded, transformed) sample; defaults to name
    variable: bool = False  # shape[0] is a capacity; lengths go to `<name>_len`

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype).str)
        object.__setattr__(self, "source", self.source or self.name)
        if np.dtype(self.dtype).hasobject:
            raise ValueError(f"spec field {self.name!r}: object dtypes cannot live in shared memory")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"spec field {self.name!r}: negative dimension in shape {self.shape}")
        if self.variable and (not self.shape or self.shape[0] < 1):
            raise ValueError(f"spec field {self.name!r}: a variable field needs a capacity, shape=(capacity, ...)")

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
    if hasattr(value, "getbands") and hasattr(value, "size"):  # a PIL image
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


def fill(field: Field, dst: np.ndarray, value: Any, lengths: np.ndarray | None, i: int) -> int:
    """Write one sample's value into row ``i`` of the field's slot array; returns bytes written."""
    try:
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


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Spec:
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
    def sample_bytes(self) -> int:
        return sum(f.nbytes + (4 if f.variable else 0) for f in self.fields)

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
    def infer(cls, sample: Mapping[str, Any]) -> "Spec":
        """Fixed shapes from the first sample; text and bytes become variable fields."""
        fields = []
        for key, value in sample.items():
            if key.startswith("__"):
                continue
            try:
                arr = as_array(value)
            except TypeError as exc:
                raise ValueError(f"cannot infer a spec for field {key!r}: {exc}; pass spec=") from None
            if isinstance(value, (str, bytes, bytearray, memoryview)):
                fields.append(Field(key, "uint8", (max(64, _next_pow2(2 * len(arr))),), variable=True))
            else:
                fields.append(Field(key, arr.dtype.str, arr.shape))
        return cls(tuple(sorted(fields, key=lambda f: f.name)))
