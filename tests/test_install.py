"""The package installs as ``feedline`` and nothing else: a wheel, a fresh virtualenv outside the repository,
and a user project with its own ``app/`` package next to it."""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile

import pytest
from helpers import ROOT, jpeg_bytes, write_tar

# in one xdist worker: one wheel and one fresh venv for the module
pytestmark = pytest.mark.xdist_group("install")

VERSION = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["version"]

# The user's training script: top level, no `if __name__ == "__main__":`, importing its own `app` and feedline,
# with a transform from its own `app` that the workers must import too.
SCRIPT = textwrap.dedent("""
    import json, os, sys
    import app
    from app.transforms import Halve
    import feedline
    from feedline import StagingLoader

    loader = StagingLoader(os.path.join("shards", "*.tar"), batch_size=4, workers=2, transform=Halve())
    batches = [batch["jpg"].shape[0] for batch in loader]
    stats = loader.stats()
    loader.close()
    print(json.dumps({"app": app.__file__, "app_name": app.NAME, "feedline": feedline.__file__,
                      "version": feedline.__version__, "batches": batches, "workers": sum(stats.workers.values()),
                      "sys_path": sys.path}))
""")


def _run(cmd: list[str], cwd: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A wheel built from a copy of the source, installed into a fresh virtualenv outside the repository.

    The venv's dependencies (torch, numpy, pillow-simd, ...) come from the test environment through a folder of
    links that holds everything of .venv's site-packages except feedline itself: pip checks the wheel's
    requirements against them and installs nothing else, so the test needs no network and no second torch."""
    base = tmp_path_factory.mktemp("install")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "app"), src / "app", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env |= {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(base / "dist"),
          str(src)], cwd=str(base), env=env)
    wheel = glob.glob(str(base / "dist" / "feedline-*.whl"))[0]

    venv = base / "venv"
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)], cwd=str(base),
         env=env)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = base / "deps"
    deps.mkdir()
    ours = sysconfig.get_paths()["purelib"]
    for entry in os.listdir(ours):
        if "feedline" not in entry.lower():
            os.symlink(os.path.join(ours, entry), deps / entry)
    with open(os.path.join(site, "test-deps.pth"), "w") as f:
        f.write(f"{deps}\n")
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-index", wheel], cwd=str(base), env=env)
    return {"base": base, "wheel": wheel, "venv": venv, "py": py, "site": site, "env": env}


def test_the_wheel_holds_feedline_and_its_metadata_and_nothing_named_app(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"feedline", f"feedline-{VERSION}.dist-info"}
    assert "feedline/loader/workers/worker.py" in names and "feedline/__main__.py" in names
    assert any(n.startswith("feedline/formats/_jpegcrop.") and n.endswith(".so") for n in names), names  # compiled


def test_the_fresh_venv_has_feedline_and_no_app_and_its_requirements_are_met(installed):
    entries = os.listdir(installed["site"])
    assert "feedline" in entries and not any(e == "app" or e.startswith("app-") for e in entries)
    check = subprocess.run([sys.executable, "-m", "pip", "--python", installed["py"], "check"], capture_output=True,
                           text=True, env=installed["env"])
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_command_python_m_and_version_name_the_installed_version(installed):
    env, cwd = installed["env"], str(installed["base"])
    command = _run([str(installed["venv"] / "bin" / "feedline"), "--version"], cwd=cwd, env=env)
    assert command.stdout.strip() == f"feedline {VERSION}"
    module = _run([installed["py"], "-m", "feedline", "--version"], cwd=cwd, env=env)
    assert module.stdout.strip() == f"feedline {VERSION}"
    helped = _run([installed["py"], "-m", "feedline", "train", "--help"], cwd=cwd, env=env)
    assert "--shards" in helped.stdout


def test_a_user_project_with_its_own_app_package_trains_from_a_top_level_script(installed):
    project = installed["base"] / "project"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text('NAME = "the user\'s app"\n')
    (project / "app" / "transforms.py").write_text(textwrap.dedent("""
        import numpy as np

        class Halve:
            \"\"\"The user's own transform, imported by feedline's workers from the user's `app`.\"\"\"
            def __call__(self, sample):
                sample["jpg"] = np.asarray(sample["jpg"])[::2, ::2].copy()
                return sample
    """))
    (project / "shards").mkdir()
    for s in range(2):
        write_tar(str(project / "shards" / f"part-{s}.tar"),
                  [(f"{s}-{i:03d}", {"jpg": jpeg_bytes(10 * s + i), "cls": str(i % 3).encode()}) for i in range(8)])
    (project / "train.py").write_text(SCRIPT)
    import json

    out = _run([installed["py"], "train.py"], cwd=str(project), env=installed["env"])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["app"] == str(project / "app" / "__init__.py") and got["app_name"] == "the user's app"
    assert got["feedline"].startswith(installed["site"]) and got["version"] == VERSION
    assert not any(p.startswith(ROOT) for p in got["sys_path"])  # nothing of the repository was used
    assert got["workers"] == 2 and sum(got["batches"]) == 16 and len(got["batches"]) == 4


def test_every_public_name_of_the_package_resolves():
    import feedline

    assert all(getattr(feedline, name) is not None for name in feedline.__all__)
    assert feedline.__version__ == VERSION
