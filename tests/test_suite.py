"""The suite's own machinery: what scripts/test relies on to keep its time (issue 68)."""

import os
import subprocess
import sys

GROUPED = '''
import os
import pytest

pytestmark = pytest.mark.xdist_group("one")


@pytest.mark.parametrize("k", range(6))
def test_notes_its_worker(k):
    with open(os.environ["WORKERS_FILE"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "none") + "\\n")
'''


def test_an_xdist_group_runs_in_one_worker(tmp_path):
    """scripts/test runs pytest-xdist with --dist loadgroup: a module marked with a group runs its module fixtures
    once only if all its tests go to one worker (pytest 9.2 with xdist 3.8 spread them: pytest-xdist#1386)."""
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    notes = tmp_path / "workers.txt"
    # only xdist's plugin loaded: the venv's other plugins (anyio, ray's, ...) cost each of the three processes
    # an import, and the grouping is xdist's alone
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xdist", "-n", "2",
                          "--dist", "loadgroup", str(tmp_path / "test_grouped.py")], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "WORKERS_FILE": str(notes),
                                            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    workers = notes.read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, workers
