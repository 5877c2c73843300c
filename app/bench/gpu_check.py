"""``scripts/gpu-check``'s measurements: the CUDA path's bench sections, each a ratio in one run, and the
results file (JSON and a markdown table, the device named and dated).

A GPU is lent now and then for minutes, so this runs what the CUDA path's targets need and nothing else,
each section within what is left of the check's deadline (a section that would not fit says so):

- ``placement`` (first: issue 69): at batch 256, synthetic alone, beside the loader at full tilt unplaced and
  placed, feedline unplaced and placed at 4, 8 and 12 workers and placed with ``workers="auto"``, DataLoader,
  and the CPU topology (``gpu_placement.py``); the sections after it run while the budget lasts;
- ``raw``: 1 MiB samples to the device, feedline against ``DataLoader`` (pinned, ``non_blocking``), and the
  training process's own CPU per wall second;
- ``decode``: ``device_decode`` against CPU decode (decode + RandomResizedCrop in the workers), same workers;
- ``h2d``: the loader's copy bandwidth (bytes over the copies' own time) against torch's pinned copy;
- ``e2e`` (batch 32, the launch-bound case) and ``e2e-256``: a ResNet-50 step fed by synthetic data on the
  device, feedline, feedline with ``device_decode`` and ``DataLoader``, every contender with ``drop_last`` (no
  epoch's end brings a new shape); at batch 32 the diagnosis runs in the same check (``_e2e_why``): the
  synthetic step with a loader running beside it, ``transfer_threads`` 1 and 2, the path before ``h2d="slot"``
  (``h2d="fields"``), and the interpreter's switch interval swept, each with the step's device time traced and
  the loader's own counters a batch (its CPU, wake-ups, device calls on the loop's thread).

Every contender runs in its own process (``contenders.py``, ``e2e.py``), in interleaved rounds
(``rounds.py``). ``--dry-run`` (no CUDA) runs what does not need it (the datasets) and reports every section
"skipped: no CUDA"; ``--rehearse`` also runs each section's contenders once, briefly, on the CPU, so that a
command line that would fail on the GPU machine fails here first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .gpu_data import datasets, to_shm
from .gpu_placement import COST as PLACEMENT_COST
from .gpu_placement import section as placement_section
from .gpu_results import PROFILE_SECONDS, SECTIONS, markdown
from .rounds import Contender, interleaved, ratio

COST = {"placement": PLACEMENT_COST, "raw": 60, "decode": 70, "h2d": 5, "e2e": 80,  # about the seconds each
        "e2e-256": 60}  # takes on an H100 host
WHY_COST = 90  # the e2e section's diagnosis: seven contenders once
DIAGNOSIS = {  # row: the e2e command's arguments (feed first)
    "synthetic, a loader running beside it": ("synthetic-beside",),
    "feedline, 1 transfer thread": ("feedline", "--transfer-threads", "1"),
    "feedline, 2 transfer threads": ("feedline", "--transfer-threads", "2"),
    "feedline, h2d=fields, 2 transfer threads (the path before)": ("feedline", "--h2d", "fields",
                                                                   "--transfer-threads", "2"),
    "feedline, switch interval 0.5 ms": ("feedline", "--switch-interval", "0.0005"),
    "feedline, switch interval 50 ms": ("feedline", "--switch-interval", "0.05"),
    "feedline, h2d=fields, 2 threads, switch interval 50 ms": ("feedline", "--h2d", "fields", "--transfer-threads",
                                                                "2", "--switch-interval", "0.05"),
}
PROFILE_COST = 25  # seconds a py-spy profile of one contender takes


def _bench_args(args: argparse.Namespace, workers: int) -> argparse.Namespace:
    """The benchmark runner's settings for one contender process."""
    from .runner import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args([])
    ns.workers, ns.seconds, ns.batch_size = workers, args.seconds, args.batch_size
    import torch

    ns.standin = args.rehearse and not torch.cuda.is_available()
    return ns


