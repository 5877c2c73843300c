"""Fixtures every test file shares: the leak check, a remote store of id shards, a cache, sampler processes.

``scripts/test`` starts the 3-minute soak run, then runs the suite in two parts: most of it, with the heavy tests
marked ``beside_soak``, in two pytest-xdist workers (``-n 2``) while the soak runs beside them, then in one
process the soak's test (it finds the run ended) and the tests marked ``serial`` or ``idle_cpus``. In a worker, another worker's test may hold entries in /dev/shm while this one ends, so the
leak check there notes what a test's end found new, and the xdist controller fails the run, naming the tests,
for every such entry still there once all workers are done.
"""

import json
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
    config.addinivalue_line("markers", "serial: checks /dev/shm as a whole, so no other test may run beside it: "
                                       "scripts/test runs it after the parallel part, in one process")
    config.addinivalue_line("markers", "soak: the 3-minute soak's test (background_soak.py): scripts/test runs it "
                                       "in its one-process part")
    config.addinivalue_line("markers", "beside_soak: heavy tests a one-process run puts before the soak's test, "
                                       "where they fill its three minutes (scripts/test: in its parallel part)")


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected: only the tests that will run count
def pytest_collection_modifyitems(session, config, items):
    """Tests marked ``cuda`` skip where there is no CUDA device (scripts/gpu-check runs them on a lent GPU).

    The 3-minute soak run starts now, when its test is among those to run (under scripts/test, which started
    it before its parallel part, it is taken over): it runs beside the others (``background_soak.py``), and its
    test checks it. It takes a share of the CPUs while it runs, and its
    processes make and free shared memory, so the tests marked ``idle_cpus`` or ``serial`` run last, after the
    soak's test has waited for its end: no other work of the suite's own is running beside them then. The tests
    marked ``beside_soak`` run before the soak's own test (which waits for the soak's end), whatever their
    modules' names: they fill its three minutes (issue 68: test_trainers ran after it, 42 s the run waited)."""
    import torch

    if not torch.cuda.is_available():
        no_cuda = pytest.mark.skip(reason=NO_CUDA)
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(no_cuda)
    if any(item.name == background_soak.TEST for item in items):
        SOAK.start(ROOT)  # or, under scripts/test, the run it started before its parallel part
        if SOAK.runner is not None:
            KEPT_FOR_THE_MODULE.add(SOAK.runner.pid)

        def late(item):  # after the soak's test has waited for its end: nothing of the soak's beside them
            return item.get_closest_marker("idle_cpus") or item.get_closest_marker("serial")

        def soak(item):  # the soak's own test waits for its end: after every test meant to run beside it
            return item.name == background_soak.TEST

        beside = [item for item in items if item.get_closest_marker("beside_soak") and not late(item)]
        items[:] = ([item for item in items if not late(item) and not soak(item) and item not in beside] + beside
                    + [item for item in items if soak(item)] + [item for item in items if late(item)])


def pytest_sessionfinish(session, exitstatus):
    SOAK.stop()
    if _notes:  # the xdist controller
        still = _left_by_workers(_notes[0])
        if still:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            reporter.ensure_newline()
            reporter.write_sep("=", "a test left entries in /dev/shm (the run fails)", red=True)
            for entry, tests in sorted(still.items()):
                reporter.write_line(f"{entry}: new at the end of {', '.join(sorted(tests))}")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


SHM_NOTES = "shm_notes"  # a worker's input: the folder where xdist workers note what their tests' ends found new
_notes: list[str] = []  # the xdist controller's: that folder


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # the xdist controller, for each worker: a folder for the workers' notes
    import tempfile

    if not _notes:
        _notes.append(tempfile.mkdtemp(prefix="feedline-test-shm-notes-"))
    node.workerinput[SHM_NOTES] = _notes[0]


def _left_by_workers(folder: str) -> dict[str, set[str]]:
    """Every entry a worker's test end found new that is still in /dev/shm, with those tests; the notes go."""
    deadline = time.monotonic() + 10  # an entry a worker's last test was removing as it ended
    while True:
        noted: dict[str, set[str]] = {}
        for name in os.listdir(folder):
            with open(os.path.join(folder, name)) as f:
                for line in f:
                    test, entry = json.loads(line)
                    noted.setdefault(entry, set()).add(test)
        still = {entry: tests for entry, tests in noted.items() if entry in shm_entries()}
        if not still or time.monotonic() > deadline:
            shutil.rmtree(folder, ignore_errors=True)
            return still
        time.sleep(0.5)


@pytest.fixture(autouse=True)
def nothing_left_behind(request):
    """Every test must leave no process and nothing in /dev/shm (in an xdist worker: noted, checked at the end)."""
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
    new = shm_entries() - before
    notes = getattr(request.config, "workerinput", {}).get(SHM_NOTES)
    if notes is None:
        assert new == set(), "a test left entries in /dev/shm"
    elif new:  # perhaps another worker's test's: the controller checks them when every worker is done
        with open(os.path.join(notes, request.config.workerinput["workerid"]), "a") as f:
            f.writelines(json.dumps([request.node.nodeid, entry]) + "\n" for entry in sorted(new))


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
