"""Real datasets drop in: shards made by the webdataset library, read with the same field meanings."""

import json

import pytest
import torch
from helpers import wds_shards, write_tar

from feedline import SettingError, StagingLoader
from feedline.formats.transforms import RandomResizedCrop

CROP = RandomResizedCrop(32, fields=["jpg"])


def rows(loader):
    """(key, cls, caption, metadata, raw member) of every sample of one epoch."""
    out = []
    for b in loader:
        assert b["jpg"].shape[1:] == (32, 32, 3) and b["cls"].dtype == torch.int64
        for k, c, t, j, d in zip(b["__key__"], b["cls"].tolist(), b["txt"], b["json"], b["dat"]):
            out.append((k, c, t, json.dumps(j, sort_keys=True), d))
    return sorted(out)


def webdataset_rows(urls):
    """The same, as webdataset's own pipeline decodes it."""
    import webdataset as wds

    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode()
    return sorted((s["__key__"], s["cls"], s["txt"], json.dumps(s["json"], sort_keys=True), s["dat"]) for s in ds)


def test_a_webdataset_dataset_loads_without_a_spec_with_webdatasets_field_meanings(tmp_path):
    urls = wds_shards(str(tmp_path / "wds"))
    with StagingLoader(urls, batch_size=8, workers=2, transform=CROP) as loader:
        first, second = rows(loader), rows(loader)
        batch = next(iter(loader))
    assert first == second == webdataset_rows(urls)  # every sample exactly once per epoch, same values
    assert len(first) == 48
    assert isinstance(batch["txt"][0], str) and isinstance(batch["json"][0], dict)
    assert isinstance(batch["dat"][0], bytes) and isinstance(batch["__key__"][0], str)


def test_compressed_shards_read_as_the_plain_ones_and_are_decompressed_once(tmp_path):
    plain = wds_shards(str(tmp_path / "plain"))
    gz = wds_shards(str(tmp_path / "gz"), suffix="tar.gz")
    inflated = tmp_path / "inflated"
    with StagingLoader(gz, batch_size=8, workers=2, transform=CROP, decompress_dir=str(inflated)) as loader:
        got = rows(loader)
    copies = sorted(p.name for p in inflated.iterdir())
    assert got == webdataset_rows(plain)
    assert len([c for c in copies if c.endswith(".tar")]) == 4 and len([c for c in copies if c.endswith(".idx")]) == 4
    mtimes = [p.stat().st_mtime_ns for p in inflated.iterdir()]
    with StagingLoader(gz, batch_size=8, workers=2, transform=CROP, decompress_dir=str(inflated)) as loader:
        assert rows(loader) == got
    assert [p.stat().st_mtime_ns for p in inflated.iterdir()] == mtimes  # reused, not decompressed again


def test_fields_select_and_rename_members_and_skip_the_rest(tmp_path):
    urls = wds_shards(str(tmp_path / "wds"), extra={i: {"pyd": b"\x80\x04K\x01."} for i in range(48)})
    with StagingLoader(urls, batch_size=8, workers=2, fields={"image": "png;jpg", "label": "cls"},
                       transform=RandomResizedCrop(32, fields=["image"])) as loader:
        batches = list(loader)
    assert set(batches[0]) == {"image", "label", "__key__"}
    assert sum(len(b["label"]) for b in batches) == 48


def test_a_missing_selected_field_is_skipped_and_counted_with_the_field_named(tmp_path, capfd):
    samples = [(f"k{i}", {"cls": str(i).encode(), **({"txt": b"x"} if i != 3 else {})}) for i in range(8)]
    path = write_tar(str(tmp_path / "s.tar"), samples)
    with StagingLoader(path, batch_size=4, workers=1, fields=["cls", "txt"], max_sample_errors=2) as loader:
        keys = [k for b in loader for k in b["__key__"]]
        errors = loader.stats().sample_errors_total
    assert sorted(keys) == [f"k{i}" for i in range(8) if i != 3]
    assert errors["missing_field"] == 1
    assert "sample 'k3': has no member .txt for field 'txt'" in capfd.readouterr().err  # the worker's log


def test_a_pickle_member_is_refused_at_construction_naming_the_safety_reason(tmp_path):
    urls = wds_shards(str(tmp_path / "wds"), extra={i: {"pickle": b"\x80\x04K\x01."} for i in range(48)})
    with pytest.raises(SettingError, match="runs code from the data.*fields="):
        StagingLoader(urls, batch_size=8, workers=1, transform=CROP)


def test_a_caption_over_the_side_budget_is_refused_at_start_naming_the_setting(tmp_path):
    urls = wds_shards(str(tmp_path / "wds"), extra={0: {"txt": "x" * 100_000}})
    with pytest.raises(SettingError, match=r"side_bytes.*'000000'.*txt 100000"):
        StagingLoader(urls, batch_size=8, workers=1, transform=CROP)
    with StagingLoader(urls, batch_size=8, workers=1, transform=CROP, side_bytes=200_000) as loader:
        assert len(rows(loader)) == 48