def _contender(row: str, workload: str, shards: str, ns: argparse.Namespace, *extra: str) -> Contender:
    from .contend import _contender as run_one

    feedline = row.startswith("feedline")
    if feedline and ns.standin:  # a rehearsal without CUDA: the device path's code, on the stand-in
        extra = (*extra, "--device", "standin")
    return Contender(row, lambda t: run_one("feedline" if feedline else "dataloader", workload, shards, ns, *extra,
                                            seconds=t))


def _section_raw(args: argparse.Namespace, data: dict[str, str]) -> dict[str, Any]:
    ns = _bench_args(args, args.workers)
    rows = interleaved([_contender("feedline", "raw", data["raw"], ns, "--zero-copy"),
                        _contender("DataLoader (pinned, non_blocking)", "raw", data["raw"], ns)],
                       args.rounds, args.seconds, args.warmup)
    feed, base = rows["feedline"], rows["DataLoader (pinned, non_blocking)"]
    r = ratio(feed, base)
    cpu = feed["main_cpu_pct"]
    share = f", {feed['trainer_ms_per_batch']:.3f} ms a batch" if "trainer_ms_per_batch" in feed else ""
    return {"rows": rows, "ratio": r, "main_cpu_pct": cpu, "met": r[0] >= 5.0 and cpu <= 10.0,
            "summary": f"{r[0]:.2f}x DataLoader ({r[1]:.2f}-{r[2]:.2f}); training process CPU {cpu:.1f} % of a "
                       f"core{share}"}


def _section_decode(args: argparse.Namespace, data: dict[str, str]) -> dict[str, Any]:
    ns = _bench_args(args, args.workers)
    rows = interleaved([_contender("feedline, CPU decode", "jpeg", data["jpeg"], ns, "--zero-copy"),
                        _contender("feedline, device_decode", "jpeg", data["jpeg"], ns, "--zero-copy",
                                   "--device-decode")], args.rounds, args.seconds, args.warmup)
    r = ratio(rows["feedline, device_decode"], rows["feedline, CPU decode"])
    return {"rows": rows, "ratio": r, "met": r[0] >= 2.0,
            "summary": f"device_decode {r[0]:.2f}x CPU decode ({r[1]:.2f}-{r[2]:.2f}) at {args.workers} workers"}


def _section_h2d(args: argparse.Namespace, raw: dict[str, Any] | None) -> dict[str, Any]:
    from .contend import _cuda_copy_bandwidth

    torch_copy = _cuda_copy_bandwidth()
    assert torch_copy is not None
    out: dict[str, Any] = {"torch": torch_copy, "met": None}
    loader = (raw or {}).get("rows", {}).get("feedline", {}).get("h2d_gb_per_s")
    if loader is None:
        out["summary"] = f"torch's pinned copy {torch_copy['pinned_gb_per_s']:.1f} GB/s (the raw section did not run)"
        return out
    out["loader_gb_per_s"] = loader
    out["ratio"] = (loader / torch_copy["pinned_gb_per_s"],) * 3
    out["summary"] = (f"the loader's copies {loader:.1f} GB/s, torch's pinned copy "
                      f"{torch_copy['pinned_gb_per_s']:.1f} GB/s ({out['ratio'][0]:.0%}); pageable "
                      f"{torch_copy['pageable_gb_per_s']:.1f} GB/s")
    return out


