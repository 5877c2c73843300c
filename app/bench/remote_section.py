"""The bench's ``remote`` section (issue 70): one host as two machines by CPU sets, JPEG decoded where the CPUs are.

The "GPU node" is CPU 0: the training process (each row's process, under ``taskset``), its local worker, and a
Ray head node offering no CPUs to actors (as docs/remote.md tells a GPU host to join); the "Ray node" is CPU 1,
a second Ray node (``ray start`` under ``taskset``) with one CPU. Each node has its own object store and nothing
is shared between them: every batch decoded there crosses over TCP (the place's own stream), as between machines. Rows (``remote_bench.py``), in
interleaved rounds: feedline with its one local worker; feedline with that worker and one place decoded by an
actor on the Ray node (target >= 1.7x local only); and, on a cluster of the same two CPU sets started from
``.venv-raydata`` (Ray Data needs pandas, which .venv does not carry) whose head offers its CPU too, Ray Data's
own ingest of the same shards (target: feedline local + remote >= 1.5x it). The training process's CPU a batch
is each row's own process's CPU over its batches.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from .ray_nodes import RayNodes
from .rounds import Contender, fmt_ratio, interleaved, ratio

LOCAL = "feedline, local only (1 worker on the GPU node's CPU)"
REMOTE = "feedline, local + remote (that worker, and 1 place on the Ray node's CPU)"
AUTO = "feedline, workers=auto with the cluster (local first, the cluster's places as the wait asks)"
RAYDATA = "Ray Data (read_webdataset, map_batches decode + crop, iter_torch_batches) on both CPUs"
RAYDATA_VENV = ".venv-raydata"
GPU_NODE, RAY_NODE = "0", "1"
# the cluster settings docs/remote.md gives: a batch travels inside its call's messages, not through the object stores
INLINE = {"max_direct_call_object_size": 16 << 20, "task_rpc_inlined_bytes_limit": 64 << 20}


def raydata_bin() -> str | None:
    """``.venv-raydata``'s bin folder when ``scripts/setup-ray-data`` made it, else None (its row is left out)."""
    path = os.path.join(RAYDATA_VENV, "bin")
    return path if os.path.exists(os.path.join(path, "ray")) else None


def remote_workload(args: argparse.Namespace, shards: str, run_json: Callable[..., dict[str, Any]]
                    ) -> dict[str, Any]:
    if len(os.sched_getaffinity(0)) < 2:
        return {"skipped": "needs 2 CPUs: one for the GPU node, one for the Ray node"}
    seconds = 4.0 if args.quick else args.seconds

    def contender(row: str, name: str, nodes: RayNodes, python: str) -> Contender:
        cmd = ["taskset", "-c", GPU_NODE, python, "-m", "feedline.bench.remote_bench", name, "--shards", shards,
               "--address", nodes.address, "--batch-size", str(args.batch_size),
               "--warmup-batches", "2" if args.quick else "8"]
        return Contender(row, lambda t: run_json([*cmd, "--seconds", str(t)], nodes.env, "remote", row))

    rounds = 1 if args.quick else args.rounds
    with RayNodes(cpus=0, taskset=GPU_NODE, system_config=INLINE) as nodes:  # the GPU node: no CPUs for actors
        nodes.add_node(1, taskset=RAY_NODE)
        rows = interleaved([contender(LOCAL, "local", nodes, sys.executable),
                            contender(REMOTE, "remote", nodes, sys.executable),
                            contender(AUTO, "auto", nodes, sys.executable)], rounds, seconds,
                           0.0 if args.quick else args.warmup, 1)
    out: dict[str, Any] = {"batch_size": args.batch_size, "rows": rows}
    bin_dir = raydata_bin()
    if bin_dir is None:
        out["raydata"] = f"left out: {RAYDATA_VENV} is missing (./scripts/setup-ray-data makes it)"
        return out
    with RayNodes(cpus=1, taskset=GPU_NODE, bin_dir=bin_dir) as nodes:  # Ray Data may use both CPUs
        nodes.add_node(1, taskset=RAY_NODE)
        rows.update(interleaved([contender(RAYDATA, "raydata", nodes, os.path.join(bin_dir, "python"))], rounds,
                                seconds, 0.0 if args.quick else args.warmup, 1))
    return out


