"""The 3-minute soak run (issue 33's version in the test suite), started beside the rest of the suite.

It runs for three minutes of wall time at about a third of one core (its trainer is paced by its step, so a
busy machine slows decode first, which the run is built to stand): run before its test, it would add those
minutes to the suite. So it starts as soon as its test is collected (``conftest.py``), runs while the other
tests do, and its test waits for it and checks what it left, as it did when it started the run itself.
Its processes and its cache in /dev/shm (``feedline-soak-cache-*``) are its own: the other tests' leak
checks leave them alone, and its test checks them gone. Stopped with its processes at the session's end.
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


class BackgroundSoak:
    """One ``feedline soak`` process: ``start()`` once, ``wait()`` for its exit code, ``stop()`` at the end."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.root = ""
        self.started = 0.0

    @property
    def out(self) -> str:
        return os.path.join(self.root, "soak")

    def start(self, cwd: str) -> None:
        if self.proc is not None:
            return
        self.root = tempfile.mkdtemp(prefix="feedline-test-soak-")
        log = open(os.path.join(self.root, "output.txt"), "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "feedline", "soak", *ARGS, "--out", self.out], cwd=cwd,
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()

    def wait(self) -> int:
        """The run's exit code (its output is in ``output()``); it is stopped if it outlives ``TIMEOUT``."""
        assert self.proc is not None, "the soak run was not started (its test was not collected?)"
        try:
            return self.proc.wait(timeout=max(1.0, TIMEOUT - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.stop(remove=False)
            raise

    def output(self) -> str:
        with open(os.path.join(self.root, "output.txt"), errors="replace") as f:
            return f.read()

    def stop(self, remove: bool = True) -> None:
        """Ctrl-C to the run (it stops its processes and removes its cache), then whatever is left is killed."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its session: any process of it still there
            except ProcessLookupError:
                pass
            proc.wait()
        if remove and self.root:
            shutil.rmtree(self.root, ignore_errors=True)


SOAK = BackgroundSoak()