def _section_e2e(args: argparse.Namespace, data: dict[str, str], batch: int, diagnose: bool) -> dict[str, Any]:
    from .report import CEILING
    from .contend import _run_json

    def c(row: str, feed: str, *extra: str) -> Contender:
        cmd = _e2e_cmd(args, data, feed, args.e2e_steps, batch, *extra)
        return Contender(row, lambda t: _run_json(cmd, dict(os.environ), "e2e", " ".join([feed, *extra])))

    rows = interleaved([c(CEILING, "synthetic"), c("feedline", "feedline"),
                        c("feedline, device_decode", "feedline", "--device-decode"),
                        c("DataLoader (pinned, non_blocking)", "dataloader")],
                       args.e2e_rounds if diagnose else 1, args.seconds, 0.0)
    ratios = {row: ratio(rows[row], rows[CEILING]) for row in rows if row != CEILING}
    r = ratios["feedline"]
    why = None
    if diagnose and args.deadline - time.time() > WHY_COST * (0.2 if args.rehearse else 1.0):
        try:
            why = _e2e_why(args, data, batch)
        except Exception as exc:  # the diagnosis must not lose the section's figures
            why = {"the diagnosis": {"failed": f"{type(exc).__name__}: {exc}"[-1000:]}}
    return {"rows": rows, "ratios": ratios, "ratio": r, "met": r[0] >= 0.95, "batch_size": batch,
            **({"why": why} if why else {}),
            "summary": (f"batch {batch}: feedline {r[0]:.0%} of synthetic ({r[1]:.0%}-{r[2]:.0%}); device_decode "
                        f"{ratios['feedline, device_decode'][0]:.0%}; DataLoader "
                        f"{ratios['DataLoader (pinned, non_blocking)'][0]:.0%}")}


def _e2e_why(args: argparse.Namespace, data: dict[str, str], batch: int) -> dict[str, Any]:
    """The e2e step taken apart, each contender once, each with 4 more steps under torch's profiler (the step's
    device time against its wall time): a loader running beside the synthetic step (does its mere presence slow
    the step?), transfer threads 1 and 2 and the path before h2d="slot" against the default (no thread), and
    the interpreter's switch interval (how often a thread that wants the GIL takes it from the loop)."""
    from .contend import _run_json

    out = {}
    for row, (feed, *extra) in DIAGNOSIS.items():
        cmd = _e2e_cmd(args, data, feed, args.e2e_steps, batch, *extra, "--trace-steps", "4")
        try:
            out[row] = _run_json(cmd, dict(os.environ), "e2e", f"{row} (why)")
        except RuntimeError as exc:
            out[row] = {"failed": str(exc)[-1000:]}
    return out


def _e2e_cmd(args: argparse.Namespace, data: dict[str, str], feed: str, steps: int, batch: int,
             *extra: str) -> list[str]:
    import torch

    standin = ("--device", "standin") if args.rehearse and not torch.cuda.is_available() else ()
    return [sys.executable, "-m", "feedline.bench.e2e", feed, "--shards", data["jpeg"], "--model", args.e2e_model,
            "--workers", str(args.e2e_workers), "--batch-size", str(batch), "--steps", str(steps),
            "--warmup", "5", "--image-size", "224" if args.e2e_model == "resnet50" else "32", "--drop-last",
            *standin, *extra]


