"""The loader and the CLI as separate processes: Ctrl-C, SIGKILL, the demo job, configuration."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import id_shards, jpeg_bytes, shm_entries, write_tar

from app.config import Config, ConfigError, parse_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAINING_LOOP = textwrap.dedent("""
    import sys, time
    from app import StagingLoader
    if __name__ == "__main__":
        with StagingLoader(sys.argv[1], batch_size=4, workers=2,
                           spec={"cls": "int64", "bin": ("uint8", (64,))}) as loader:
            for epoch in range(1000):
                for batch in loader:
                    print("step", flush=True)
                    time.sleep(0.01)
""")


def _descendants(pid):
    """Every process below ``pid`` (via /proc), to prove none outlives the trainer."""
    parents = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(e)] = int(fields[1])
            except OSError:
                pass
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def _start_trainer(tmp_path):
    shards = id_shards(str(tmp_path / "ids"), shards=4, per_shard=50)
    script = tmp_path / "loop.py"
    script.write_text(TRAINING_LOOP)
    proc = subprocess.Popen([sys.executable, str(script), os.path.join(os.path.dirname(shards[0]), "*.tar")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    for _ in range(3):  # wait until it is training
        assert proc.stdout.readline().strip() == "step"
    workers = _descendants(proc.pid)
    assert len(workers) >= 2
    return proc, workers


def _gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{p}") and _alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ctrl_c_in_the_training_loop_stops_every_process_and_frees_shared_memory(tmp_path):
    before = shm_entries()
    proc, workers = _start_trainer(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert _gone(workers)
    assert shm_entries() == before


def test_sigkill_of_the_trainer_takes_its_workers_with_it(tmp_path):
    proc, workers = _start_trainer(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert _gone(workers)


def test_demo_training_job_runs_and_writes_its_summary(tmp_path):
    d = tmp_path / "jpeg"
    d.mkdir()
    for k in range(2):
        write_tar(str(d / f"j-{k}.tar"), [(f"k{k}{i:03d}", {"jpg": jpeg_bytes(i), "cls": str(i % 3).encode()})
                                          for i in range(40)])
    summary = tmp_path / "summary.json"
    out = subprocess.run([sys.executable, "-m", "app.cli", "train", "--shards", str(d / "*.tar"), "--epochs", "2",
                          "--batch-size", "16", "--image-size", "32", "--step-ms", "5", "--summary-json",
                          str(summary)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(summary.read_text())
    assert [e["samples"] for e in doc["epochs"]] == [80, 80]
    assert doc["loader"]["samples_total"] == 160
    assert 0.0 <= doc["loader"]["gpu_starvation_ratio"] <= 1.0
    assert "starvation" in out.stderr and "samples/s" in out.stderr


def test_cli_refuses_a_bad_setting_naming_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", "app.cli", "train", "--shards", "x", "--workers", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert "workers" in out.stderr and "minimum" in out.stderr


def test_settings_come_from_defaults_then_environment_then_flags():
    assert Config.load({}, env={}).workers == 2
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
