"""scripts/gpu-check: the CUDA check made ready here, run on a lent GPU machine that reaches no registry."""

import json
import os
import subprocess
import sys
import time
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
        assert results["sections"] == {name: {"skipped": "no CUDA"} for name in ("placement", "raw", "decode", "h2d",
                                                                                  "e2e", "e2e-256")}
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
        z.writestr("gpu_check_probe-1.0.data/scripts/probe-tool", "#!/bin/sh\necho probed\n")  # as py-spy's program
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
    assert subprocess.run([str(site / "bin" / "probe-tool")], capture_output=True, text=True).stdout == "probed\n"


RAW_STACKS = (
    'process 10:"python -m feedline.bench.contenders feedline";thread (10): MainThread;<module> (contenders.py:1);'
    'run (/x/contenders.py:140);Epoch.__next__ (/x/iterator.py:88) 30\n'
    'process 10:"python -m feedline.bench.contenders feedline";thread (10): MainThread;<module> (contenders.py:1);'
    'run (/x/contenders.py:141) 10\n'
    'process 10:"python -m feedline.bench.contenders feedline";thread (11): feedline-transfer-0;'
    'Transfer._copy (/x/transfer.py:270) 20\n'
    'process 10:"python -m feedline.bench.contenders feedline";process 12:"python -c import sys; sys.path[:] = '
    'json.loads(sys.argv[1]); child(x)";thread (12): MainThread;<module> (<string>:1);fill (/x/spec.py:50) 150\n'
    'process 10:"python -m feedline.bench.contenders feedline";process 13:"python -c import sys\nchild(y)";'
    'thread (13): MainThread;<module> (<string>:1);fill (/x/spec.py:51) 50\n'
)


def test_a_profile_splits_cpu_between_the_training_process_its_threads_and_the_workers():
    from feedline.bench import pyspy

    s = pyspy.summarize(RAW_STACKS, rate=100)
    train, workers = s[pyspy.TRAINING], s[pyspy.WORKERS]
    assert train["cpu_s"] == 0.6 and train["processes"] == 1
    assert train["threads"] == {"MainThread": 0.4, "feedline-transfer-0": 0.2}
    assert train["self"][0] == ["Epoch.__next__ (iterator.py)", 0.3]
    assert dict(map(tuple, train["total"]))["run (contenders.py)"] == 0.4  # lines of a function add up
    # a worker's command line holds ';': it still counts as one process, not as frames
    assert workers["cpu_s"] == 2.0 and workers["processes"] == 2
    assert workers["self"] == [["fill (spec.py)", 2.0], ["<module> (<string>)", 0.0]][:len(workers["self"])]
    md = pyspy.markdown("raw", s, seconds=2.0)
    assert "training process: 0.60 CPU s (30% of a core; 1 process)" in md
    assert "worker processes: 2.00 CPU s (100% of a core; 2 processes)" in md


def test_a_real_process_profiled_names_its_busy_thread_and_its_child(tmp_path):
    from feedline.bench import pyspy

    assert pyspy.binary(), "py-spy is a test dependency (pyproject's test extra)"
    prog = ("import json, multiprocessing as mp, sys, threading, time\n"
            "def burn(s):\n    t = time.time()\n    while time.time() - t < s: sum(range(1000))\n"
            "if __name__ == '__main__':\n"
            "    burn(0.5)  # start-up, before the clock: left out of the profile\n"
            "    p = mp.get_context('spawn').Process(target=burn, args=(3,)); p.start()\n"
            "    th = threading.Thread(target=burn, args=(3,), name='busy-thread'); th.start()\n"
            f"    print({pyspy.TIMING!r}, file=sys.stderr, flush=True)\n"
            "    th.join(); p.join(); print(json.dumps({'samples_per_s': 1.0}))\n")
    (tmp_path / "prog.py").write_text(prog)  # a file: a spawned child imports its parent's main module
    result, raw, problem = pyspy.record([sys.executable, str(tmp_path / "prog.py")], dict(os.environ), duration=1.0)
    if "Permission denied" in problem or "ptrace" in problem.lower():
        import pytest

        pytest.skip(f"this machine does not let py-spy attach: {problem}")
    assert result == {"samples_per_s": 1.0} and problem == ""
    s = pyspy.summarize(raw)
    assert s[pyspy.TRAINING]["threads"].get("busy-thread", 0) > 0.3
    assert s[pyspy.TRAINING]["threads"].get("MainThread", 0) < 0.1  # its start-up burn came before the clock
    assert s[pyspy.WORKERS]["processes"] == 1 and s[pyspy.WORKERS]["cpu_s"] > 0.3
    assert any(fn.startswith("burn ") for fn, _ in s[pyspy.WORKERS]["self"])


