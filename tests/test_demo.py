"""The main job: a store, the sampler and the trainer as separate processes, cleaned up however it ends."""

import os
import signal
import subprocess
import sys
import time

from helpers import ROOT, descendants, gone, jpeg_bytes, write_tar


def _demo_data(tmp_path, shards=6, per_shard=30):
    d = tmp_path / "demo"
    d.mkdir()
    for k in range(shards):
        write_tar(str(d / f"jpeg-{k:06d}.tar"),
                  [(f"{k:02d}{i:04d}", {"jpg": jpeg_bytes(k * 100 + i), "cls": str(i % 3).encode()})
                   for i in range(per_shard)])
    return d


def _demo(data, cache, *extra):
    return [sys.executable, "-m", "feedline", "demo", "--data", str(data), "--cache", str(cache),
            "--initial-shards", "2", "--grow-shards", "2", "--min-shards", "2", "--batch-size", "16",
            "--image-size", "32", "--progress", "false", *extra]


def test_the_demo_grows_the_cache_per_epoch_and_cleans_up(tmp_path):
    data = _demo_data(tmp_path)
    cache = tmp_path / "cache"
    run = subprocess.run(_demo(data, cache, "--epochs", "3", "--budget", "64MiB"), cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "cache per epoch, shards (size): 2 (" in out
    assert "samples/s" in out and "starvation" in out
    assert not cache.exists()
    report = tmp_path / "report.html"  # next to the data folder, as ./scripts/run's data/report.html
    assert f"report: {report} (" in out and report.exists()
    page = report.read_text()
    assert "The run, epoch by epoch" in page
    # a run of seconds: the gauges are drawn; rates need more scrapes than $__rate_interval
    # (tests/test_observability.py checks every panel of a longer run)
    assert page.count('class="plotly-graph-div"') >= 5 and "Cache bytes vs budget" in page


def test_ctrl_c_stops_the_demo_its_processes_and_removes_the_cache(tmp_path):
    data = _demo_data(tmp_path)
    cache = tmp_path / "cache"
    proc = subprocess.Popen(_demo(data, cache, "--epochs", "1000", "--step-ms", "20", "--budget", "64MiB"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (cache / "readers" / "0.json").exists():  # training has started
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    children = descendants(proc.pid)
    assert len(children) >= 4  # sampler, trainer and the trainer's workers
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=60)
    assert gone(children)
    assert not cache.exists()
