"""Datasets mixed by weight: exact counts per source and epoch, no repeat inside a pass, labelled batches, resume."""

import collections
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import ROOT, Sampler, id_samples, id_shards, manifest_ids, wait_for, write_tar
from test_distributed import jpeg_shards, torchrun

from feedline import Source, StagingLoader
from feedline.errors import SettingError
from feedline.loader.plan.epoch_plan import EpochPlan
from feedline.loader.plan.mixture import Mixture, check_sources, mix_epoch, shares
from feedline.loader.plan.rank import Rank

SPEC = {"cls": "int64"}


def _ids(batch):
    return [int(x) for x in batch["cls"].tolist()]


@pytest.fixture
def two(tmp_path):
    """A large source (ids 0..399: 10 shards of 40) and a small one (ids 1000..1049: 2 shards of 25)."""
    id_shards(str(tmp_path / "big"), shards=10, per_shard=40)
    small = [os.path.join(tmp_path, "small", f"s-{k}.tar") for k in range(2)]
    os.makedirs(tmp_path / "small")
    for k, path in enumerate(small):
        write_tar(path, id_samples(1000 + 25 * k, 25))
    return str(tmp_path / "big" / "*.tar"), str(tmp_path / "small" / "*.tar")


def _mix(two, big=0.7, small=0.3):
    return [Source("web", shards=two[0], weight=big), Source("curated", shards=two[1], weight=small)]


def _epoch(loader):
    ids, names = [], []
    for batch in loader:
        ids += _ids(batch)
        names += batch["__source__"]
    return ids, names


# -- the draw, as plain data ---------------------------------------------------------------------

def test_shares_split_one_pass_by_weight_and_add_up_exactly():
    sources = check_sources([Source("a", shards="x", weight=1), Source("b", shards="y", weight=2),
                             Source("c", shards="z", samples=7)])
    assert shares(sources, [100, 1, 5]) == [34, 67, 7]  # 101 samples by 1:2 (largest remainder), and 7 as given


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("epoch", [0, 3])
def test_a_draw_gives_each_source_its_exact_count_with_no_repeat_inside_a_pass(seed, epoch):
    snaps = [[f"b{i}" for i in range(10)], [f"s{i}" for i in range(2)]]
    sizes = {**{f"b{i}": 100 for i in range(10)}, "s0": 20, "s1": 20}
    sources = check_sources([Source("big", shards="x", weight=0.7), Source("small", shards="y", weight=0.3)])
    mix = mix_epoch(sources, snaps, sizes.__getitem__, seed=seed, epoch=epoch)
    assert mix.drawn == (728, 312)  # 1040 samples in all, 70 % / 30 %
    got = collections.Counter()
    per_pass = collections.defaultdict(list)
    for key in mix.order:
        source, pass_, path = Mixture.entry(key)
        n = sizes[path] - len(mix.skip.get(key, ()))
        got[source] += n
        per_pass[(source, pass_)].append(path)
    assert got == {0: 728, 1: 312}
    assert all(len(paths) == len(set(paths)) for paths in per_pass.values())  # a pass reads a shard once
    assert len([p for p in per_pass if p[0] == 1]) == 8  # 312 of 40: 7 whole passes and part of an eighth


def test_the_draw_repeats_with_seed_and_epoch_and_changes_with_either():
    snaps = [[f"b{i}" for i in range(10)], [f"s{i}" for i in range(3)]]
    sources = check_sources([Source("big", shards="x", weight=1), Source("small", shards="y", weight=1)])

    def draw(seed, epoch):
        m = mix_epoch(sources, snaps, lambda p: 30, seed=seed, epoch=epoch)
        return m.order, dict(m.skip)

    assert draw(0, 0) == draw(0, 0)
    assert draw(0, 0) != draw(0, 1) and draw(0, 0) != draw(1, 0)


@pytest.mark.parametrize("sources, says", [
    ([Source("a", shards="x", weight=0)], "every weight is 0"),
    ([Source("a", shards="x"), Source("a", shards="y")], "used twice"),
    ([], "empty"),
    (["data/*.tar"], "feedline.Source"),
])
def test_a_mixture_that_cannot_make_an_epoch_is_refused_naming_sources(sources, says):
    with pytest.raises(SettingError, match=says) as err:
        check_sources(sources)
    assert err.value.setting == "sources"