def _profiles(args: argparse.Namespace, data: dict[str, str], sections: dict[str, Any], out_dir: str) -> None:
    """Each measured section's feedline contender once more, under py-spy, the missed targets first, while the
    check's budget lasts: where its CPU went comes back in the same run (``profiles.md``)."""
    from . import pyspy
    from .contend import _contender

    ran = [n for n in ("raw", "decode", "e2e") if "rows" in sections.get(n, {})]
    ran.sort(key=lambda n: sections[n].get("met") is not False)  # the missed ones first
    seconds = 2.0 if args.rehearse else PROFILE_SECONDS
    texts = []
    for name in ran:
        left = args.deadline - time.time()
        if pyspy.binary() is None:
            sections[name]["profile"] = {"skipped": "py-spy is not on PATH"}
            continue
        if left < PROFILE_COST * (0.2 if args.rehearse else 1.0):
            sections[name]["profile"] = {"skipped": f"out of time ({left:.0f} s left)"}
            continue
        print(f"gpu-check: profile of {name} ({left:.0f} s left)", file=sys.stderr, flush=True)
        got: dict[str, Any] = {}

        def launch(cmd: list[str], env: dict[str, str], *_: str) -> dict[str, Any]:
            result, raw, problem = pyspy.record(cmd, env, seconds)
            got.update(result=result, raw=raw, problem=problem)
            return result or {}

        run_for = seconds + 3  # the timed part: py-spy starts half a second into it
        if name == "e2e":
            batch = sections["e2e"]["batch_size"]
            rate = sections["e2e"]["rows"]["feedline"]["samples_per_s"]
            steps = max(10, min(2000, int(rate * run_for / batch)))
            launch(_e2e_cmd(args, data, "feedline", steps, batch), dict(os.environ))
            title = f"e2e: {args.e2e_model} fed by feedline, batch {batch} ({args.e2e_workers} workers)"
        else:
            extra = ("--zero-copy",) if name == "raw" else ("--zero-copy", "--device-decode")
            _contender("feedline", "raw" if name == "raw" else "jpeg", data[name if name == "raw" else "jpeg"],
                       _bench_args(args, args.workers), *extra, seconds=run_for, launch=launch)
            title = f"{name}: feedline {' '.join(extra)} ({args.workers} workers)"
        summary = pyspy.summarize(got.get("raw", ""))
        sections[name]["profile"] = {"summary": summary, "problem": got.get("problem", ""), "seconds": seconds,
                                     "samples_per_s": (got.get("result") or {}).get("samples_per_s")}
        texts.append(pyspy.markdown(title, summary, seconds)
                     + (f"\n{got['problem']}\n" if got.get("problem") else ""))
    if texts:
        with open(os.path.join(out_dir, "profiles.md"), "w") as f:
            f.write("# gpu-check: where the CPU went\n\n" + "\n".join(texts))


def machine() -> dict[str, Any]:
    import platform

    import PIL
    import torch

    info: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                            "torch": torch.__version__, "pil": PIL.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
    from ..formats import fastjpeg

    info["crop_decoder"] = fastjpeg.status()[1]
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import torch

    cuda = torch.cuda.is_available()
    results: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
                               "settings": {k: getattr(args, k) for k in ("workers", "batch_size", "seconds",
                                                                          "rounds", "e2e_workers", "e2e_steps",
                                                                          "e2e_rounds", "e2e_batch_sizes",
                                                                          "raw_samples", "jpeg_samples")},
                               "steps": _steps(args.steps), "sections": {}}
    sections = results["sections"]
    t0 = time.monotonic()
    batches = [int(b) for b in str(args.e2e_batch_sizes).split(",")]
    data = datasets(args.raw_samples, args.jpeg_samples, args.e2e_workers * max(batches), args.cache_dir)
    results["datasets_seconds"] = round(time.monotonic() - t0, 1)
    if (args.dry_run or not cuda) and not args.rehearse:
        for name in SECTIONS:
            sections[name] = {"skipped": "no CUDA" if not cuda else "a dry run"}
        return results
    shm = tempfile.mkdtemp(prefix="feedline-gpu-check-", dir="/dev/shm")
    try:
        data = to_shm(data, shm)
        for name in SECTIONS:
            left = args.deadline - time.time()
            if name == "h2d" and not cuda:
                sections[name] = {"skipped": "no CUDA"}
                continue
            if left < COST[name] * (0.2 if args.rehearse else 1.0):
                sections[name] = {"skipped": f"out of time ({left:.0f} s left of the check's budget, "
                                             f"the section takes about {COST[name]} s)"}
                continue
            print(f"gpu-check: section {name} ({left:.0f} s left)", file=sys.stderr, flush=True)
            try:
                if name == "h2d":
                    sections[name] = _section_h2d(args, sections.get("raw"))
                elif name == "placement":  # where a fed step loses to synthetic data, at the large batch
                    from .contend import _run_json

                    sections[name] = placement_section(
                        lambda feed, batch, *extra: _e2e_cmd(args, data, feed, args.e2e_steps, batch, *extra),
                        _run_json, batches[-1], args.e2e_workers)
                elif name == "e2e":  # the launch-bound batch, taken apart in the same run
                    sections[name] = _section_e2e(args, data, batches[0], diagnose=True)
                elif name == "e2e-256":
                    sections[name] = _section_e2e(args, data, batches[-1], diagnose=False)
                else:
                    sections[name] = {"raw": _section_raw, "decode": _section_decode}[name](args, data)
            except Exception as exc:  # one section's failure must not lose the others' figures
                sections[name] = {"failed": f"{type(exc).__name__}: {exc}"[-2000:]}
            if not cuda:
                sections[name]["rehearsal"] = "on the CPU: the commands ran, nothing was measured"
        try:
            _profiles(args, data, sections, args.out)
        except Exception as exc:  # the profiles must not lose the sections' figures
            results["profiles_failed"] = f"{type(exc).__name__}: {exc}"[-2000:]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return results


