"""scripts/gpu-check: the CUDA check made ready here, run on a lent GPU machine that reaches no registry."""

import json
import os
import subprocess
import sys
import zipfile

import torch
from helpers import ROOT

from feedline.bench import gpu_wheels


def test_the_dry_run_runs_every_step_without_cuda_and_reports_the_cuda_ones_skipped(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    done = subprocess.run([os.path.join(ROOT, "scripts", "gpu-check"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    steps = {s["step"]: s for s in results["steps"]}
    assert "wheel list: complete" in steps["wheels"]["detail"]
    assert steps["build"]["status"] in ("ok", "skipped")
    if not torch.cuda.is_available():
        assert steps["tests"]["status"] == "skipped: no CUDA", steps["tests"]
        assert results["sections"] == {name: {"skipped": "no CUDA"} for name in ("raw", "decode", "h2d", "e2e")}
    assert "tests/test_cuda.py" in steps["tests"]["detail"] and "skipped" in steps["tests"]["detail"]
    md = (out / "results.md").read_text()
    assert md.startswith("# gpu-check: ") and results["when"] in md and "| e2e |" in md
    assert (out / "pytest.xml").exists()


def test_the_wheel_list_covers_every_import_of_the_project():
    assert gpu_wheels.check(ROOT) == []


def test_an_import_the_wheel_list_lacks_is_named(tmp_path):
    for part in ("app", "tests", "scripts"):
        (tmp_path / part).mkdir()
    (tmp_path / "scripts" / "gpu-wheels.txt").write_text("rich==15.0.0\n")
    (tmp_path / "app" / "x.py").write_text("import rich\nimport numpy\nfrom somethingnew.sub import y\n")
    (tmp_path / "tests" / "test_x.py").write_text("import helpers\nimport yaml\n")
    (tmp_path / "tests" / "helpers.py").write_text("")
    problems = gpu_wheels.check(str(tmp_path))
    assert len(problems) == 2
    assert "somethingnew (imported by app/x.py)" in problems[0] and "yaml (imported by tests/test_x.py)" in problems[1]


def test_a_listed_wheel_missing_from_the_folder_is_named(tmp_path):
    problems = gpu_wheels.check(ROOT, wheels=str(tmp_path))
    assert problems and all("run scripts/gpu-check --prepare" in p for p in problems)


def test_a_wheel_installs_by_unpacking_it_its_data_folder_included(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "gpu_check_probe-1.0-py3-none-any.whl", "w") as z:
        z.writestr("gpu_check_probe/__init__.py", "VALUE = 1\n")
        z.writestr("gpu_check_probe-1.0.data/purelib/gpu_check_extra.py", "VALUE = 2\n")
        z.writestr("gpu_check_probe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: gpu-check-probe\n"
                                                              "Version: 1.0\n")
    listing = tmp_path / "list.txt"
    listing.write_text("gpu-check-probe==1.0\npytest==0.0.1  # present here: left alone\n")
    done, present = gpu_wheels.install(str(wheels), str(site), str(listing))
    assert done == ["gpu-check-probe==1.0"] and present == ["pytest"]
    check = subprocess.run([sys.executable, "-c", "import gpu_check_probe, gpu_check_extra, importlib.metadata as m; "
                            "print(gpu_check_probe.VALUE + gpu_check_extra.VALUE, m.version('gpu-check-probe'))"],
                           env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert check.stdout.split() == ["3", "1.0"], check.stderr
    assert not any(p.endswith(".data") for p in os.listdir(site))
