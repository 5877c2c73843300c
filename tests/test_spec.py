"""The batch layout: declared or inferred, then enforced."""

import numpy as np
import pytest

from app.loader.ring import BatchRing, RingLayout
from app.loader.spec import Field, SampleRejected, Spec, fill


def test_spec_is_inferred_from_the_first_sample():
    spec = Spec.infer({"__key__": "k", "cls": 3, "npy": np.zeros((2, 3), np.float32), "txt": "hi"})
    by_name = {f.name: f for f in spec.fields}
    assert set(by_name) == {"cls", "npy", "txt"}
    assert by_name["npy"].shape == (2, 3) and np.dtype(by_name["npy"].dtype) == np.float32
    assert by_name["txt"].variable and by_name["txt"].shape[0] >= 64


def test_a_value_that_cannot_be_a_tensor_needs_a_spec():
    with pytest.raises(ValueError, match="json"):
        Spec.infer({"json": {"a": 1}})


def test_raw_bytes_fill_a_field_of_the_same_size_as_its_dtype():
    f = Field("bin", "float32", (2, 2))
    dst = np.zeros((1, 2, 2), np.float32)
    raw = np.arange(4, dtype=np.float32).tobytes()
    fill(f, dst, np.frombuffer(raw, np.uint8), None, 0)
    np.testing.assert_array_equal(dst[0], [[0, 1], [2, 3]])


def test_a_wrong_shape_is_rejected_with_the_field_named():
    f = Field("npy", "float32", (4,))
    with pytest.raises(SampleRejected, match="npy") as err:
        fill(f, np.zeros((1, 4), np.float32), np.zeros(3, np.float32), None, 0)
    assert err.value.reason == "shape_mismatch"


def test_an_oversized_variable_value_is_rejected_as_too_large():
    f = Field("txt", "uint8", (4,), variable=True)
    with pytest.raises(SampleRejected) as err:
        fill(f, np.zeros((1, 4), np.uint8), "too long", np.zeros(1, np.int32), 0)
    assert err.value.reason == "too_large"


def test_duplicate_field_names_are_refused():
    with pytest.raises(ValueError, match="duplicate"):
        Spec((Field("a", "uint8", (4,), variable=True), Field("a_len", "int32")))


def test_the_ring_lays_fields_out_per_slot_without_overlap():
    spec = Spec.parse({"jpg": ("uint8", (8, 8, 3)), "cls": "int64", "txt": {"dtype": "uint8", "shape": [16],
                                                                             "variable": True}})
    layout = RingLayout(spec, batch_size=4)
    ring = BatchRing(layout, slots=3, workers=1)
    try:
        for s in range(3):
            for name, arr in ring.slot(s).items():
                arr[...] = s + 1
        for s in range(3):
            assert all(int(arr.min()) == s + 1 for arr in ring.slot(s).values())
        assert set(ring.slot(0)) == {"jpg", "cls", "txt", "txt_len"}
    finally:
        ring.close()
