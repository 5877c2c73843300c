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


COMPILES = '''
import importlib._bootstrap_external as external
import os

compiled = []
to_code = external.SourceLoader.source_to_code


def source_to_code(self, data, path, *args, **kwargs):
    compiled.append(path)
    return to_code(self, data, path, *args, **kwargs)


external.SourceLoader.source_to_code = source_to_code
from feedline import StagingLoader  # what a training script imports
import feedline.appliance.cli  # what a command imports
import feedline.loader.workers.worker  # what each worker imports

import feedline

root = os.path.dirname(feedline.__file__) + os.sep
print("\\n".join(p for p in compiled if p.startswith(root)))
'''


def test_feedline_imports_from_its_bytecode_even_where_python_writes_none():
    """scripts/setup compiles feedline: where PYTHONDONTWRITEBYTECODE is set (here, and in many CI runners) an
    editable install would otherwise compile every module again in every process the suite starts."""
    run = subprocess.run([sys.executable, "-c", COMPILES], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [], f"compiled from source (run ./scripts/setup): {run.stdout.split()[:5]}"
