"""The loader and the CLI as separate processes: Ctrl-C, SIGKILL, the demo job, configuration."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import (
    ROOT,
    descendants,
    gone,
    id_shards,
    jpeg_bytes,
    shm_entries,
    write_tar,
)

from feedline.api.config import Config, ConfigError, parse_size

TRAINING_LOOP = textwrap.dedent("""
    import faulthandler, signal, sys, time
    from feedline import StagingLoader
    if __name__ == "__main__":
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang says where it is (the tests send it)
        with StagingLoader(sys.argv[1], batch_size=4, workers=2,
                           spec={"cls": "int64", "bin": ("uint8", (64,))}) as loader:
            for epoch in range(1000):
                for batch in loader:
                    print("step", flush=True)
                    time.sleep(0.01)
""")


def _as_from_a_terminal():
    """Ctrl-C's default disposition, as a shell gives a program it starts in the foreground: a suite run in
    the background (``./.ci/run &``) passes SIGINT on ignored, and Python then leaves it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_trainer(tmp_path):
    shards = id_shards(str(tmp_path / "ids"), shards=4, per_shard=50)
    script = tmp_path / "loop.py"
    script.write_text(TRAINING_LOOP)
    proc = subprocess.Popen([sys.executable, str(script), os.path.join(os.path.dirname(shards[0]), "*.tar")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True, preexec_fn=_as_from_a_terminal)
    for _ in range(3):  # wait until it is training
        assert proc.stdout.readline().strip() == "step"
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    return proc, workers


@pytest.mark.serial
def test_ctrl_c_in_the_training_loop_stops_every_process_and_frees_shared_memory(tmp_path):
    before = shm_entries()
    proc, workers = _start_trainer(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # keep the stacks of a hang
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"the trainer did not stop within 30 s of Ctrl-C; its threads:\n{err[-6000:]}")
    assert proc.returncode != 0
    assert gone(workers)
    assert shm_entries() == before


def test_sigkill_of_the_trainer_takes_its_workers_with_it(tmp_path):
    proc, workers = _start_trainer(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert gone(workers)


@pytest.mark.parametrize("extra", [[], ["--device-decode", "true"]], ids=["worker-decode", "device-decode"])
def test_demo_training_job_runs_and_writes_its_summary(tmp_path, extra):
    d = tmp_path / "jpeg"
    d.mkdir()
    for k in range(2):
        write_tar(str(d / f"j-{k}.tar"), [(f"k{k}{i:03d}", {"jpg": jpeg_bytes(i), "cls": str(i % 3).encode()})
                                          for i in range(40)])
    summary = tmp_path / "summary.json"
    out = subprocess.run([sys.executable, "-m", "feedline", "train", "--shards", str(d / "*.tar"), "--epochs", "2",
                          "--batch-size", "16", "--image-size", "32", "--step-ms", "5", "--summary-json",
                          str(summary), "--metrics-port", "0", *extra],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(summary.read_text())
    assert [e["samples"] for e in doc["epochs"]] == [80, 80]
    assert doc["loader"]["samples_total"] == 160
    assert 0.0 <= doc["loader"]["gpu_starvation_ratio"] <= 1.0
    assert "starvation" in out.stderr and "samples/s" in out.stderr
    if not extra and "OMP_NUM_THREADS" not in os.environ and len(os.sched_getaffinity(0)) > 1:
        assert re.search(r"torch intra-op threads: \d+ \(", out.stderr)  # the step leaves its workers their CPUs
    if extra:
        assert "torch intra-op threads" not in out.stderr  # device decode decodes in the trainer: threads stay


def _step_threads_after(monkeypatch, workers, cpus=4, device_decode=None, omp=None):
    """torch's intra-op threads after the demo job's choice, from 8, for a loader starting ``workers``."""
    import types

    import torch

    import feedline.trainer.train as train
    from feedline.trainer.distributed import Job

    monkeypatch.setattr(train, "usable_cpus", lambda: (cpus, "test"))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    loader = types.SimpleNamespace(workers=workers, settings=types.SimpleNamespace(device_decode=device_decode))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(8)
        train._leave_workers_their_cpus(loader, Job())
        return torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_the_demo_step_gets_the_cpus_its_workers_leave_and_at_least_one(monkeypatch):
    assert _step_threads_after(monkeypatch, workers=1) == 3
    assert _step_threads_after(monkeypatch, workers=6) == 1


def test_the_demo_steps_threads_are_left_alone_under_omp_num_threads_or_device_decode(monkeypatch):
    assert _step_threads_after(monkeypatch, workers=1, omp="2") == 8
    assert _step_threads_after(monkeypatch, workers=1, device_decode=object()) == 8


def test_cli_refuses_a_bad_setting_naming_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", "feedline", "train", "--shards", "x", "--workers", "0",
                          "--metrics-port", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert "workers" in out.stderr and "minimum" in out.stderr


def test_settings_come_from_defaults_then_environment_then_flags():
    assert Config.load({}, env={}).workers == "auto"
    assert Config.load({}, env={"FEEDLINE_WORKERS": "3"}).workers == 3
    assert Config.load({"workers": "4"}, env={"FEEDLINE_WORKERS": "3"}).workers == 4


@pytest.mark.parametrize("env, words", [
    ({"FEEDLINE_BATCH_SIZE": "zero"}, ["batch_size", "FEEDLINE_BATCH_SIZE"]),
    ({"FEEDLINE_DEVICE": "tpu"}, ["device"]),
    ({"FEEDLINE_WORKRES": "2"}, ["FEEDLINE_WORKRES", "FEEDLINE_WORKERS"]),
    ({"FEEDLINE_SHARDS": "a", "FEEDLINE_CACHE": "b"}, ["shards", "cache"]),
    ({"FEEDLINE_LOG_LEVEL": "LOUD"}, ["log_level"]),
])
def test_invalid_settings_are_refused_with_the_setting_named(env, words):
    with pytest.raises(ConfigError) as err:
        Config.load({}, env=env)
    for w in words:
        assert w in str(err.value)


def test_sizes_accept_bytes_and_units():
    assert parse_size("1048576") == 1 << 20
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    with pytest.raises(ValueError):
        parse_size("lots")


# -- the face speaks one language -------------------------------------------------------------------

def _train(*args):
    return subprocess.run([sys.executable, "-m", "feedline", "train", "--progress", "false", "--metrics-port", "0",
                           *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("args, named", [
    (["--shards", "/nonexistent/*.tar"], "shards (--shards / FEEDLINE_SHARDS): nothing matches"),
    (["--ring-slots", "100000000"], "ring_slots (--ring-slots / FEEDLINE_RING_SLOTS): the batch ring needs"),
    (["--device", "cuda"], "device (--device / FEEDLINE_DEVICE)"),
])
def test_a_refused_setting_is_one_line_with_exit_code_2_and_no_traceback(tmp_path, args, named):
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    shards = id_shards(str(tmp_path / "ids"), shards=3, per_shard=4)
    data = ["--shards", os.path.join(os.path.dirname(shards[0]), "*.tar")] if "--shards" not in args else []
    out = _train(*data, *args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "configuration error" in line]
    assert len(errors) == 1 and named in errors[0], out.stderr


def _flags(command):
    out = subprocess.run([sys.executable, "-m", "feedline", command, "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    return set(re.findall(r"--[a-z][a-z-]+", out.stdout))


def test_each_subcommand_shows_only_its_own_flags():
    sample, train = _flags("sample"), _flags("train")
    assert {"--source", "--budget", "--fetch-threads", "--cache", "--metrics-port"} <= sample
    assert not {"--batch-size", "--workers", "--epochs", "--shards", "--zero-copy"} & sample
    assert {"--shards", "--cache", "--batch-size", "--workers", "--epochs", "--worker-timeout"} <= train
    assert not {"--source", "--budget", "--fetch-threads", "--policy"} & train
