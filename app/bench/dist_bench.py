"""The distributed benchmark: ``scripts/two-nodes`` as two simulated nodes x 2 ranks against one node
x 4 ranks on the same machine and data (same world size), each a real DDP job under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                      "two-nodes")


def train_nodes(data: str, out: str, nodes: int, nproc: int, epochs: int = 3) -> dict[str, Any]:
    """Samples/s of the job's epochs after the first (the first includes start-up and warm-up)."""
    env = {**os.environ, "NODES": str(nodes), "NPROC_PER_NODE": str(nproc), "FEEDLINE_EPOCHS": str(epochs),
           "FEEDLINE_WORKERS": "1", "FEEDLINE_BATCH_SIZE": "32", "FEEDLINE_DIST_TIMEOUT": "120"}
    run = subprocess.run([SCRIPT, data, out], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"scripts/two-nodes with {nodes} node(s) failed:\n{run.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        doc = json.load(f)
    steady = doc["epochs"][1:] or doc["epochs"]
    samples = sum(e["samples"] for e in steady)
    seconds = sum(e["seconds"] for e in steady)
    return {"nodes": nodes, "ranks_per_node": nproc, "epochs": len(doc["epochs"]), "samples": samples,
            "seconds": seconds, "samples_per_s": samples / seconds, "steps_per_rank": doc["steps_per_rank"],
            "identical_parameters": len(set(doc["parameter_checksum_per_rank"])) == 1}