def markdown_lines(section: dict[str, Any]) -> list[str]:
    if "skipped" in section:
        return ["### Remote decode (Ray)", "", f"Skipped: {section['skipped']}.", ""]
    rows = section["rows"]
    lines = [f"### Remote decode (Ray): JPEG, RandomResizedCrop 224, batch {section['batch_size']}; one host as two "
             "machines (CPU 0: the GPU node, CPU 1: a Ray node)", "",
             "| row | samples/s reaching the loop (range) | vs local only (range) | training process CPU a batch |"
             " batches by place |", "|---|---:|---:|---:|---|"]
    for name, row in rows.items():
        lo, hi = row.get("range", {}).get("samples_per_s", (row["samples_per_s"],) * 2)
        vs = "1.00x" if name == LOCAL else fmt_ratio(ratio(row, rows[LOCAL]))
        places = row.get("batches_by_place")
        grown = f" ({row['workers']} places)" if name == AUTO and "workers" in row else ""
        lines.append(f"| {name}{grown} | {row['samples_per_s']:.0f} ({lo:.0f}-{hi:.0f}) | {vs} | "
                     f"{row['cpu_ms_per_batch']:.2f} ms | "
                     f"{', '.join(f'{k} {v}' for k, v in places.items()) if places else '—'} |")
    per = rows.get(REMOTE, {}).get("bytes_per_sample")
    lines += ["", "Each node is a Ray node with its own object store; the GPU node offers no CPUs to actors, so "
                  "the remote place's actor runs on CPU 1 and each of its batches crosses between the nodes over "
                  "TCP on the place's own stream ([remote.md](remote.md#running-it)): the encoded samples out, "
                  "sent from the shard's mapping, and the slot back, received straight into the ring; Ray places "
                  "the actor and carries the stream's key. The "
                  "training process (each row's process) runs on CPU 0 with the local worker and the remote "
                  "place's proxy process; its CPU a batch is all of its threads' CPU over its batches. The places "
                  "deliver in turn, so the pair runs at twice the slower one: the local worker, which shares CPU 0 "
                  "with the proxy (reading and sending the samples, receiving the slots) and the GPU node's "
                  "raylet. The workers=auto row starts with the one local place (the GPU node's one CPU), asks the "
                  "cluster its CPUs at start (1 for actors: at most 1 place there), and grows onto it when the "
                  "loop waits; it is timed once the tuning is done and the grown place's actor decodes (a place decodes "
                  "here until its actor is up; the first minute of warm-up at most). "
                  "Ray Data runs "
                  "on a cluster of the same two CPU sets whose head offers its CPU as well (it has no local workers "
                  "of its own), with Ray's default settings, its per-sample work the DataLoader baseline's (stock "
                  "Pillow, full decode, then the crop)."
                  + (f" On the wire, a remote sample: {per['sent'] / 1024:.1f} KiB of encoded members out, "
                     f"{per['received'] / 1024:.1f} KiB of slot back." if per else "")]
    if isinstance(section.get("raydata"), str):
        lines += ["", f"Ray Data's row: {section['raydata']}."]
    return lines + [""]


def remote_targets(section: dict[str, Any]) -> list[dict[str, Any]]:
    rows = section.get("rows", {})
    out = []
    if LOCAL in rows and REMOTE in rows:
        r = ratio(rows[REMOTE], rows[LOCAL])
        out.append({"target": "remote: local + remote decode >= 1.7x local only (one CPU each, JPEG, crop 224)",
                    "value": fmt_ratio(r), "met": r[0] >= 1.7})
        cpu = rows[REMOTE]["cpu_ms_per_batch"] / max(1e-9, rows[LOCAL]["cpu_ms_per_batch"])
        out.append({"target": "remote: the training process's CPU a batch with remote decoding <= with local "
                              "workers only", "value": f"{rows[REMOTE]['cpu_ms_per_batch']:.2f} vs "
                                                       f"{rows[LOCAL]['cpu_ms_per_batch']:.2f} ms",
                    "met": cpu <= 1.0})
    if LOCAL in rows and AUTO in rows:
        r = ratio(rows[AUTO], rows[LOCAL])
        out.append({"target": "remote: workers=auto with the cluster (the places by the measured wait) >= 1.7x "
                              "local only", "value": fmt_ratio(r) + f", {rows[AUTO].get('workers', '?')} places",
                    "met": r[0] >= 1.7})
    if REMOTE in rows and RAYDATA in rows:
        r = ratio(rows[REMOTE], rows[RAYDATA])
        out.append({"target": "remote: feedline local + remote >= 1.5x Ray Data's own ingest on the same CPUs",
                    "value": fmt_ratio(r), "met": r[0] >= 1.5})
    return out