def test_a_later_caption_over_the_side_budget_is_skipped_naming_field_shard_and_key(tmp_path, capfd):
    urls = wds_shards(str(tmp_path / "wds"), extra={47: {"txt": "x" * 100_000}})  # not among the probed samples
    with StagingLoader(urls, batch_size=8, workers=2, transform=CROP) as loader:
        got = rows(loader)
        errors = loader.stats().sample_errors_total
    assert len(got) == 47 and errors["too_large"] == 1
    msg = [line for line in capfd.readouterr().err.splitlines() if "side_bytes" in line]
    assert msg and "shard-000003.tar sample '000047': field 'txt'" in msg[0]


def test_images_of_varying_size_without_a_resize_are_refused_at_construction(tmp_path):
    urls = wds_shards(str(tmp_path / "wds"))
    with pytest.raises(SettingError, match="different sizes.*RandomResizedCrop"):
        StagingLoader(urls, batch_size=8, workers=1)


def test_shards_take_brace_lists_file_urls_and_double_colon_lists(tmp_path):
    wds_shards(str(tmp_path / "a"), shards=2)
    wds_shards(str(tmp_path / "b"), shards=2)
    spec = f"file://{tmp_path}/a/shard-{{000000..000001}}.tar::{tmp_path}/b/shard-00000{{0,1}}.tar"
    with StagingLoader(spec, batch_size=8, workers=2, transform=CROP) as loader:
        assert len(rows(loader)) == 48


def test_a_remote_url_the_loaders_sidecar_cannot_reach_is_refused_naming_why():
    with pytest.raises(SettingError, match="sidecar started for https://store.invalid/.* is unreachable"):
        StagingLoader("https://store.invalid/shard-{000000..000009}.tar")  # a URL: fetched by a sidecar of its own


@pytest.mark.parametrize("name, hint", [("num_workers", "workers="), ("pin_memory", "device='cuda'"),
                                        ("collate_fn", "spec= and transform="), ("timeout", "worker_timeout=")])
def test_dataloader_keywords_are_refused_naming_the_feedline_equivalent(tmp_path, name, hint):
    with pytest.raises(TypeError, match=f"DataLoader's keyword argument '{name}'.*{hint}"):
        StagingLoader(str(tmp_path / "x.tar"), **{name: 2})


def test_a_misspelt_keyword_is_refused_with_the_nearest_name(tmp_path):
    with pytest.raises(TypeError, match="did you mean workers="):
        StagingLoader(str(tmp_path / "x.tar"), workrs=2)


def test_zstd_shards_read_as_the_plain_ones(tmp_path):
    import zstandard

    plain = wds_shards(str(tmp_path / "plain"), shards=2)
    (tmp_path / "zst").mkdir()
    for k in range(2):
        data = (tmp_path / "plain" / f"shard-{k:06d}.tar").read_bytes()
        (tmp_path / "zst" / f"shard-{k:06d}.tar.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    with StagingLoader(str(tmp_path / "zst"), batch_size=8, workers=2, transform=CROP,
                       decompress_dir=str(tmp_path / "inflated")) as loader:
        assert rows(loader) == webdataset_rows(plain)


def test_a_broken_compressed_shard_is_skipped_and_counted_and_the_rest_load(tmp_path):
    wds_shards(str(tmp_path / "gz"), suffix="tar.gz")
    broken = tmp_path / "gz" / "shard-000001.tar.gz"
    broken.write_bytes(broken.read_bytes()[:2000])  # a cut download
    with StagingLoader(str(tmp_path / "gz" / "*.tar.gz"), batch_size=8, workers=2, transform=CROP,
                       decompress_dir=str(tmp_path / "inflated"), max_sample_errors=1) as loader:
        got = rows(loader)
        errors = loader.stats().sample_errors_total
    assert len(got) == 36 and errors["bad_shard"] == 1


def test_a_rejected_sample_leaves_the_next_ones_keys_and_captions_in_place(tmp_path):
    samples = [(f"k{i:02d}", {"bin": bytes(16 if i != 2 else 99), "txt": f"caption {i}".encode()}) for i in range(8)]
    path = write_tar(str(tmp_path / "s.tar"), samples)
    spec = {"bin": ("uint8", (16,)), "txt": "text"}
    with StagingLoader(path, batch_size=4, workers=1, spec=spec, shuffle=False, max_sample_errors=1) as loader:
        got = [(k, t) for b in loader for k, t in zip(b["__key__"], b["txt"])]
    assert got == [(f"k{i:02d}", f"caption {i}") for i in range(8) if i != 2]