@pytest.mark.parametrize("kwargs, says", [
    ({"weight": -1}, "weight=-1"),
    ({"weight": float("nan")}, "finite"),
    ({"weight": 1, "samples": 5}, "not both"),
    ({"samples": -3}, "whole number"),
    ({"cache": "c"}, "exactly one of shards= or cache="),
])
def test_a_bad_source_is_refused_naming_sources(kwargs, says):
    with pytest.raises(SettingError, match=says) as err:
        Source("a", shards=None if "cache" in kwargs else "x", **kwargs) if "cache" not in kwargs else \
            Source("a", shards="x", **kwargs)
    assert err.value.setting == "sources"


# -- the loader ----------------------------------------------------------------------------------

def test_each_epoch_draws_every_source_by_weight_and_every_batch_names_its_sources(two):
    with StagingLoader(sources=_mix(two), batch_size=16, workers=2, spec=SPEC, seed=5) as loader:
        for epoch in range(3):
            expected_batches = len(loader)  # counted before the epoch, from the draw
            batches = 0
            ids, names = [], []
            for batch in loader:
                batches += 1
                ids += _ids(batch)
                names += batch["__source__"]
            assert batches == expected_batches
            assert len(ids) == 450 and len(names) == len(ids)  # as long as one pass over both
            assert all((n == "curated") == (i >= 1000) for i, n in zip(ids, names))  # the label is the source
            web = [i for i in ids if i < 1000]
            curated = [i for i in ids if i >= 1000]
            assert len(web) == 315 and len(curated) == 135  # 450 samples: 70 % and 30 %, exactly
            assert len(set(web)) == len(web)  # a subsampled source: no sample twice
            counts = collections.Counter(curated)  # 135 of 50: 2 whole passes and 35 of a third
            assert sorted(collections.Counter(counts.values()).items()) == [(2, 15), (3, 35)]


def test_a_weight_of_zero_leaves_a_source_out_and_samples_fix_a_count(two):
    mix = [Source("web", shards=two[0], weight=1), Source("curated", shards=two[1], weight=0),
           Source("extra", shards=two[1], samples=20)]
    with StagingLoader(sources=mix, batch_size=16, workers=1, spec=SPEC) as loader:
        ids, names = _epoch(loader)
    assert collections.Counter(names) == {"web": 400, "extra": 20}
    assert all(i < 1000 for i, n in zip(ids, names) if n == "web")


def test_the_transform_sees_the_source_name(two):
    with StagingLoader(sources=_mix(two), batch_size=16, workers=1, spec={"cls": "int64", "w": "float32"},
                       transform=_weigh_by_source) as loader:
        seen = collections.Counter()
        for batch in loader:
            for w, name in zip(batch["w"].tolist(), batch["__source__"]):
                assert w == (2.0 if name == "curated" else 1.0)
                seen[name] += 1
    assert seen == {"web": 315, "curated": 135}


def _weigh_by_source(sample):
    sample["w"] = 2.0 if sample["__source__"] == "curated" else 1.0
    return sample


def test_epochs_draw_anew_and_the_same_seed_draws_the_same(two):
    def run(seed):
        with StagingLoader(sources=_mix(two), batch_size=16, workers=2, spec=SPEC, seed=seed) as loader:
            return [_epoch(loader)[0] for _ in range(2)]

    a, b = run(1), run(1)
    assert a == b
    assert sorted(a[0]) != sorted(a[1])  # another subsample of the large source, another part pass of the small


def test_a_mixture_resumes_exactly_from_the_middle_of_an_epoch(two):
    with StagingLoader(sources=_mix(two), batch_size=16, workers=2, spec=SPEC, seed=3) as loader:
        _epoch(loader)
        whole = []
        for k, batch in enumerate(loader):
            whole.append((_ids(batch), batch["__source__"]))
            if k == 8:
                state = json.loads(json.dumps(loader.state_dict()))
    with StagingLoader(sources=_mix(two), batch_size=16, workers=2, spec=SPEC, seed=3) as resumed:
        resumed.load_state_dict(state)
        rest = [(_ids(b), b["__source__"]) for b in resumed]
    assert rest == whole[9:]


