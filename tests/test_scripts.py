"""Training scripts written the usual ways, run as real processes: guarded or not, from a file or stdin."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import ROOT, id_shards

HEADER = textwrap.dedent("""
    import sys
    from feedline import StagingLoader
    print("top level ran", flush=True)
""")

LIBRARY_TRANSFORM = textwrap.dedent("""
    from feedline.formats.transforms import Compose
    loader = StagingLoader(sys.argv[1], batch_size=8, workers=2, transform=Compose())
    print("samples", sum(len(b["cls"]) for b in loader), flush=True)
    loader.close()
""")

SCRIPT_TRANSFORM = textwrap.dedent("""
    class Double:
        def __call__(self, sample):
            sample["cls"] = 2 * sample["cls"]
            return sample
""")

UNGUARDED_LOOP = textwrap.dedent("""
    loader = StagingLoader(sys.argv[1], batch_size=8, workers=2, transform=Double())
    print("samples", sum(len(b["cls"]) for b in loader), flush=True)
    loader.close()
""")

GUARDED_LOOP = "if __name__ == '__main__':\n" + textwrap.indent(UNGUARDED_LOOP, "    ")


@pytest.fixture
def data(tmp_path):
    id_shards(str(tmp_path / "ids"), shards=4, per_shard=10)
    return str(tmp_path / "ids" / "*.tar")


def run(tmp_path, source, data, stdin=False):
    t0 = time.monotonic()
    if stdin:
        out = subprocess.run([sys.executable, "-", data], input=source, capture_output=True, text=True, cwd=ROOT,
                             timeout=120)
    else:
        script = tmp_path / "train.py"
        script.write_text(source)
        out = subprocess.run([sys.executable, str(script), data], capture_output=True, text=True, cwd=ROOT,
                             timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    return out, time.monotonic() - t0


def test_an_unguarded_script_with_a_library_transform_just_works(tmp_path, data):
    out, _ = run(tmp_path, HEADER + LIBRARY_TRANSFORM, data)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["top level ran", "samples 40"]  # the workers never ran the script


def test_a_script_fed_through_stdin_just_works(tmp_path, data):
    out, _ = run(tmp_path, HEADER + LIBRARY_TRANSFORM, data, stdin=True)
    assert out.returncode == 0, out.stderr
    assert "samples 40" in out.stdout


def test_a_guarded_script_may_define_its_own_transform(tmp_path, data):
    out, _ = run(tmp_path, HEADER + SCRIPT_TRANSFORM + GUARDED_LOOP, data)
    assert out.returncode == 0, out.stderr
    assert "samples 40" in out.stdout


def test_an_unguarded_script_defining_its_transform_fails_at_once_saying_what_to_change(tmp_path, data):
    out, seconds = run(tmp_path, HEADER + SCRIPT_TRANSFORM + UNGUARDED_LOOP, data)
    assert out.returncode != 0
    assert out.stdout.count("top level ran") == 1  # not re-run by any worker
    assert out.stderr.count("Traceback") == 1 and "died" not in out.stderr and "bootstrapping" not in out.stderr
    message = out.stderr.strip().splitlines()[-1]
    assert "SettingError: transform: class Double is defined in the training script" in message
    assert 'if __name__ == "__main__":' in message and "module of its own" in message
    assert seconds < 60


def test_a_transform_defined_in_stdin_code_is_refused_naming_the_fix(tmp_path, data):
    out, _ = run(tmp_path, HEADER + SCRIPT_TRANSFORM + UNGUARDED_LOOP, data, stdin=True)
    assert out.returncode != 0
    assert "notebook, stdin or python -c" in out.stderr and "move it into a .py module" in out.stderr


def test_a_transform_defined_under_the_guard_fails_at_the_first_batch_with_the_fix_named(tmp_path, data):
    inside = "if __name__ == '__main__':\n" + textwrap.indent(SCRIPT_TRANSFORM + UNGUARDED_LOOP, "    ")
    out, _ = run(tmp_path, HEADER + inside, data)
    assert out.returncode != 0
    assert "LoaderError: worker" in out.stderr and "could not start: AttributeError" in out.stderr
    assert "define the transform at the script's top level or in a module" in out.stderr
    assert "died" not in out.stderr  # at once, not after restarts
