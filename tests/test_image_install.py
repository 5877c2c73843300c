"""The image's install step (deploy/image/install-feedline) keeps the base image's torch as it is.

A CUDA base image ships its own torch build; the project asks for a torch range, and the install
step pins whatever torch is there. Checked with pip's own plan (``--dry-run --report``) in a
fresh environment holding a torch of another version than this machine's, as a base image would.
"""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT

# in one xdist worker of the parallel part (the tests beside the soak, the bench's, fill its three minutes
# already: issue 68)
pytestmark = pytest.mark.xdist_group("image_install")

INSTALL = os.path.join(ROOT, "deploy", "image", "install-feedline")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A fresh environment, made once (making one is most of these tests' time); ``base(version)`` gives it an
    installed torch of that version (its metadata: pip plans by it) in place of the last one."""
    path = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    site = subprocess.run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()

    def with_torch(version):
        for old in glob.glob(os.path.join(site, "torch-*.dist-info")):
            shutil.rmtree(old)
        info = os.path.join(site, f"torch-{version}.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        with open(os.path.join(info, "INSTALLER"), "w") as f:
            f.write("pip\n")
        return path / "bin" / "python"

    return with_torch


def plan(python, tmp_path):
    """pip's plan for installing the project there, as the Dockerfile's install step runs it."""
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHON": str(python)}
    done = subprocess.run([INSTALL, f"{ROOT}[zstd]", "--dry-run", "--quiet", "--report", str(report)], env=env,
                          capture_output=True, text=True, timeout=300)
    return done, (json.loads(report.read_text()) if report.exists() else None)


def test_the_install_step_leaves_a_preinstalled_torch_of_another_version_alone(tmp_path, base):
    python = base("2.5.1+cu124")
    done, report = plan(python, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "keeping torch 2.5.1+cu124" in done.stderr
    planned = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
               for item in report["install"]}
    assert "torch" not in planned, planned  # the base's CUDA build stays
    assert {"numpy", "rich", "prometheus-client", "boto3", "zstandard"} <= set(planned)  # the rest installs


def test_the_install_step_refuses_a_base_torch_older_than_the_project_needs(tmp_path, base):
    python = base("2.1.0")
    done, _ = plan(python, tmp_path)
    assert done.returncode != 0  # refused: never replaced behind the base image's back
    assert "torch" in done.stderr and ("conflict" in done.stderr.lower() or "resolution" in done.stderr.lower())


def test_the_dockerfile_installs_through_that_step():
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    assert "install-feedline \"/src[zstd,ray]\"" in text  # Ray: the decode nodes of remote decoding
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert '"torch>=' in f.read()  # a range, never a pin pip would act on in a CUDA base image
