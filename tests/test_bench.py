"""The benchmark runs end to end (tiny sizes: this checks it works, not how fast anything is)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from feedline.bench.report import SHARD_ORDER, STREAM_ORDER
from feedline.bench.small import PACED, STANDIN
from feedline.bench.video_bench import SWSCALE_ROW

# heavy: scripts/test runs these beside the soak (tests/conftest.py); under pytest-xdist, in one worker: they make
# the benchmark's datasets in .cache/bench, once each, and would otherwise make the same one at once
pytestmark = [pytest.mark.beside_soak, pytest.mark.xdist_group("bench-cache")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_compares_every_contender_and_writes_json_and_markdown(tmp_path):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    run = subprocess.run(
        [sys.executable, "-m", "feedline", "bench", "--quick", "--seconds", "0.5", "--workers", "1", "--raw-samples", "48",
         "--jpeg-samples", "48", "--sample-size", "64KiB", "--json", str(out_json), "--markdown", str(out_md),
         # the distributed workload is scripts/two-nodes twice, which tests/test_distributed.py runs already
         "--workloads", "raw,jpeg,captioned,scaling,sampler",
         "--host", "test-host", "--peers", "off", "--fast-peers", "off"],  # the peers' rows: tests/test_peers.py, tests/test_fast_peers.py
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out_json.read_text())["test-host"]
    assert set(doc["workloads"]["raw"]) == {"feedline (zero-copy)", "feedline (copy)", "DataLoader",
                                            "webdataset + DataLoader", SHARD_ORDER, STREAM_ORDER}
    jpeg = doc["workloads"]["jpeg"]
    assert jpeg["DataLoader + stock Pillow"]["pil"] != jpeg["feedline (zero-copy)"]["pil"]  # the real baseline
    assert all(row["samples_per_s"] > 0 for rows in doc["workloads"].values() for row in rows.values())
    assert set(doc["workloads"]["captioned"]) == {"feedline (zero-copy)", "feedline (copy)", "webdataset + DataLoader",
                                                  "DataLoader + hand-written collate"}
    assert len(doc["targets"]) == 20  # every target but the distributed row
    workers_cpu = next(t for t in doc["targets"] if t["target"].startswith("JPEG: where the rest of workers"))
    assert "per CPU-second a worker decodes >= 95 %" in workers_cpu["target"]  # its rate on the cores it had (68)
    assert "% of 1 cores" in workers_cpu["value"]
    assert sum(t["target"].endswith("(the rows before it)") for t in doc["targets"]) == 2  # issue 50, raw and JPEG
    assert jpeg["feedline (two-source mix)"]["samples_per_s"] > 0  # the mixture's row (issue 25)
    assert any(t["target"].startswith("JPEG: a two-source mixture") for t in doc["targets"])
    assert jpeg["1 core, crop decoder"]["crop_decoder"] and not jpeg["1 core, draft"]["crop_decoder"]  # issue 35
    scaling = doc["scaling"]
    assert scaling["workers"][0] == 1 and all(f"{w} workers" in scaling["rows"] for w in scaling["workers"])
    assert doc["settings"]["quick"] and doc["settings"]["rounds"] == 1
    fill = doc["sampler"]["fill"]
    assert fill["sampler_gb_per_s"] > 0 and fill["curl_gb_per_s"] > 0 and fill["urllib_gb_per_s"] > 0
    assert fill["ratios"]["urllib"][0] == fill["sampler_gb_per_s"] / fill["urllib_gb_per_s"]  # one round: its ratio
    to_urllib = next(t for t in doc["targets"] if t["target"].startswith("sampler: fill >= the standard library's"))
    assert to_urllib["met"] == (fill["ratios"]["urllib"][0] >= 1.0)
    s3 = doc["sampler"]["s3"]
    assert s3["sampler_mb_per_s"] > 0 and s3["boto3_mb_per_s"] > 0
    for cloud, sdk in (("gcs", "google-cloud-storage"), ("azure", "azure-storage-blob")):  # issue 51's rows
        assert doc["sampler"][cloud]["sdk"] == sdk and doc["sampler"][cloud]["sampler_mb_per_s"] > 0
        # measured (from /proc/stat's 10 ms ticks: a --quick download shorter than a few of them can read 0 busy)
        assert 0 <= doc["sampler"][cloud]["machine_cores"]["sdk"] <= doc["sampler"][cloud]["cores"] + 0.5
    training = doc["sampler"]["training"]
    assert training["prefilled"]["samples_per_s"] > 0 and training["filling"]["samples_per_s"] > 0
    assert all(len(row["rounds"]) == 1 for rows in doc["workloads"].values() for row in rows.values())
    md = out_md.read_text()
    assert "### JPEG decode scaling" in md
    assert "| feedline (zero-copy) |" in md and "### Targets" in md


def test_the_training_process_share_is_measured_per_batch_and_in_a_launch_bound_step(tmp_path):
    """Issue 60's rows: the training process's CPU a batch of 3x64x64 samples for each loader and each way the
    device path runs (on the stand-in here), and a launch-bound step's time fed against a fixed batch."""
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    run = subprocess.run(
        [sys.executable, "-m", "feedline", "bench", "--quick", "--seconds", "0.5", "--workers", "1",
         "--small-samples", "1200", "--video-samples", "8", "--json", str(out_json), "--markdown", str(out_md),
         "--workloads", "small,launch,video",
         "--host", "test-host"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out_json.read_text())["test-host"]
    small = doc["workloads"]["small"]
    assert {"feedline (zero-copy)", STANDIN, "DataLoader", *PACED.values()} <= set(small) and len(small) == 8
    assert all(0 < row["trainer_ms_per_batch"] < 50 for row in small.values())
    launch = doc["launch"]
    assert launch["ops"] >= 8 and len(launch["rows"]) == 5
    for row in launch["rows"].values():
        assert row["step_ms"] > 0 and row["fixed_step_ms"] > 0 and row["speed"] > 0
    assert all("trainer_ms_per_batch" in row for name, row in launch["rows"].items() if name.startswith("feedline"))
    targets = [t["target"] for t in doc["targets"]]
    assert any("<= 0.15 ms" in t for t in targets) and any("stand-in device <= 0.25 ms" in t for t in targets)
    paced = [t for t in doc["targets"] if "a paced step" in t["target"]]  # issue 68: 250 and 30 steps/s, and a + b
    assert len(paced) == 3 and "ms a batch +" in paced[2]["value"] and "ms a second" in paced[2]["value"]
    assert small[PACED[30]]["samples_per_s"] < 32 * 31  # paced: 30 steps/s at most
    video = doc["workloads"]["video"]  # issue 61: clips against DataLoader and webdataset, one core, memory
    assert {"feedline (zero-copy)", "DataLoader (PyAV in __getitem__)", "1 core, VideoClip"} <= set(video)
    assert all(row["samples_per_s"] > 0 for row in video.values())
    assert video["feedline (zero-copy)"]["worker_rss_mb"] > 0
    assert any(t.startswith("video: >= 1.5x DataLoader") for t in targets)
    assert video[SWSCALE_ROW]["samples_per_s"] > 0 and any(t.startswith(f"video: >= 1.3x {SWSCALE_ROW}")
                                                           for t in targets)  # issue 68: the competent DataLoader
    md = out_md.read_text()
    assert "training process CPU a batch" in md and "a launch-bound step" in md and "### Video" in md


def test_the_end_to_end_row_trains_a_model_fed_three_ways(tmp_path):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    run = subprocess.run(
        [sys.executable, "-m", "feedline", "bench", "--quick", "--workers", "1", "--jpeg-samples", "48",
         "--sample-size", "64KiB", "--json", str(out_json), "--markdown", str(out_md), "--workloads", "e2e",
         "--e2e-model", "tiny", "--e2e-batch-size", "8", "--host", "test-host"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    e2e = json.loads(out_json.read_text())["test-host"]["e2e"]
    assert set(e2e["rows"]) == {"synthetic, on the device (the ceiling)", "feedline", "DataLoader + pillow-simd"}
    for row in e2e["rows"].values():
        assert row["samples_per_s"] > 0 and 0 <= row["starvation"] <= 1 and row["steps"] == 3
    assert e2e["rows"]["synthetic, on the device (the ceiling)"]["starvation"] < 0.5
    assert "### End to end: a tiny training step" in out_md.read_text()


def test_the_placement_rows_beside_run_the_loader_at_full_tilt_while_the_step_never_waits():
    from feedline.bench.contend import _dataset

    shards = os.path.join(_dataset("jpeg", 48, 64 << 10, os.path.join(ROOT, ".cache")), "*.tar")
    rows = {}
    for row in ("beside", "fed"):
        run = subprocess.run([sys.executable, "-m", "feedline.bench.placement_bench", row, "--shards", shards,
                              "--ops", "64", "--seconds", "1", "--warmup-steps", "2", "--workers", "1"],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        rows[row] = json.loads(run.stdout.strip().splitlines()[-1])
    beside, fed = rows["beside"], rows["fed"]
    assert beside["batches_beside"] >= 1 and beside["wait_share"] == 0.0  # the loader ran; the step never waited
    assert "batches_beside" not in fed and fed["wait_share"] > 0  # fed: a batch before each step, and a wait
    assert beside["workers"] == fed["workers"] == 1 and beside["steps"] > 0 and fed["steps"] > 0
    # the training process's CPU the loader took while the step ran: its threads, and the stand-in's copies
    assert 0 < beside["standin_copy_share"] < 1 and 0 < beside["loader_cpu_share"] < 1, beside


def test_the_placement_target_judges_the_defaults_beside_the_loader_at_full_tilt_and_shows_the_fed_wait():
    from feedline.bench.placement_section import ALONE, FED, PLACED, markdown_lines, placement_targets

    def row(ms, wait=0.0):
        return {"step_ms": ms, "samples_per_s": 32e3 / ms, "wait_share": wait, "workers": 1, "placement": "p",
                "rounds": [{"samples_per_s": 32e3 / ms}]}

    section = {"ops": 1000, "batch_size": 32, "rows": {ALONE: row(8.0), PLACED: row(8.2), FED: row(10.0, 0.7)}}
    section["rows"][PLACED].update(loader_cpu_share=0.015, standin_copy_share=0.04)
    targets = {t["target"]: t for t in placement_targets(section)}
    judged = [t for t in targets.values() if t["met"] is not None]
    assert len(judged) == 1 and "at full tilt" in judged[0]["target"] and judged[0]["met"]  # 8.0 / 8.2 = 0.98
    assert targets[f"placement: the step {FED} vs alone (a row)"]["met"] is None  # shown, not judged
    table = "\n".join(markdown_lines(section))
    assert f"| {FED} | 10.00 (10.00-10.00) | 0.80x" in table and "| 70% |" in table
    assert f"| {PLACED} | 8.20 (8.20-8.20) | 0.98x | 0% | 1.5% | 4.0% |" in table


def test_rounds_interleave_in_a_rotating_order_after_a_warm_up_and_report_medians_and_ranges():
    from feedline.bench.rounds import Contender, interleaved, ratio

    calls = []

    def runner(name, rates):
        it = iter(rates)

        def run(seconds):
            calls.append((name, seconds))
            return {"samples_per_s": next(it), "mb_per_s": 1.0, "main_cpu_pct": 5.0, "pil": "x"}
        return run

    a = Contender("a", runner("a", [999, 10, 30, 20]))
    b = Contender("b", runner("b", [999, 5, 10, 20]), seconds=2.0)
    rows = interleaved([a, b], rounds=3, seconds=4.0, warmup=1.0)
    # warm-up a, b; round 0: a, b; round 1: b, a (rotated); round 2: a, b
    assert [n for n, _ in calls] == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert calls[:2] == [("a", 1.0), ("b", 1.0)] and ("b", 2.0) in calls  # warm-up, then each its own time
    assert rows["a"]["samples_per_s"] == 20 and rows["a"]["range"]["samples_per_s"] == [10, 30]
    assert [r["samples_per_s"] for r in rows["a"]["rounds"]] == [10, 30, 20]  # the warm-up is not kept
    med, lo, hi = ratio(rows["a"], rows["b"])  # per round: 10/5, 30/10, 20/20
    assert (med, lo, hi) == (2.0, 1.0, 3.0)


def test_the_fill_is_compared_round_by_round_not_median_to_median():
    from feedline.bench.sampler_bench import per_round_ratio

    sidecar, urllib = [1.0, 2.0, 3.0], [3.0, 1.0, 2.0]  # a slow spell hit urllib's round 1 and the sidecar's round 0
    assert per_round_ratio(sidecar, urllib) == [1.5, 1 / 3, 2.0]  # medians alone would say 2.0 / 2.0 = 1.0


def test_a_workers_rate_per_cpu_second_pairs_each_rounds_rate_cpu_and_one_core_rate():
    from feedline.bench.targets import fmt_share, per_cpu_share

    # round 1 is a slow spell for both rows: its rate and the one-core rate fall together
    rounds = [{"samples_per_s": 200.0, "workers_cpu_pct": 200.0}, {"samples_per_s": 150.0, "workers_cpu_pct": 180.0},
              {"samples_per_s": 210.0, "workers_cpu_pct": 200.0}]
    row = {"samples_per_s": 200.0, "workers_cpu_pct": 200.0, "rounds": rounds}
    single = {"samples_per_s": 100.0, "rounds": [{"samples_per_s": 100.0}, {"samples_per_s": 80.0},
                                                 {"samples_per_s": 105.0}]}
    med, lo, hi = per_cpu_share(row, single)
    assert (med, lo, hi) == (1.0, 1.0, 150 / 1.8 / 80)  # medians alone would pair round 1's CPU with others' rates
    assert fmt_share((med, lo, hi)) == "100 % (100-104)"
    one = {"samples_per_s": 190.0, "workers_cpu_pct": 200.0}  # --quick: one round, no rounds kept
    assert per_cpu_share(one, {"samples_per_s": 100.0}) == (0.95, 0.95, 0.95)
    assert fmt_share(per_cpu_share(one, {"samples_per_s": 100.0})) == "95 %"


def test_rotated_puts_each_contender_first_in_turn():
    from feedline.bench.rounds import rotated

    firsts = [rotated(["sidecar", "curl", "urllib"], r)[0] for r in range(4)]
    assert firsts == ["sidecar", "curl", "urllib", "sidecar"]
    assert sorted(rotated(["sidecar", "curl", "urllib"], 2)) == ["curl", "sidecar", "urllib"]


def test_a_run_of_some_workloads_keeps_the_hosts_other_sections_dated_and_checks_the_targets_over_all():
    from feedline.bench.sections import keep_earlier_sections

    def row(rate):
        return {"samples_per_s": rate, "mb_per_s": rate, "main_cpu_pct": 5.0}

    settings = {"workers": 2, "batch_size": 32, "seconds": 4.0, "rounds": 5, "quick": False}
    raw = {"feedline (zero-copy)": row(600), "feedline (copy)": row(600), "DataLoader": row(100)}
    dist = {"1x4": {"samples_per_s": 100}, "2x2": {"samples_per_s": 110}}
    earlier = {"when": "09:33", "settings": settings, "workloads": {"raw": raw, "captioned": {}},
               "distributed": dist, "targets": []}
    jpeg = {"feedline (zero-copy)": row(300), "DataLoader + stock Pillow": row(100),
            "DataLoader + pillow-simd": row(150), "1 core, draft": row(150)}
    now = {"when": "12:30", "settings": settings, "workloads": {"jpeg": jpeg}, "targets": []}
    merged = keep_earlier_sections(earlier, now, 2)
    assert merged["workloads"] == {"raw": raw, "captioned": {}, "jpeg": jpeg} and merged["distributed"] == dist
    assert merged["ran"] == {"raw": "09:33", "captioned": "09:33", "jpeg": "12:30", "distributed": "09:33"}
    assert any(t["target"].startswith("raw 1 MiB") for t in merged["targets"])  # checked again over the whole
    other = {**now, "settings": {**settings, "rounds": 1}}
    assert keep_earlier_sections(earlier, other, 2)["workloads"] == {"jpeg": jpeg}  # other settings: nothing kept


def test_the_shuffle_quality_section_measures_each_loaders_order_on_a_class_sorted_dataset(tmp_path):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    run = subprocess.run(
        [sys.executable, "-m", "feedline", "bench", "--quick", "--workers", "2", "--workloads", "shuffle",
         "--json", str(out_json), "--markdown", str(out_md), "--host", "test-host", "--peers", "off",
         "--cache-dir", str(tmp_path / "cache")],  # the peers' rows need .venv-peers: a ./scripts/bench run has them
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["label"]: r for r in json.loads(out_json.read_text())["test-host"]["shuffle"]["rows"]}
    assert set(rows) == {"feedline (default: the epoch, by blocks)", 'feedline shuffle="stream"',
                         "webdataset (shardshuffle=100, .shuffle(1000))"}
    assert all(r["complete"] and r["samples_per_s"] > 0 for r in rows.values())
    ours, stream = rows["feedline (default: the epoch, by blocks)"], rows['feedline shuffle="stream"']
    assert ours["distinct"] >= 0.95 * ours["uniform"] and abs(ours["spearman"]) <= 0.05
    assert stream["distinct"] < ours["distinct"]
    assert "### Shuffle quality (100 classes x 200 samples written in class order" in out_md.read_text()


def test_the_bookkeeping_counts_compare_a_worker_and_the_bare_decode_on_the_same_samples_and_boxes(tmp_path):
    """Issue 68: what callgrind's two loops count differs only by what the worker does beside decoding: their first
    batches hold the same pixels (the same samples, order and random boxes)."""
    import numpy as np

    from feedline.bench.bookkeeping import BATCH, decode_loop, worker_loop
    from feedline.demo.datasets import make_dataset

    shards = make_dataset("jpeg", str(tmp_path), 2 * BATCH, 1 << 20, os.path.join(ROOT, ".cache"))
    assert len(shards) >= 2  # the worker crosses a shard's end as it does in the bench
    assert np.array_equal(worker_loop(sorted(shards), 2 * BATCH), decode_loop(sorted(shards), 2 * BATCH))


def test_a_sigterm_stops_the_bench_and_removes_its_samples_from_dev_shm(tmp_path):
    before = {e for e in os.listdir("/dev/shm") if e.startswith("feedline-bench-")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "feedline", "bench", "--quick", "--seconds", "5", "--workers", "1", "--raw-samples", "48",
         "--sample-size", "64KiB", "--json", str(tmp_path / "b.json"), "--markdown", str(tmp_path / "b.md"),
         "--workloads", "raw", "--host", "test-host", "--peers", "off", "--fast-peers", "off"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not {e for e in os.listdir("/dev/shm") if e.startswith("feedline-bench-")} - before:
        assert proc.poll() is None and time.monotonic() < deadline, "the bench made no folder in /dev/shm"
        time.sleep(0.05)
    time.sleep(2)  # a contender running
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert {e for e in os.listdir("/dev/shm") if e.startswith("feedline-bench-")} - before == set()
    assert not (tmp_path / "b.json").exists()  # nothing half-written


ZYGOTE_ROWS = """
import json, os, sys
import multiprocessing.forkserver as forkserver
from feedline.bench.zygote import Zygote

env = dict(os.environ)
with Zygote() as zygote:
    module = zygote.module_of([sys.executable, "-m", "feedline.bench.contenders"], env)
    ok = zygote.run(module, ["--help"], env, timeout=120)
    bad = zygote.run(module, ["feedline", "--workload", "raw"], env, timeout=120)  # --shards is missing
    server = forkserver._forkserver._forkserver_pid
print(json.dumps({"module": module, "ok": [ok.returncode, ok.stdout], "bad": [bad.returncode, bad.stdout, bad.stderr],
                  "server": server, "server_alive": server is not None and os.path.exists(f"/proc/{server}")}))
"""


def test_a_quick_row_forked_from_the_zygote_reports_as_its_own_process_would():
    """``--quick``'s rows are forked from one process that imported torch (``zygote.py``): each keeps its own
    stdout, stderr and exit status, and the server is gone once the zygote is closed. (In a process of its own:
    a forkserver brings up multiprocessing's resource tracker, which lives as long as the process that started
    it, and tests that count this process's children would see it.)"""
    run = subprocess.run([sys.executable, "-c", ZYGOTE_ROWS], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["module"] == "feedline.bench.contenders"
    assert got["ok"][0] == 0 and "--steps-per-s" in got["ok"][1]
    assert got["bad"][0] == 2 and "--shards" in got["bad"][2] and got["bad"][1] == ""
    assert got["server"] is not None and not got["server_alive"]  # stopped at close, not at exit


def test_rows_a_forked_process_cannot_run_are_left_to_a_subprocess():
    from feedline.bench.zygote import Zygote

    env = dict(os.environ)
    zygote = Zygote()
    stock = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [".venv/stock-pillow", env.get("PYTHONPATH")])))
    assert zygote.module_of([sys.executable, "-m", "feedline.bench.contenders"], stock) is None  # another Pillow
    assert zygote.module_of([sys.executable, "-m", "feedline.bench.peers"], env) is None  # the peers' own venv
    assert zygote.module_of(["/other/python", "-m", "feedline.bench.contenders"], env) is None


def test_a_row_that_sets_what_torch_reads_at_import_runs_as_a_subprocess():
    """The zygote imported torch before it forked: a row that sets its thread count (or Python's hash seed) would
    silently run with the server's."""
    from feedline.bench.zygote import Zygote

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONHASHSEED")}
    zygote = Zygote()
    cmd = [sys.executable, "-m", "feedline.bench.contenders"]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OMP_NUM_THREADS", raising=False)
        mp.delenv("PYTHONHASHSEED", raising=False)
        assert zygote.module_of(cmd, env) == "feedline.bench.contenders"
        assert zygote.module_of(cmd, dict(env, OMP_NUM_THREADS="1")) is None
        assert zygote.module_of(cmd, dict(env, PYTHONHASHSEED="0")) is None
