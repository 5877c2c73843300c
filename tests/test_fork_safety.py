"""Worker starts are never blocked by other threads' forks, and no wait in the hand-off is unbounded (issue 20)."""

from __future__ import annotations

import os
import stat
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import ROOT, children_of, id_shards, shm_entries

from feedline import StagingLoader
from feedline.loader.workers import launch
from feedline.loader.errors import LoaderError

SHARDS, PER_SHARD = 4, 20
ROUNDS = os.environ.get("FEEDLINE_FORK_RACE_ROUNDS")  # 50: the acceptance run, in both races
ROUND_BUDGET = 30.0  # seconds a round may take on a slow CI machine; a blocked start waits for ever


def run_race(tmp_path, mode: str, rounds: int) -> None:
    """Run tests/fork_race.py; on a time-out, fail with every thread's stack (written by its faulthandler)."""
    shards = id_shards(str(tmp_path / "ids"), shards=SHARDS, per_shard=PER_SHARD)
    env = {**os.environ, "PYTHONPATH": ROOT, "FORK_RACE_SAMPLES": str(SHARDS * PER_SHARD)}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fork_race.py"), mode, str(rounds),
                             *shards], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=20 + ROUND_BUDGET * rounds)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)  # the script's faulthandler: every thread's stack to stderr
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{mode}: hung after {out.strip().splitlines()[-1:] or 'no round'}; the stacks:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"{mode} failed:\n{out}\n{err[-4000:]}"
    assert out.count(" ok (") == rounds, out


def test_workers_start_and_are_replaced_while_fork_start_dataloaders_run(tmp_path):
    run_race(tmp_path, "dataloader", int(ROUNDS or 3))


def test_workers_start_and_are_replaced_while_a_thread_forks_in_a_tight_loop(tmp_path):
    run_race(tmp_path, "forker", int(ROUNDS or 2))


def test_a_worker_start_leaves_no_descriptor_but_its_own_in_the_worker(tmp_path):
    """posix_spawn passes exactly the worker's descriptors; an inheritable one of the trainer stays behind."""
    r, w = os.pipe()
    os.set_inheritable(w, True)  # a careless library's descriptor: Popen(close_fds=True) kept it out too
    try:
        shards = id_shards(str(tmp_path / "ids"), shards=2, per_shard=8)
        with StagingLoader(shards, batch_size=4, workers=1) as loader:
            next(iter(loader))
            pid = loader._pipeline.pool.worker_pids()[0]
            fds = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
            targets = set()
            for fd in fds:
                try:
                    targets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except FileNotFoundError:  # a shard the worker closed since the listing
                    pass
        assert f"pipe:[{os.fstat(w).st_ino}]" not in targets
        assert {0, 1, 2} <= fds
    finally:
        os.close(r)
        os.close(w)


def test_a_worker_talks_to_the_trainer_over_two_pipes_whose_trainer_ends_never_block(tmp_path):
    """One pipe each way (pipes.py): the trainer reads results from one and writes fills to the other, never
    blocking; the worker holds the other ends of the same two pipes."""
    shards = id_shards(str(tmp_path / "ids"), shards=2, per_shard=8)
    with StagingLoader(shards, batch_size=4, workers=1) as loader:
        next(iter(loader))
        place = loader._pipeline.pool._supervisor._procs[0]
        ends = (place.results, place.commands)
        pipes = {f"pipe:[{os.fstat(fd).st_ino}]" for fd in ends}
        assert all(stat.S_ISFIFO(os.fstat(fd).st_mode) and not os.get_blocking(fd) for fd in ends)
        assert len(pipes) == 2
        pid = loader._pipeline.pool.worker_pids()[0]
        targets = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    assert pipes <= targets
    assert not any(t.startswith("socket:") for t in targets)