def test_a_lent_machines_results_are_recorded_under_its_host_and_kept_by_the_next_bench_run(tmp_path):
    import shutil

    from feedline.bench import gpu_check
    from feedline.bench.sections import keep_earlier_sections

    bench_json, bench_md = tmp_path / "benchmarks.json", tmp_path / "benchmarks.md"
    shutil.copy(os.path.join(ROOT, "docs", "benchmarks.json"), bench_json)
    doc = json.loads(bench_json.read_text())
    host = next(h for h in doc if "gpu" in doc[h]["machine"])
    results = {"when": "2030-01-01 00:00 UTC", "machine": {**doc[host]["machine"], "crop_decoder": "the PIL path"},
               "steps": [], "sections": {"raw": {"summary": "7.00x DataLoader", "met": True, "rows": {}}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert gpu_check.record(str(tmp_path / "results.json"), ["a note the reader needs"], str(bench_json),
                            str(bench_md)) == host
    md = bench_md.read_text()
    assert "### The CUDA path's check (`scripts/gpu-check`), 2030-01-01 00:00 UTC" in md
    assert "a note the reader needs" in md and "| raw | " in md and "7.00x DataLoader | yes |" in md
    kept = json.loads(bench_json.read_text())[host]
    rerun = {**{k: v for k, v in kept.items() if k != "gpu_check"}, "settings": {**kept["settings"], "seconds": 99}}
    assert keep_earlier_sections(kept, rerun, 4)["gpu_check"]["when"] == "2030-01-01 00:00 UTC"


def test_a_contender_that_fails_before_its_clock_is_reported_at_once_not_waited_for():
    from feedline.bench import pyspy

    started = time.monotonic()
    result, raw, problem = pyspy.record([sys.executable, "-c", "import sys; sys.exit('no shards')"],
                                        dict(os.environ), duration=1.0)
    assert result is None and raw == "" and "exited 1" in problem and "no shards" in problem
    assert time.monotonic() - started < 10


def test_the_e2e_step_taken_apart_shows_each_contenders_trace_and_the_loaders_own_counters():
    from feedline.bench.gpu_results import markdown

    trace = {"wall_ms_per_step": 127.0, "device_ms_per_step": 61.5, "top": [["sm90_xmma_conv", 20.0, 53]]}
    cost = {"cpu_seconds": 0.00021, "wakeups": 0.0, "device_calls_loop": 3.0}
    results = {"when": "2030-01-01 00:00 UTC", "steps": [],
               "machine": {"gpu": "GPU", "cpus": 16, "python": "3.12", "torch": "2", "pil": "12", "crop_decoder": "c"},
               "sections": {"e2e": {"summary": "feedline 51% of synthetic", "met": False, "rows": {}, "why": {
                   "feedline, 2 transfer threads": {"samples_per_s": 2012.0, "starvation": 0.007,
                                                    "gpu_copy_wait": 0.02, "trace": trace, "cost": cost},
                   "synthetic, a loader running beside it": {"failed": "contender synthetic-beside failed: | boom"}}}}}
    md = markdown(results)
    assert ("| feedline, 2 transfer threads | 2012 | 0.7% | 2.0% | 127.0 | 61.5 | 0.210 | 0.00 | 3.00 | "
            "sm90_xmma_conv 20.00 ms |") in md
    assert "| synthetic, a loader running beside it | FAILED: contender synthetic-beside failed: / boom |" in md
    assert "| e2e | ResNet-50 step fed by feedline within 5 % of synthetic data on the device, batch 32 " \
           "(launch-bound) | feedline 51% of synthetic | **no** |" in md

def test_the_placement_section_tells_contention_placement_and_worker_count_apart():
    """Issue 69's GPU rows: synthetic alone and beside the loader (unplaced, placed), feedline unplaced and placed
    at 4, 8 and 12 workers and with the defaults, DataLoader; the topology in its text."""
    from feedline.bench.gpu_placement import CEILING, markdown_lines, rows

    names = rows(cpus=16, e2e_workers=12)
    assert list(names)[0] == CEILING and len(names) == 11
    assert names["feedline, placed, 8 workers"] == ("feedline", "--workers", "8", "--cpu-placement", "auto")
    assert names["synthetic, the loader beside it at full tilt, unplaced"][-1] == "off"
    assert [n for n in rows(cpus=6, e2e_workers=2) if "unplaced," in n and n.startswith("feedline")] == [
        "feedline, unplaced, 4 workers"]  # 8 and 12 need more CPUs than 6
    fake = {"batch_size": 256, "rows": {n: {"samples_per_s": 1000.0, "starvation": 0.01, "main_cpu_pct": 100}
                                        for n in names},
            "ratios": {n: (0.9, 0.9, 0.9) for n in names if n != CEILING},
            "topology": {"cpus": "0-15", "cores": 8, "threads_per_core": 2, "numa_nodes": 1, "quota": None,
                         "idle_mhz": 2400.0, "under_load_mhz": 2100.0, "Model name": "AMD EPYC"}}
    text = "\n".join(markdown_lines(fake))
    assert "8 cores, 2 threads a core" in text and "2100.0 MHz under the defaults' row" in text
    assert text.count("| feedline, ") == 7
