"""Fixtures every test file shares: the leak check, a remote store of id shards, a cache, sampler processes."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import background_soak  # noqa: E402
from background_soak import SOAK  # noqa: E402
from helpers import KEPT_FOR_THE_MODULE, N_SHARDS, ROOT, children_of, id_shards, shm_entries  # noqa: E402

from feedline.demo.store import FileStore  # noqa: E402

NO_CUDA = "no CUDA device on this machine"


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped without one, run by scripts/gpu-check")
    config.addinivalue_line("markers", "idle_cpus: its verdict needs idle CPUs (it grows workers into them, or "
                                       "bounds a rate): runs after the background soak has ended")


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected: only the tests that will run count
def pytest_collection_modifyitems(session, config, items):
    """Tests marked ``cuda`` skip where there is no CUDA device (scripts/gpu-check runs them on a lent GPU).

    The 3-minute soak run starts now, when its test is among those to run: it runs beside the others
    (``background_soak.py``), and its test checks it. It takes a share of the CPUs while it runs, so the tests
    marked ``idle_cpus`` run last, after the soak's test has waited for its end: no other work of the suite's
    own is running beside them then."""
    import torch

    if not torch.cuda.is_available():
        no_cuda = pytest.mark.skip(reason=NO_CUDA)
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(no_cuda)
    if any(item.name == background_soak.TEST for item in items):
        SOAK.start(ROOT)
        KEPT_FOR_THE_MODULE.add(SOAK.proc.pid)
        late = [item for item in items if item.get_closest_marker("idle_cpus")]
        items[:] = [item for item in items if not item.get_closest_marker("idle_cpus")] + late


def pytest_sessionfinish(session, exitstatus):
    SOAK.stop()


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test must leave no process and nothing in /dev/shm."""
    before = shm_entries()
    yield

    def running():
        return [pid for pid in children_of(os.getpid()) if pid not in KEPT_FOR_THE_MODULE]

    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = running()
    for pid in left:  # so that one leak does not fail every later test too
        os.kill(pid, signal.SIGKILL)
    assert left == [], "a test left child processes running"
    assert shm_entries() - before == set(), "a test left entries in /dev/shm"


@pytest.fixture
def shards(tmp_path):
    """6 shards of 37 id samples each (ids 0..221)."""
    return id_shards(str(tmp_path / "ids"), shards=6, per_shard=37)


@pytest.fixture
def data(tmp_path):
    """The remote dataset: N_SHARDS shards of 20 samples with 2 KiB payloads."""
    d = tmp_path / "remote"
    id_shards(str(d), shards=N_SHARDS, per_shard=20, payload=2048)
    return d


@pytest.fixture
def remote(data):
    """``data`` served over HTTP on 127.0.0.1 (faults can be injected per path)."""
    with FileStore(str(data)) as store:
        yield store


@pytest.fixture
def cache(tmp_path):
    d = tmp_path / "cache"
    yield str(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def samplers():
    """Sampler processes a test started; killed at its end if still running."""
    started = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.communicate()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 MiB tmpfs (skipped where this user cannot mount one)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip()})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)
