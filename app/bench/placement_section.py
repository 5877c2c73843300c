"""The bench's ``placement`` section (issue 69): a launch-bound step alone, beside the loader decoding JPEG at full
tilt unplaced, and beside it placed (``placement_bench.py``) — the cause of a GPU step slowed though fed, shown on
this host's CPUs.

The step is calibrated once (about 8 ms of tiny torch operations on one thread); every row is its own process, in
interleaved rounds. A row's figure is the step's median time; its speed is the step alone's time over its own,
the median of the per-round ratios (1.00: as fast as with nothing beside it). The rows: the step alone; beside
the loader at full tilt (a thread takes its batches and drops them, the step runs back to back: contention and
nothing else) with placement off and two workers (as every run was before placement: the workers go where the
kernel puts them), with the defaults a user gets (``workers="auto"``, ``cpu_placement="auto"``): the target,
>= 95 % of alone, and placed with two workers, which then share the workers' CPUs; and last the step fed by the
loader with the defaults, waiting for each batch (on 2 CPUs one worker cannot keep up with the step: each step
follows a wait, which the row's share of time waiting says).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .placement_bench import IMAGE
from .rounds import Contender, fmt_ratio, interleaved, ratio

ALONE = "the step alone"
UNPLACED = 'beside feedline at full tilt, unplaced (cpu_placement="off", 2 workers)'
PLACED = 'beside feedline at full tilt, placed (the defaults: workers="auto", cpu_placement="auto")'
PLACED_TWO = 'beside feedline at full tilt, placed, 2 workers'
FED = 'fed by feedline, placed (the defaults), waiting for each batch'
ROWS = {ALONE: ("alone",), UNPLACED: ("beside", "--cpu-placement", "off", "--workers", "2"),
        PLACED: ("beside", "--cpu-placement", "auto", "--workers", "auto"),
        PLACED_TWO: ("beside", "--cpu-placement", "auto", "--workers", "2"),
        FED: ("fed", "--cpu-placement", "auto", "--workers", "auto")}


def placement_workload(args: argparse.Namespace, shards: str, run_json: Callable[..., dict[str, Any]]
                       ) -> dict[str, Any]:
    base = [sys.executable, "-m", "feedline.bench.placement_bench"]
    print("  placement: calibrating the step to about 8 ms ...", file=sys.stderr, flush=True)
    cal = subprocess.run([*base, "calibrate", "--batch-size", str(args.batch_size)], capture_output=True, text=True,
                         timeout=300, check=True)
    ops = int(json.loads(cal.stdout.strip().splitlines()[-1])["ops"])

    def c(row: str, mode: str, *extra: str) -> Contender:
        cmd = [*base, mode, "--shards", shards, "--ops", str(ops), "--batch-size", str(args.batch_size),
               "--warmup-steps", "3" if args.quick else "20", *extra]
        return Contender(row, lambda t: run_json([*cmd, "--seconds", str(t)], None, "placement", row))

    rows = interleaved([c(row, *how) for row, how in ROWS.items()], args.rounds, args.seconds,
                       0.0 if args.quick else args.warmup, 2 if args.quick else 1)  # --quick: a check only
    return {"ops": ops, "batch_size": args.batch_size, "rows": rows}


def _speed(section: dict[str, Any], row: str) -> tuple[float, float, float]:
    rows = section["rows"]
    return ratio(rows[row], rows[ALONE])


def markdown_lines(section: dict[str, Any]) -> list[str]:
    lines = [f"### CPU placement: a launch-bound step ({section['ops']} tiny torch operations, batch "
             f"{section['batch_size']}) beside the loader decoding JPEG at full tilt", "",
             "| the step | step ms (range) | speed vs alone (range) | time waiting for a batch | the loader's threads "
             "in the training process | the stand-in's copies | workers | placement |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, row in section["rows"].items():
        lo, hi = row.get("range", {}).get("step_ms", (row["step_ms"],) * 2)
        speed = "1.00x" if name == ALONE else fmt_ratio(_speed(section, name))
        waiting = f"{row['wait_share']:.0%}" if "wait_share" in row and name != ALONE else "—"
        shares = " | ".join(f"{row[k]:.1%}" if k in row else "—" for k in ("loader_cpu_share", "standin_copy_share"))
        lines.append(f"| {name} | {row['step_ms']:.2f} ({lo:.2f}-{hi:.2f}) | {speed} | {waiting} | {shares} | "
                     f"{row.get('workers', '—')} | {row.get('placement', '—')} |")
    return lines + ["", "Each row is a process of its own, in interleaved rounds. The step is one thread of small "
                        "matrix products and element-wise operations, as a launching thread issues kernels, on a "
                        "fixed input, and only the step is timed. Beside the loader at full tilt, a thread of the "
                        "training process takes every batch of JPEG photos decoded and cropped (RandomResizedCrop "
                        "224) by workers running as fast as they can, and drops it, while the step runs back to "
                        "back: what the loader's processes and threads take from the step, and nothing else. Fed, "
                        "the loop takes a batch before each step, as a training loop does, and waits when none is "
                        "ready. Placed, the training process keeps cores of its own and the workers run on the "
                        "others ([loader.md](loader.md#cpu-placement)). The loader's threads and the stand-in's "
                        "copies are CPU time a second of the timed part (the median of the rounds), both in the "
                        "training process: placed, on the step's own core. The stand-in device copies each batch "
                        f"({section['batch_size']} x {IMAGE} x {IMAGE} x 3 bytes) with a memcpy on the thread that "
                        "takes it, where a GPU's copy engine would: a cost a GPU host's launching core does not pay, "
                        "which the rows pay here.", ""]


def placement_targets(section: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name in (UNPLACED, PLACED_TWO, FED):
        if name in section["rows"]:
            out.append({"target": f"placement: the step {name} vs alone (a row)",
                        "value": fmt_ratio(_speed(section, name)), "met": None})
    if PLACED in section["rows"]:
        r = _speed(section, PLACED)
        out.append({"target": "placement: a launch-bound step beside the loader at full tilt with the defaults "
                              "(workers=\"auto\", cpu_placement=\"auto\") >= 95 % of alone",
                    "value": fmt_ratio(r), "met": r[0] >= 0.95})
    return out