def blocking_start(release: threading.Event):
    """A launcher start that does not return for worker 1: what a blocked fork/exec looks like to the pool."""
    real = launch.Launcher.start

    def start(launcher, worker_id, *args, **kwargs):
        if worker_id == 1:
            release.wait(60)
            raise OSError("released by the test")
        return real(launcher, worker_id, *args, **kwargs)

    return start


@pytest.mark.serial
def test_a_worker_start_that_blocks_ends_in_a_loader_error_within_the_bound(tmp_path, monkeypatch, caplog):
    shards = id_shards(str(tmp_path / "ids"), shards=2, per_shard=8)
    before = shm_entries()
    release = threading.Event()
    monkeypatch.setattr(launch.Launcher, "start", blocking_start(release))
    try:
        loader = StagingLoader(shards, batch_size=4, workers=2, stall_timeout=2.0)
        started = time.monotonic()
        with pytest.raises(LoaderError, match=r"dispatcher thread has not answered for \d+ s \(stall_timeout=2 s\): "
                                              r"it is starting worker 1") as info:
            for _ in loader:
                pass
        waited = time.monotonic() - started
        loader.close()
        assert waited < 2.0 + 5.0, f"the error came after {waited:.1f} s"  # the bound, the grace, a slice
        assert "stall_timeout" in str(info.value)
        assert "release.wait(60)" in caplog.text, "the dispatcher's stack is logged"
        assert children_of(os.getpid()) == [], "worker 0 is killed though the dispatcher is stuck"
    finally:
        release.set()
    assert shm_entries() - before == set()


class SlowToLoad:
    """A transform whose unpickling hangs in a worker (a heavy import, a hung filesystem), never in the trainer."""

    def __init__(self):
        self.trainer = os.getpid()

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.getpid() != self.trainer:
            time.sleep(600)

    def __call__(self, sample):
        return sample


@pytest.mark.serial
def test_a_worker_that_never_finishes_starting_ends_in_a_loader_error_with_its_stack(tmp_path, caplog):
    shards = id_shards(str(tmp_path / "ids"), shards=2, per_shard=8)
    before = shm_entries()
    started = time.monotonic()
    bound = 5.0  # a fresh worker's imports take about a second here (a serial test: the CPUs are idle); the stall
    # is in __setstate__
    with StagingLoader(shards, batch_size=4, workers=1, transform=SlowToLoad(), stall_timeout=bound) as loader:
        with pytest.raises(LoaderError, match=r"worker 0 has not finished starting.*stall_timeout=5"):
            next(iter(loader))
        waited = time.monotonic() - started
    assert waited < bound + 4.0, f"the error came after {waited:.1f} s"
    assert "__setstate__" in caplog.text, "the worker's stack (faulthandler) is logged"
    assert children_of(os.getpid()) == []
    assert shm_entries() - before == set()


def test_the_loops_wait_on_the_device_queue_ends_naming_a_transfer_thread_that_holds_a_batch_too_long():
    """The CUDA hand-off's bound, on any host: a transfer thread stuck in a copy is named, with its stack."""
    from feedline.loader.device.transfer import DeviceQueue
    from feedline.loader.watchdog import Heartbeat

    stuck = threading.Event()
    beat = Heartbeat("transfer thread 0")

    def transfer_thread():
        beat.beat("copying batch 3 of worker 1 to cuda:0", busy=True)
        stuck.wait(30)  # a copy that never lands

    beat.thread = threading.Thread(target=transfer_thread)
    beat.thread.start()
    queue = DeviceQueue(capacity=2, in_order=True)
    queue.start_epoch(0)

    def check():
        exc = beat.stalled(1.0) if beat.busy else None
        if exc is not None:
            raise exc

    queue.watch(check)
    started = time.monotonic()
    try:
        with pytest.raises(LoaderError, match=r"transfer thread 0 has not answered for \d+ s \(stall_timeout=1 s\): "
                                              r"it is copying batch 3 of worker 1 to cuda:0"):
            queue.get()
        assert time.monotonic() - started < 1.0 + 4.0  # the bound, the grace (watchdog.GRACE), a slice
        with pytest.raises(LoaderError, match="transfer thread 0"):  # and every later wait, at once
            queue.get()
    finally:
        stuck.set()
        beat.thread.join()