def test_a_mixture_resumed_elastically_delivers_the_rest_of_its_draw_once(two):
    with StagingLoader(sources=_mix(two), batch_size=16, workers=2, spec=SPEC, seed=4) as loader:
        everything = collections.Counter(zip(*_epoch(loader)))
        before = collections.Counter()
        for k, batch in enumerate(loader):  # the same draw again? no: epoch 1; compare against epoch 1 below
            before.update(zip(_ids(batch), batch["__source__"]))
            if k == 10:
                state = loader.state_dict()
                break
    with StagingLoader(sources=_mix(two), batch_size=16, workers=2, spec=SPEC, seed=4) as reference:
        reference.set_epoch(1)
        epoch1 = collections.Counter(zip(*_epoch(reference)))
    with StagingLoader(sources=_mix(two), batch_size=16, workers=3, spec=SPEC, seed=4) as resumed:
        resumed.load_state_dict(state, elastic=True)
        after = collections.Counter(zip(*_epoch(resumed)))
    assert before + after == epoch1  # the same proportions, and no sample more often than the draw says
    assert everything != epoch1


def test_a_mixture_state_is_refused_by_a_loader_of_one_source(two):
    with StagingLoader(sources=_mix(two), batch_size=16, workers=1, spec=SPEC) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with StagingLoader(two[0], batch_size=16, workers=1, spec=SPEC) as single:
        with pytest.raises(SettingError, match="sources=") as err:
            single.load_state_dict(state, elastic=True)
    assert err.value.setting == "state"


def test_ranks_split_the_draw_with_nothing_twice_and_nothing_left_out(two):
    from feedline.loader.plan.sources import MixedSource, PathSource

    sources = check_sources(_mix(two))
    src = MixedSource([s.name for s in sources], [PathSource(s.shards) for s in sources])
    shards, mix = src.draw(sources, seed=0, epoch=0, shuffle=True)
    plans = [EpochPlan.make(shards, epoch=0, seed=0, rank=Rank(r, 2), workers=2, mixture=mix) for r in (0, 1)]
    entries = [e for p in plans for a in p.assignment for e in a]
    assert sorted(entries) == sorted(mix.order)
    labels = {lab for p in plans for w in range(2) for lab in p.for_worker(w).labels}
    assert labels == {"web", "curated"}