def _steps(path: str | None) -> list[dict[str, Any]]:
    """The shell script's steps before this one (wheels, build, tests), one JSON object a line."""
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def record(results_path: str, notes: list[str], bench_json: str = os.path.join("docs", "benchmarks.json"),
           bench_md: str = os.path.join("docs", "benchmarks.md")) -> str:
    """A lent machine's results.json kept in ``docs/benchmarks.json`` under its host (the bench's CUDA host
    label), with what the run's reader must know (``notes``), and ``docs/benchmarks.md`` rendered again."""
    from .report import render_markdown

    with open(results_path) as f:
        results = json.load(f)
    host = "cuda-" + results["machine"]["gpu"].replace(" ", "-")
    with open(bench_json) as f:
        doc = json.load(f)
    if "machine" not in doc.get(host, {}):
        raise SystemExit(f"{bench_json} has no bench run of {host}: run ./scripts/bench there first")
    doc[host]["gpu_check"] = {**results, "notes": notes}
    with open(bench_json, "w") as f:
        json.dump(doc, f, indent=2)
    with open(bench_md, "w") as f:
        f.write(render_markdown(doc))
    return host


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["record"]:  # here, after a lent machine's run: python -m feedline.bench.gpu_check record F [NOTE]
        print(f"recorded under {record(argv[1], argv[2:])} in docs/benchmarks.json and docs/benchmarks.md")
        return 0
    cpus = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(prog="python -m feedline.bench.gpu_check")
    p.add_argument("--out", required=True, help="folder for results.json and results.md")
    p.add_argument("--steps", help="the shell script's steps so far (JSON lines)")
    p.add_argument("--deadline", type=float, default=time.time() + 420, help="epoch seconds by which to finish")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--rehearse", action="store_true", help="without CUDA: run each section's contenders briefly")
    p.add_argument("--workers", type=int, default=max(1, min(8, cpus // 2)))
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--raw-samples", type=int, default=512)
    p.add_argument("--jpeg-samples", type=int, default=2048)
    p.add_argument("--e2e-model", choices=("resnet50", "tiny"), default="resnet50")
    p.add_argument("--e2e-workers", type=int, default=max(1, cpus - 4))
    p.add_argument("--e2e-batch-sizes", default="32,256", help="the e2e section's batch, then e2e-256's")
    p.add_argument("--e2e-steps", type=int, default=30)
    p.add_argument("--e2e-rounds", type=int, default=2)
    p.add_argument("--cache-dir", default=os.path.join("build", "gpu-check", "cache"))
    args = p.parse_args(argv)
    if args.rehearse:  # the commands, not a measurement: as short as they go
        args.rounds = args.e2e_rounds = 1
        args.seconds, args.warmup, args.e2e_steps, args.e2e_model = 0.5, 0.0, 2, "tiny"
        args.e2e_batch_sizes, args.workers, args.e2e_workers = "8,16", min(args.workers, 2), min(args.e2e_workers, 2)
    results = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=list)
    text = markdown(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