class HangsOnSample:
    """A decoder deadlock on one sample: the worker holds its batch and never moves again."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, sample):
        if sample["__key__"] == self.key:
            time.sleep(600)
        return sample


def test_a_loop_waiting_while_no_worker_moves_ends_in_a_loader_error_naming_the_worker(tmp_path, caplog):
    shards = id_shards(str(tmp_path / "ids"), shards=1, per_shard=8)
    with StagingLoader(shards, batch_size=4, workers=1, shuffle=False, worker_timeout=0,
                       transform=HangsOnSample("s0000005"), stall_timeout=6.0) as loader:  # room for its start
        it = iter(loader)
        assert next(it)["cls"].tolist() == [0, 1, 2, 3]
        started = time.monotonic()
        with pytest.raises(LoaderError, match=r"waited 6 s \(stall_timeout\) for a batch and no worker made "
                                              r"progress \(worker 0: decoding .*ids-0000.tar sample 's0000005'"):
            next(it)
        assert time.monotonic() - started < 6.0 + 4.0
    assert re.search(r'test_fork_safety.py", line \d+ in __call__', caplog.text), "the worker's stack is logged"
    assert children_of(os.getpid()) == []


@pytest.mark.parametrize("value", [0, -1, "soon"])
def test_stall_timeout_must_be_a_positive_number_of_seconds(tmp_path, value):
    from feedline.errors import SettingError

    shards = id_shards(str(tmp_path / "ids"), shards=1, per_shard=4)
    with pytest.raises(SettingError, match="stall_timeout"):
        StagingLoader(shards, stall_timeout=value)


def test_stall_timeout_comes_from_the_environment_then_the_flag_and_a_bad_one_is_refused():
    from feedline.api.config import Config, ConfigError

    env = {"FEEDLINE_STALL_TIMEOUT": "45"}
    assert Config.load({}, env={}).loader_settings().stall_timeout == 120.0
    assert Config.load({}, env=env).loader_settings().stall_timeout == 45.0
    assert Config.load({"stall_timeout": "7.5"}, env=env).loader_settings().stall_timeout == 7.5
    with pytest.raises(ConfigError, match="stall_timeout"):
        Config.load({}, env={"FEEDLINE_STALL_TIMEOUT": "0"})


STOPPED_SCRIPT = """
import os, signal, sys, threading, time
from feedline import StagingLoader
from helpers import Slow

def ctrl_z():  # while the workers start and the loop waits: the trainer, its threads and workers stop together
    time.sleep(0.2)
    print("stopping", flush=True)
    os.killpg(0, signal.SIGSTOP)

with StagingLoader(sys.argv[1:], batch_size=4, workers=2, transform=Slow(0.05), stall_timeout=5.0) as loader:
    threading.Thread(target=ctrl_z).start()
    ids = [i for batch in loader for i in batch["cls"].tolist()]
print(sorted(ids) == list(range(32)), flush=True)
"""


def test_a_process_stopped_longer_than_the_bound_goes_on_after_it_is_continued(tmp_path):
    """Ctrl-Z then fg (or a debugger) makes every clock look old: no stage counts as stalled for it."""
    shards = id_shards(str(tmp_path / "ids"), shards=2, per_shard=16)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_SCRIPT, *shards], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "stopping"
        time.sleep(1)
        with open(f"/proc/{proc.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "T", "the trainer is stopped"
        time.sleep(8)  # over stall_timeout (5 s: a worker's imports take seconds here) and the grace
        os.killpg(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert out.strip() == "True", err[-3000:]
    assert "has not answered" not in err and "no worker made progress" not in err