def test_a_mixture_reads_two_sidecar_caches(tmp_path, remote):
    """One sidecar per source today (a mixing sidecar is still to come): each fills its own cache."""
    caches = {"web": str(tmp_path / "web"), "curated": str(tmp_path / "curated")}
    parts = {"web": "ids-{0000..0005}.tar", "curated": "ids-{0006..0007}.tar"}
    samplers = [Sampler(remote, caches[n], "--policy", "fill", "--budget", "64MiB", source=f"{remote.url}/{parts[n]}")
                for n in caches]
    try:
        assert wait_for(lambda: len(manifest_ids(caches["web"])) == 6 and len(manifest_ids(caches["curated"])) == 2)
        mix = [Source("web", cache=caches["web"], weight=1), Source("curated", cache=caches["curated"], samples=60)]
        with StagingLoader(sources=mix, batch_size=10, workers=2, spec=SPEC) as loader:
            ids, names = _epoch(loader)
    finally:
        for sampler in samplers:
            sampler.stop()
    assert collections.Counter(names) == {"web": 120, "curated": 60}  # the samples: 60 of 40, so a repeat
    assert {i // 20 for i, n in zip(ids, names) if n == "curated"} == {6, 7}
    assert sorted(i for i, n in zip(ids, names) if n == "web") == list(range(120))


TWO_RANKS = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from feedline import Source, StagingLoader
    dist.init_process_group("gloo")
    try:
        mix = [Source("web", shards=sys.argv[1], weight=0.7), Source("curated", shards=sys.argv[2], weight=0.3)]
        with StagingLoader(sources=mix, batch_size=8, workers=1, spec={"cls": "int64"}, equal_batches="pad") as loader:
            out = []
            for batch in loader:
                out.append([batch["cls"].tolist(), batch["__source__"]])
                dist.all_reduce(torch.ones(1))
            sys.stdout.write("RESULT " + json.dumps(out) + "\\n")
    finally:
        dist.destroy_process_group()
""")


def test_two_ranks_read_a_mixture_with_equal_batches(tmp_path, two):
    script = tmp_path / "mix.py"
    script.write_text(TWO_RANKS)
    run = torchrun(str(script), two[0], two[1], env={"PYTHONPATH": ROOT}, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in run.stdout.splitlines() if "RESULT " in line]
    assert len(results) == 2 and len(results[0]) == len(results[1])  # equal batches: no rank waits for another
    drawn = [(i, n) for r in results for ids, ns in r for i, n in zip(ids, ns)]
    assert all((n == "curated") == (i >= 1000) for i, n in drawn)
    # the ranks together deliver the draw (pad repeats a few of it to even them out): 315 distinct web samples,
    # and every curated sample (135 draws of 50)
    assert len({i for i, n in drawn if n == "web"}) == 315
    assert {i for i, n in drawn if n == "curated"} == set(range(1000, 1050))
    assert len(drawn) >= 450


# -- the face: feedline train --mix / FEEDLINE_MIX ------------------------------------------------

TRAIN = [sys.executable, "-m", "feedline", "train", "--batch-size", "4", "--image-size", "16", "--workers", "1",
         "--progress", "false", "--metrics-port", "0"]


def test_feedline_train_mixes_and_its_summary_counts_samples_per_source_per_epoch(tmp_path):
    a = jpeg_shards(str(tmp_path / "a"), [12, 12, 12])
    b = jpeg_shards(str(tmp_path / "b"), [8])
    summary = tmp_path / "s.json"
    run = subprocess.run([*TRAIN, "--mix", f"photos={a}@3 rare={b}@1", "--epochs", "2", "--summary-json",
                          str(summary)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "per source" in run.stdout + run.stderr  # the table's column
    doc = json.loads(summary.read_text())
    assert [e["sources"] for e in doc["epochs"]] == [{"photos": 33, "rare": 11}] * 2  # 44 samples, 3:1
    from feedline.report.page import _epochs

    assert "samples per source" in _epochs(doc) and "photos 33, rare 11" in _epochs(doc)


@pytest.mark.parametrize("values, env, says", [
    ({"mix": "photos=data/*.tar@-1"}, {}, "weight=-1.0"),
    ({"mix": "photos=data/*.tar@0"}, {}, "every weight is 0"),
    ({"mix": "photos="}, {}, "is not NAME=WHERE"),
    ({}, {"FEEDLINE_MIX": "a=x@1 a=y@2"}, "used twice"),
    ({"shards": "data/*.tar"}, {"FEEDLINE_MIX": "a=x@1"}, "mix is set with shards"),
    ({"mix": "web@1 rare@2"}, {}, "names no data"),
    ({"mix": "web=data/*.tar@1", "cache": "c"}, {}, "with cache set, name the parts"),
])
def test_a_bad_mix_is_refused_at_start_up_naming_the_setting(values, env, says):
    from feedline.api.config import Config, ConfigError

    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        Config.load(values, env=env)
    assert str(err.value).startswith("mix")


def test_feedline_train_refuses_a_bad_mix_with_the_setting_named_and_exit_2():
    run = subprocess.run([*TRAIN, "--mix", "photos=data/*.tar@-1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2
    assert "mix (FEEDLINE_MIX / --mix)" in run.stderr and "a weight is a finite number >= 0" in run.stderr


# -- the sidecar mixes: one cache, a part per source, the budget by weight -----------------------

def test_a_plain_source_is_not_a_mixture_and_a_named_list_is():
    from feedline.sampler.mixed import MixSource, mixture_of

    for plain in ("https://store/x-{0000..0009}.tar", "s3://bucket/prefix/", "data/*.tar",
                  "https://s/x.tar?X-Amz-Signature=ab&X-Amz-Date=1"):
        assert mixture_of(plain) is None
    assert mixture_of("web=https://u@store/w-{0..9}.tar@0.7 cur=s3://b/c/@512MiB  x=data/*.tar") == [
        MixSource("web", "https://u@store/w-{0..9}.tar", weight=0.7), MixSource("cur", "s3://b/c/", budget=512 << 20),
        MixSource("x", "data/*.tar", weight=1.0)]


@pytest.mark.parametrize("source, says", [
    ("a=x.tar@-1 b=y.tar", "a number >= 0"),
    ("a=x.tar@0 b=y.tar@0", "every weight is 0"),
    ("a=x.tar b=y.tar a=z.tar", "used twice"),
    ("a=x.tar b", "is not NAME=SOURCE"),
])
def test_a_bad_sidecar_mixture_is_refused_naming_source(source, says):
    from feedline.sampler.mixed import mixture_of

    with pytest.raises(SettingError, match=says) as err:
        mixture_of(source)
    assert err.value.setting == "source"


def test_the_budget_is_split_by_weight_after_the_sources_with_their_own():
    from feedline.sampler.mixed import MixSource, budgets

    assert budgets(1000, [MixSource("a", "x", weight=3), MixSource("b", "y", weight=1),
                          MixSource("c", "z", budget=200)]) == [600, 200, 200]
    with pytest.raises(SettingError, match="leaves nothing") as err:
        budgets(100, [MixSource("a", "x", weight=1), MixSource("b", "y", budget=100)])
    assert err.value.setting == "budget"


def test_a_sidecar_fills_two_sources_from_two_stores_into_one_mixed_cache_a_loader_mixes(tmp_path):
    from feedline.cache.mix import read_mix
    from feedline.demo.store import FileStore

    id_shards(str(tmp_path / "a"), shards=8, per_shard=20, payload=2048)  # ids 0..159
    os.makedirs(tmp_path / "b")
    for k in range(4):  # ids 1000..1079
        write_tar(str(tmp_path / "b" / f"ids-{k:04d}.tar"), id_samples(1000 + 20 * k, 20, 2048))
    shard = os.path.getsize(tmp_path / "a" / "ids-0000.tar")
    cache = str(tmp_path / "cache")
    with FileStore(str(tmp_path / "a")) as web, FileStore(str(tmp_path / "b")) as rare:
        source = f"web={web.url}/ids-{{0000..0007}}.tar@3 rare={rare.url}/ids-{{0000..0003}}.tar@1"
        sampler = Sampler(web, cache, "--policy", "fill", "--budget", str(8 * shard + 100), source=source)
        try:
            sampler.wait_ready()
            assert wait_for(lambda: len(manifest_ids(os.path.join(cache, "web"))) == 6
                            and len(manifest_ids(os.path.join(cache, "rare"))) == 2)  # 3/4 and 1/4 of 8 shards
            # the gauges follow the manifests a moment later (the sidecar's loop sets them)
            assert wait_for(lambda: sampler.metric("feedline_cache_shards", source="web") == 6
                            and sampler.metric("feedline_cache_shards", source="rare") == 2)
            assert sampler.metric("feedline_cache_budget_bytes", source="rare") == (8 * shard + 100) // 4
            assert [(p.name, p.weight) for p in read_mix(cache)] == [("web", 0.75), ("rare", 0.25)]
            with StagingLoader(cache=cache, batch_size=10, workers=2, spec=SPEC) as loader:
                ids, names = _epoch(loader)
            env = {"FEEDLINE_CACHE": cache, "FEEDLINE_MIX": "web@1 rare@1"}
            with StagingLoader.from_env(env=env, batch_size=10, workers=1, spec=SPEC, metrics_port=None) as loader:
                reweighed = _epoch(loader)[1]
        finally:
            out = sampler.stop()
    assert sampler.proc.returncode == 0, out[-3000:]
    assert collections.Counter(names) == {"web": 120, "rare": 40}  # 160 samples cached, drawn 3:1
    assert all((n == "rare") == (i >= 1000) for i, n in zip(ids, names))
    assert collections.Counter(reweighed) == {"web": 80, "rare": 80}  # FEEDLINE_MIX weighs the parts anew
    with pytest.raises(ValueError, match=r"\['news'\] is not a source of the cache .* it holds \['web', 'rare'\]"):
        StagingLoader.from_env(env={"FEEDLINE_CACHE": cache, "FEEDLINE_MIX": "web@1 news@1"}, metrics_port=None)


def test_the_mixed_sidecars_metrics_pass_promtool(tmp_path):
    from prometheus_client import generate_latest

    from feedline.metrics.catalog import SAMPLER
    from feedline.metrics.sink import PrometheusSink

    sink = PrometheusSink(SAMPLER, parts=("source", "web", "rare"))
    sink.inc("fetch_errors_total", source="rare", reason="timeout")
    sink.observe("fetch_seconds", 0.5, source="web")
    text = generate_latest(sink.registry).decode()
    assert 'feedline_fetch_errors_total{reason="timeout",source="rare"} 1.0' in text
    assert text.count("feedline_build_info{") == 1
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_small_source_of_a_mixed_cache_cached_whole_does_not_hold_the_loader_at_min_shards(tmp_path):
    from feedline.demo.store import FileStore

    id_shards(str(tmp_path / "a"), shards=6, per_shard=20, payload=2048)
    os.makedirs(tmp_path / "b")
    write_tar(str(tmp_path / "b" / "ids-0000.tar"), id_samples(1000, 20, 2048))  # a curated source of one shard
    shard = os.path.getsize(tmp_path / "a" / "ids-0000.tar")
    cache = str(tmp_path / "cache")
    with FileStore(str(tmp_path / "a")) as web, FileStore(str(tmp_path / "b")) as rare:
        source = f"web={web.url}/ids-{{0000..0005}}.tar@4 rare={rare.url}/ids-0000.tar@1"  # 8 and 2 shards' room
        sampler = Sampler(web, cache, "--policy", "fill", "--budget", str(10 * shard + 100), "--min-shards", "3",
                          source=source)
        try:
            sampler.wait_ready()
            t0 = time.monotonic()
            with StagingLoader(cache=cache, batch_size=10, workers=1, spec=SPEC, min_shards=3,
                               wait_timeout=30) as loader:
                ids, names = _epoch(loader)
            waited = time.monotonic() - t0
        finally:
            out = sampler.stop()
    assert sampler.proc.returncode == 0, out[-3000:]
    assert waited < 15 and "rare" in names


# -- one grammar, one parser: the loader's mix and the sidecar's --source ----------------------------

def test_one_parser_reads_both_sides_items_and_each_side_refuses_the_others_share():
    from feedline.cache.mix_items import MixItem, parse_items
    from feedline.api.mixing import MixError, parse_mix
    from feedline.sampler.mixed import mixture_of

    assert parse_items("web=https://u@s/w-{0..9}.tar@0.7;cur=s3://b/c/@512MiB eval=data/e/*.tar#50 rare@2") == [
        MixItem("web=https://u@s/w-{0..9}.tar@0.7", "web", "https://u@s/w-{0..9}.tar", weight=0.7),
        MixItem("cur=s3://b/c/@512MiB", "cur", "s3://b/c/", budget=512 << 20),
        MixItem("eval=data/e/*.tar#50", "eval", "data/e/*.tar", samples=50),
        MixItem("rare@2", "rare", None, weight=2.0)]
    with pytest.raises(MixError, match=r"'cur=data/c/\*.tar@512MiB': a budget \(@SIZE\) is the sidecar's"):
        parse_mix("web=data/w/*.tar@1 cur=data/c/*.tar@512MiB")
    with pytest.raises(SettingError, match=r"'eval=s3://b/e/#50': samples an epoch \(#N\) are the loader's"):
        mixture_of("web=s3://b/w/@1 eval=s3://b/e/#50")
    for parse in (parse_mix, mixture_of):
        with pytest.raises(ValueError, match=r"the name\(s\) \['a'\] are used twice"):
            parse("a=x.tar@1 a=y.tar@1")
