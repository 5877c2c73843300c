"""The bench's ``launch`` section: a launch-bound step (``launch.py``) fed by each loader against the same step
on one fixed batch — what the starvation figure cannot show (DESIGN.md, "The training process's share").

The step's length is calibrated once here (about 8 ms of tiny torch operations on one thread), then every row
runs it: feedline zero-copy, the device path on the stand-in device (no transfer thread; one; the path before
it, ``h2d="fields"``), and ``DataLoader``, each in its own process, in interleaved rounds, one decode worker
each (the step needs a few thousand samples a second). Each process times the step in turns on its loader's
batches and on one fixed batch (``launch.py``); a row's ratio is the fixed batch's step time over the fed one's:
1.00 is a step as fast as with the data already there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .rounds import Contender, interleaved
from .small import SMALL_BYTES, STANDIN_ROWS

def launch_workload(args: argparse.Namespace, shards: str, run_json: Callable[..., dict[str, Any]]
                    ) -> dict[str, Any]:
    base = [sys.executable, "-m", "feedline.bench.launch"]
    print("  launch: calibrating the step to about 8 ms ...", file=sys.stderr, flush=True)
    cal = subprocess.run([*base, "calibrate", "--batch-size", str(args.batch_size)], capture_output=True, text=True,
                         timeout=300, check=True)
    ops = int(json.loads(cal.stdout.strip().splitlines()[-1])["ops"])

    def c(row: str, mode: str, *extra: str) -> Contender:
        cmd = [*base, mode, "--shards", shards, "--ops", str(ops), "--workers", "1",
               "--batch-size", str(args.batch_size), "--sample-bytes", str(SMALL_BYTES),
               "--warmup-steps", "3" if args.quick else "10", *extra]
        return Contender(row, lambda t: run_json([*cmd, "--seconds", str(t)], None, "launch", row))

    rows = [c("feedline (zero-copy)", "feedline", "--device", "cpu"),
            *[c(row, "feedline", "--device", "standin", *extra) for row, extra in STANDIN_ROWS.items()],
            c("DataLoader", "dataloader")]
    out = interleaved(rows, args.rounds, args.seconds, 0.0 if args.quick else args.warmup,
                      2 if args.quick else 1)  # --quick: a check, not a measurement
    return {"ops": ops, "workers": 1, "batch_size": args.batch_size, "rows": out}


def markdown_lines(section: dict[str, Any]) -> list[str]:
    lines = [f"### The training process's share: a launch-bound step ({section['ops']} tiny torch operations, "
             f"batch {section['batch_size']}, {section['workers']} decode worker)", "",
             "| fed by | step ms, fed (range) | step ms, the fixed batch | fixed / fed (range) | feedline's CPU a "
             "batch in the training process | wake-ups a batch |", "|---|---:|---:|---:|---:|---:|"]
    for name, row in section["rows"].items():
        lo, hi = row.get("range", {}).get("step_ms", (row["step_ms"],) * 2)
        a, b = row.get("range", {}).get("speed", (row["speed"],) * 2)
        cpu = f"{row['trainer_ms_per_batch']:.3f} ms" if "trainer_ms_per_batch" in row else "—"
        wake = f"{row['wakeups_per_batch']:.2f}" if "wakeups_per_batch" in row else "—"
        lines.append(f"| {name} | {row['step_ms']:.2f} ({lo:.2f}-{hi:.2f}) | {row['fixed_step_ms']:.2f} | "
                     f"{row['speed']:.2f}x ({a:.2f}-{b:.2f}) | {cpu} | {wake} |")
    return lines + ["", "Each row's process times the step alone (a chain of small matrix products and element-wise "
                        "operations on one thread, as a launching thread issues kernels) in turns of a quarter second: "
                        "on its loader's batches, then on one batch made once; the ratio is the two medians' (1.00x: "
                        "as fast as with the data already there), the median of the rounds. On a machine of few "
                        "cores the decode worker also competes with the step for them: read the ratio beside the "
                        "CPU figure, which is feedline's own (the loader's counters, `StagingLoader.cost()`).", ""]


def launch_targets(section: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, row in section["rows"].items():
        a, b = row.get("range", {}).get("speed", (row["speed"],) * 2)
        out.append({"target": f"a launch-bound step fed by {name}: the fixed batch's step time over the fed one's "
                              f"(a row)", "value": f"{row['speed']:.2f}x ({a:.2f}-{b:.2f})", "met": None})
    return out
