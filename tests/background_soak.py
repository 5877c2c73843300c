"""The 3-minute soak run (issue 33's version in the test suite), started beside the rest of the suite.

It runs for three minutes of wall time at about a third of one core (its trainer is paced by its step, so a
busy machine slows decode first, which the run is built to stand): run before its test, it would add those
minutes to the suite. So it starts before its test runs, and its test waits for it and checks what it left.
``scripts/test`` starts it before its parallel part (``python tests/background_soak.py start``; the run's
folder goes on in ``TEST_SOAK_DIR``): it runs beside the parallel part's tests, and its test, first in the
one-process part after it, finds it ended. A plain ``pytest`` starts it as soon as its test is collected
(``conftest.py``), beside the tests before it. Either way a small runner process (``run``) owns ``feedline
soak`` and writes its exit code into the folder, so the test needs no parent's ``wait()``. Its processes and its
cache in /dev/shm (``feedline-soak-cache-*``) are its own: the other tests' leak checks leave them alone, and its
test checks them gone. Stopped with its processes at the session's end, and at scripts/test's (an interrupted
one's too).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

TEST = "test_three_minutes_under_every_fault_meet_the_targets_and_leave_nothing"
ARGS = ["--minutes", "3", "--interval", "2", "--warmup", "30", "--worker-warmup", "10", "--window", "40",
        "--rss-target", "600", "--fds-target", "1000", "--throughput-target", "0.8"]
TIMEOUT = 420.0  # from its start: three minutes, its set-up and its shutdown, with room
CACHE_PREFIX = "feedline-soak-"  # the run's cache in /dev/shm (feedline.soak.run), and nothing else's


ENV = "TEST_SOAK_DIR"  # the folder of a run scripts/test started (not FEEDLINE_*: feedline refuses unknown ones)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class BackgroundSoak:
    """One ``feedline soak`` run under its runner: ``start()`` once, ``wait()`` for its exit code, ``stop()`` at
    the end; only a run this process started, or was given, is ever stopped by it."""

    def __init__(self) -> None:
        self.root = ""
        self.runner: subprocess.Popen | None = None  # the runner, when this process started it (reaped here)

    @property
    def out(self) -> str:
        return os.path.join(self.root, "soak")

    @property
    def pid(self) -> int | None:
        """The runner's pid (its session's id: every process of the run is in it)."""
        got = _read(os.path.join(self.root, "runner.pid")) if self.root else None
        return int(got) if got else None

    @staticmethod
    def launch(cwd: str) -> tuple[str, subprocess.Popen]:
        """A new run in a session of its own: its folder (the runner has written its pid there) and the runner."""
        root = tempfile.mkdtemp(prefix="feedline-test-soak-")
        with open(os.path.join(root, "runner.txt"), "wb") as log:  # not the caller's stdout: $(...) would wait
            runner = subprocess.Popen([sys.executable, os.path.abspath(__file__), "run", root], cwd=cwd,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        deadline = time.monotonic() + 60
        while _read(os.path.join(root, "runner.pid")) is None:
            if runner.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the soak's runner did not start (exit code {runner.poll()})")
            time.sleep(0.05)
        return root, runner

    def start(self, cwd: str) -> None:
        """The run scripts/test started (its folder in ``TEST_SOAK_DIR``), else a new one."""
        if self.root:
            return
        given = os.environ.get(ENV)
        if given and os.path.isdir(given):
            self.root = given
        else:
            self.root, self.runner = self.launch(cwd)

    def exit_code(self) -> int | None:
        got = _read(os.path.join(self.root, "rc"))
        return int(got) if got else None

    def wait(self) -> int:
        """The run's exit code (its output is in ``output()``); it is stopped if it outlives ``TIMEOUT``."""
        assert self.root, "the soak run was not started (its test was not collected?)"
        started = float(_read(os.path.join(self.root, "started")) or time.time())
        while (code := self.exit_code()) is None:
            pid = self.pid
            if (pid is None or not _alive(pid)) and self.exit_code() is None:
                raise AssertionError(f"the soak's runner ended without an exit code:\n{self.output()[-3000:]}")
            if time.time() - started > TIMEOUT:
                self.stop(remove=False)
                raise AssertionError(f"the soak run outlived {TIMEOUT:.0f} s:\n{self.output()[-3000:]}")
            if self.runner is not None:
                self.runner.poll()  # reaped as it ends: no zombie among this process's children
            time.sleep(0.5)
        return code

    def output(self) -> str:
        return _read(os.path.join(self.root, "output.txt")) or ""

    def stop(self, remove: bool = True) -> None:
        """Ctrl-C to the run (it stops its processes and removes its cache), then whatever is left is killed."""
        if not self.root:
            return
        soak = _read(os.path.join(self.root, "soak.pid"))
        if soak and self.exit_code() is None and _alive(int(soak)):
            os.kill(int(soak), signal.SIGINT)
            deadline = time.monotonic() + 60
            while self.exit_code() is None and _alive(int(soak)) and time.monotonic() < deadline:
                if self.runner is not None:
                    self.runner.poll()
                time.sleep(0.1)
        pid = self.pid
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)  # its session: any process of it still there
            except (ProcessLookupError, PermissionError):
                pass
        if self.runner is not None:
            self.runner.wait()
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root, self.runner = "", None


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _run(root: str) -> int:
    """The runner: ``feedline soak`` its child, the exit code written when it ends. Ctrl-C and SIGTERM are the
    run's to handle (a handler here, not SIG_IGN, which the child would inherit)."""
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: None)
    _write(os.path.join(root, "started"), repr(time.time()))
    with open(os.path.join(root, "output.txt"), "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "feedline", "soak", *ARGS, "--out", os.path.join(root, "soak")],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    _write(os.path.join(root, "soak.pid"), str(proc.pid))
    _write(os.path.join(root, "runner.pid"), str(os.getpid()))
    _write(os.path.join(root, "rc"), str(proc.wait()))
    return 0


SOAK = BackgroundSoak()


if __name__ == "__main__":  # scripts/test: start (prints the run's folder), stop FOLDER; the runner: run FOLDER
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "run" and len(sys.argv) == 3:
        sys.exit(_run(sys.argv[2]))
    elif what == "start":
        folder, _ = BackgroundSoak.launch(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        print(folder)
    elif what == "stop" and len(sys.argv) == 3:
        if os.path.isdir(sys.argv[2]):
            SOAK.root = sys.argv[2]
            SOAK.stop()
    else:
        sys.exit("usage: background_soak.py start | stop FOLDER | run FOLDER")
