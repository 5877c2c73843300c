import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import children_of, shm_entries  # noqa: E402


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test must leave no process and nothing in /dev/shm."""
    before = shm_entries()
    yield
    deadline = time.monotonic() + 10
    while children_of(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = children_of(os.getpid())
    for pid in left:  # so that one leak does not fail every later test too
        os.kill(pid, signal.SIGKILL)
    assert left == [], "a test left child processes running"
    assert shm_entries() - before == set(), "a test left entries in /dev/shm"
