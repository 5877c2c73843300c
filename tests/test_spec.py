"""The batch layout: declared or inferred, then enforced."""

import numpy as np
import pytest

from feedline.loader.ring.batch_ring import BatchRing, RingLayout
from feedline.loader.layout.spec import Field, SampleRejected, Spec, fill


def test_spec_is_inferred_from_a_sample():
    spec = Spec.infer({"__key__": "k", "cls": 3, "npy": np.zeros((2, 3), np.float32), "txt": "hi",
                       "json": {"a": [1, 2]}, "xyz": b"raw"})
    by_name = {f.name: f for f in spec.fields}
    assert set(by_name) == {"cls", "npy", "txt", "json", "xyz"}
    assert by_name["npy"].shape == (2, 3) and np.dtype(by_name["npy"].dtype) == np.float32
    assert (by_name["txt"].dtype, by_name["json"].dtype, by_name["xyz"].dtype) == ("text", "json", "bytes")
    assert spec.side_fields == (by_name["json"], by_name["txt"], by_name["xyz"])


def test_a_json_member_is_json_whatever_value_it_holds():
    assert Spec.infer([{"meta.json": 3}, {"meta.json": 4}]).fields[0].dtype == "json"


def test_nested_values_json_cannot_carry_are_trees_and_plain_ones_stay_json():
    kinds = {f.name: f.dtype for f in Spec.infer([
        {"mp": {"a": 1}, "meta": {"a": [1]}, "boxes": (1, 2), "arrays": {"x": np.zeros(2)}, "ids": {1: "a"}},
        {"mp": {"a": 2}, "meta": {"a": [2]}, "boxes": (3, 4), "arrays": {"x": np.ones(2)}, "ids": {2: "b"}}]).fields}
    assert kinds == {"mp": "tree", "meta": "json", "boxes": "tree", "arrays": "tree", "ids": "tree"}


def test_a_field_json_carries_in_some_samples_only_travels_as_a_tree_in_all():
    assert Spec.infer([{"m": {"a": 1}}, {"m": {"a": b"raw"}}]).fields[0].dtype == "tree"


def test_a_number_decoded_from_a_msgpack_member_is_a_tensor():
    f = Spec.infer([{"n.mp": 3}, {"n.mp": 4}]).fields[0]
    assert not f.side and np.dtype(f.dtype) == np.int64


def test_trees_come_back_with_their_types_and_values():
    torch = pytest.importorskip("torch")
    from feedline.loader.layout import tree

    value = {"w": torch.arange(3, dtype=torch.bfloat16), "a": np.arange(4, dtype=np.uint16).reshape(2, 2),
             "t": (1, "x", b"\x00"), 7: {1.5, 2.5}, "f": np.float32(0.5), "n": None, "empty": torch.zeros(0, 3)}
    back = tree.unpack(tree.pack(value))
    assert list(back) == list(value) and back["t"] == (1, "x", b"\x00") and back[7] == {1.5, 2.5}
    assert back["w"].dtype == torch.bfloat16 and torch.equal(back["w"], value["w"])
    assert back["a"].dtype == np.uint16 and (back["a"] == value["a"]).all() and back["a"].flags.writeable
    assert type(back["f"]) is np.float32 and back["n"] is None and back["empty"].shape == (0, 3)


def test_a_tree_with_an_object_of_its_own_class_is_rejected_naming_the_class():
    from feedline.loader.layout.side import encode

    with pytest.raises(SampleRejected, match="'meta'.*datetime.date cannot travel"):
        encode(Field("meta", "tree"), {"when": __import__("datetime").date(2026, 1, 1)})
    with pytest.raises(SampleRejected, match="object array"):
        encode(Field("meta", "tree"), [np.array([None])])


def test_a_bytes_field_given_a_pil_image_holds_its_pixels():
    from PIL import Image

    from feedline.loader.layout.side import encode

    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    assert encode(Field("jpg", "bytes"), Image.fromarray(pixels)) == pixels.tobytes()


def test_a_pil_rgb_image_and_its_array_fill_a_slot_row_alike():
    from PIL import Image

    pixels = np.random.default_rng(3).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    field = Field("jpg", "uint8", (5, 7, 3))
    a, b = np.zeros((2, 5, 7, 3), np.uint8), np.zeros((2, 5, 7, 3), np.uint8)
    assert fill(field, a, Image.fromarray(pixels), None, 1) == fill(field, b, pixels, None, 1) == pixels.nbytes
    assert np.array_equal(a, b) and np.array_equal(a[1], pixels)
    with pytest.raises(SampleRejected, match="shape"):  # another size: refused, as an array of it is
        fill(field, a, Image.fromarray(pixels[:, :6]), None, 0)


def test_a_value_that_cannot_be_a_tensor_or_json_needs_a_spec():
    with pytest.raises(ValueError, match="'obj'"):
        Spec.infer({"obj": object()})


def test_lengths_that_vary_across_samples_make_a_variable_field_with_headroom():
    f = Spec.infer([{"bin": np.zeros(n, np.uint8)} for n in (100, 300, 200)]).fields[0]
    assert f.variable and f.shape == (512,)  # 1.25 x 300, to a power of two
    assert Spec.infer([{"bin": np.zeros(n, np.uint8)} for n in (100, 300)], {"bin": 1000}).fields[0].shape == (2048,)


def test_images_of_different_sizes_are_refused_with_the_fix_named():
    from PIL import Image

    samples = [{"jpg": Image.new("RGB", size)} for size in ((50, 40), (40, 50))]
    with pytest.raises(ValueError, match="RandomResizedCrop"):
        Spec.infer(samples)


def test_raw_bytes_fill_a_field_of_the_same_size_as_its_dtype():
    f = Field("bin", "float32", (2, 2))
    dst = np.zeros((1, 2, 2), np.float32)
    raw = np.arange(4, dtype=np.float32).tobytes()
    fill(f, dst, np.frombuffer(raw, np.uint8), None, 0)
    np.testing.assert_array_equal(dst[0], [[0, 1], [2, 3]])


def test_an_int_label_fills_its_row_as_the_general_path_writes_any_integer():
    values = [7, -1, (1 << 63) - 1, -(1 << 63), True, 1 << 63]  # True and 1 << 63: the general path itself
    for dtype in ("int64", "int16"):
        f = Field("cls", dtype)
        dst, expected = np.zeros(len(values), dtype), np.zeros(len(values), dtype)
        for i, value in enumerate(values if dtype == "int64" else [7, -1, 300]):
            assert fill(f, dst, value, None, i) == np.dtype(dtype).itemsize
            np.copyto(expected[i, ...], np.asarray(value), casting="same_kind")
        assert dst.tolist() == expected.tolist()


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
        assert set(ring.slot(0)) == {"jpg", "cls", "txt", "txt_len", "__side_len", "__side"}
    finally:
        ring.close()
