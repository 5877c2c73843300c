"""The benchmark runs end to end (tiny sizes: this checks it works, not how fast anything is)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_compares_every_contender_and_writes_json_and_markdown(tmp_path):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    run = subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "--seconds", "0.5", "--workers", "1", "--raw-samples", "48",
         "--jpeg-samples", "48", "--sample-size", "64KiB", "--json", str(out_json), "--markdown", str(out_md),
         "--host", "test-host"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out_json.read_text())["test-host"]
    assert set(doc["workloads"]["raw"]) == {"feedline (zero-copy)", "feedline (copy)", "DataLoader",
                                            "webdataset + DataLoader"}
    jpeg = doc["workloads"]["jpeg"]
    assert jpeg["DataLoader + stock Pillow"]["pil"] != jpeg["feedline (zero-copy)"]["pil"]  # the real baseline
    assert all(row["samples_per_s"] > 0 for rows in doc["workloads"].values() for row in rows.values())
    assert len(doc["targets"]) == 6
    fill = doc["sampler"]["fill"]
    assert fill["sampler_gb_per_s"] > 0 and fill["curl_gb_per_s"] > 0
    training = doc["sampler"]["training"]
    assert training["prefilled"]["samples_per_s"] > 0 and training["filling"]["samples_per_s"] > 0
    md = out_md.read_text()
    assert "| feedline (zero-copy) |" in md and "### Targets" in md
