"""Bring your own training: `feedline run` and `StagingLoader.from_env` run the user's script as the appliance
runs its demo, against a cache the sampler sidecar fills."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, Sampler, id_shards, jpeg_bytes, publish_copy, wait_for, write_tar

from feedline import StagingLoader
from feedline.demo.procs import free_port
from feedline.demo.store import FileStore

FEEDLINE = [sys.executable, "-m", "feedline"]
EXAMPLE = os.path.join(ROOT, "examples", "train.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def jpeg_shards(directory, shards=6, per_shard=16):
    os.makedirs(directory, exist_ok=True)
    for k in range(shards):
        write_tar(os.path.join(directory, f"j-{k}.tar"),
                  [(f"k{k}{i:03d}", {"jpg": jpeg_bytes(k * 1000 + i, (32, 24)), "cls": str(i % 3).encode()})
                   for i in range(per_shard)])
    return directory


def settings(**more):
    """What compose passes the trainer, scaled down."""
    return {**os.environ, "PYTHONPATH": ROOT, "FEEDLINE_BATCH_SIZE": "8", "FEEDLINE_WORKERS": "1",
            "FEEDLINE_IMAGE_SIZE": "16", "FEEDLINE_DEVICE": "cpu", "FEEDLINE_METRICS_PORT": "0",
            "FEEDLINE_MIN_SHARDS": "2", "FEEDLINE_WAIT_TIMEOUT": "60", **more}


def feedline_run(*words, env, timeout=240):
    return subprocess.run([*FEEDLINE, "run", *words], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def filled_cache(tmp_path):
    """A cache the real sidecar fills from a real HTTP store (and keeps running, as in compose)."""
    data = jpeg_shards(str(tmp_path / "store"))
    cache = str(tmp_path / "cache")
    with FileStore(data) as store:
        sampler = Sampler(store, cache, "--budget", "64MiB", "--initial-shards", "6", "--min-shards", "2",
                          source=f"{store.url}/j-{{0..5}}.tar")
        try:
            sampler.wait_ready(30)
            yield cache
        finally:
            sampler.stop()


# -- the example script ---------------------------------------------------------------------------

def test_the_example_trains_on_a_sidecar_filled_cache_and_a_second_run_resumes_from_its_checkpoint(
        tmp_path, filled_cache):
    env = settings(FEEDLINE_CACHE=filled_cache, FEEDLINE_CHECKPOINT=str(tmp_path / "ckpt"))
    first = feedline_run("--", sys.executable, EXAMPLE, "--epochs", "2", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout + first.stderr
    assert "is ready" in out and "epoch 0:" in out and "epoch 1:" in out
    assert (tmp_path / "ckpt" / "latest").exists()
    again = feedline_run("--", sys.executable, EXAMPLE, "--epochs", "3", env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    out = again.stdout + again.stderr
    assert "resumed from" in out and "epoch 2:" in out and "epoch 0:" not in out  # goes on, not over


def test_the_example_is_a_ddp_job_under_torchrun_that_stops_on_sigterm_and_resumes_on_fewer_ranks(tmp_path):
    data = jpeg_shards(str(tmp_path / "data"), shards=8, per_shard=24)
    ckpt = tmp_path / "ckpt"
    env = settings(FEEDLINE_SHARDS=os.path.join(data, "*.tar"), FEEDLINE_CHECKPOINT=str(ckpt),
                   FEEDLINE_CHECKPOINT_EVERY="2", FEEDLINE_BATCH_SIZE="2")
    cmd = [TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}", EXAMPLE,
           "--epochs", "1"]
    job = subprocess.Popen([*FEEDLINE, "run", "--", *cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert wait_for(lambda: (ckpt / "latest").exists(), 120), "no checkpoint was committed"
        job.send_signal(signal.SIGTERM)  # to torchrun itself: `feedline run` became it
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert "stopped at step" in out, out[-3000:]
    step, world = map(int, (ckpt / "latest").read_text().split())
    assert world == 2 and (ckpt / f"step-{step:09d}" / "loader-1.json").exists()
    resumed = feedline_run("--", sys.executable, EXAMPLE, "--epochs", "1", env=env)  # one rank now: elastic
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    log = resumed.stdout + resumed.stderr
    assert "saved by 2 rank(s)" in log and "epoch 0:" in log
    seen = int(log.split("epoch 0: ")[1].split()[0])
    assert 0 < seen < 8 * 24  # the rest of the epoch, not all of it again


# -- feedline run ---------------------------------------------------------------------------------

def test_run_becomes_the_command_so_signals_and_the_exit_status_are_the_commands(tmp_path):
    script = "import os, sys; print(os.getpid(), flush=True); sys.exit(7)"
    proc = subprocess.Popen([*FEEDLINE, "run", "--", sys.executable, "-c", script], cwd=ROOT,
                            env=settings(FEEDLINE_SHARDS="x.tar"), stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7
    assert int(out.split()[0]) == proc.pid  # exec'd in place: tini's child is the training command itself


def test_run_takes_the_command_from_feedline_train_cmd(tmp_path):
    marker = tmp_path / "ran"
    env = settings(FEEDLINE_SHARDS="x.tar", FEEDLINE_TRAIN_CMD=f"touch '{marker}'")
    done = feedline_run(env=env, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert marker.exists()


def test_run_without_a_command_is_refused_with_both_ways_to_give_one():
    done = feedline_run(env=settings(), timeout=60)
    assert done.returncode == 2
    assert "configuration error" in done.stdout + done.stderr and "FEEDLINE_TRAIN_CMD" in done.stdout + done.stderr


def test_run_refuses_a_command_that_is_not_on_path():
    done = feedline_run("--", "no-such-trainer", env=settings(), timeout=60)
    assert done.returncode == 2 and "'no-such-trainer' is not an executable" in done.stdout + done.stderr


def test_run_waits_for_the_cache_and_names_the_settings_when_it_stays_empty(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    started = time.monotonic()
    done = feedline_run("--", "true", env=settings(FEEDLINE_CACHE=str(cache), FEEDLINE_WAIT_TIMEOUT="1"), timeout=60)
    assert done.returncode == 2 and time.monotonic() - started >= 1
    out = " ".join((done.stdout + done.stderr).split())
    assert "FEEDLINE_WAIT_TIMEOUT" in out and "FEEDLINE_MIN_SHARDS" in out


def test_run_starts_at_once_on_a_cache_that_holds_its_whole_source_below_min_shards(tmp_path):
    from feedline.cache.store import CacheStore

    data = tmp_path / "store"
    id_shards(str(data), shards=2, per_shard=5)
    store = CacheStore(str(tmp_path / "cache"), budget_bytes=1 << 30, source_ids=frozenset({"ids-0000", "ids-0001"}))
    store.recover()
    for k in range(2):
        publish_copy(store, data, k)
    env = settings(FEEDLINE_CACHE=store.root, FEEDLINE_MIN_SHARDS="4", FEEDLINE_WAIT_TIMEOUT="120")
    done = feedline_run("--", "true", env=env, timeout=60)  # within 60 s, not the 120 s wait_timeout
    assert done.returncode == 0, done.stdout + done.stderr
    assert "holds the whole source, 2 shard(s)" in done.stdout + done.stderr


# -- StagingLoader.from_env ------------------------------------------------------------------------

def test_from_env_reads_the_appliance_settings_and_a_keyword_wins(tmp_path):
    data = jpeg_shards(str(tmp_path / "data"), shards=2, per_shard=10)
    env = {"FEEDLINE_SHARDS": os.path.join(data, "*.tar"), "FEEDLINE_BATCH_SIZE": "5", "FEEDLINE_WORKERS": "1",
           "FEEDLINE_METRICS_PORT": "0", "FEEDLINE_DEVICE": "cpu"}
    with StagingLoader.from_env(env=env, spec={"cls": "int64"}) as loader:
        assert loader.batch_size == 5 and loader.workers == 1
        assert loader.metrics is not None  # FEEDLINE_METRICS_PORT: the endpoint runs
        assert sum(len(b["cls"]) for b in loader) == 20
    with StagingLoader.from_env(env=env, spec={"cls": "int64"}, batch_size=4, metrics_port=None) as loader:
        assert loader.batch_size == 4 and loader.metrics is None


def test_from_env_without_data_says_which_settings_give_it():
    with pytest.raises(ValueError, match="FEEDLINE_CACHE"):
        StagingLoader.from_env(env={})


# -- compose's demo profile ------------------------------------------------------------------------

def test_the_demo_store_writes_the_demo_dataset_with_an_index_that_the_sampler_fills_from(tmp_path):
    root = tmp_path / "demo"
    store = subprocess.Popen([*FEEDLINE, "serve", str(root), "--demo-samples", "60", "--shard-size", "1MiB",
                              "--cache-dir", os.path.join(ROOT, ".cache")], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        url = store.stdout.readline().strip()  # printed once the dataset is written and served
        names = (root / "index.txt").read_text().split()
        assert names and all(n.endswith(".tar") and (root / n).exists() for n in names)
        sampler = Sampler(None, str(tmp_path / "cache"), "--initial-shards", str(len(names)),
                          "--min-shards", str(len(names)), source=f"{url}/index.txt")
        try:
            sampler.wait_ready(60)
        finally:
            sampler.stop()
    finally:
        store.terminate()
        store.wait(timeout=10)


def test_the_sampler_pointed_at_an_absent_demo_store_names_the_demo_profile(tmp_path):
    sampler = Sampler(None, str(tmp_path / "cache"), source="http://demo-store:8080/index.txt")
    out = " ".join(sampler.exit_output().split())
    assert sampler.proc.returncode == 2
    assert "is unset" in out and "docker compose --profile demo up" in out and "FEEDLINE_SOURCE" in out
