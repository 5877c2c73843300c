"""``feedline bench`` / ``scripts/bench``: every contender on the same shards in /dev/shm, in one run.

Writes ``docs/benchmarks.json`` (merged per host, so a CPU run and a GPU run
both stay) and renders ``docs/benchmarks.md`` from it. Ratios, not absolute
numbers, are what carries between machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from ..config import parse_size
from ..formats.datasets import make_dataset

log = logging.getLogger("feedline.bench")

STOCK_PILLOW = os.path.join(".venv", "stock-pillow")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0, help="measured time per contender")
    p.add_argument("--raw-samples", type=int, default=1024, help="1 MiB samples in the raw workload")
    p.add_argument("--jpeg-samples", type=int, default=4000)
    p.add_argument("--sample-size", default="1MiB")
    p.add_argument("--workloads", default="raw,jpeg,sampler")
    p.add_argument("--shm", default="/dev/shm", help="where the shards live during the run")
    p.add_argument("--cache-dir", default=".cache")
    p.add_argument("--json", default="docs/benchmarks.json")
    p.add_argument("--markdown", default="docs/benchmarks.md")
    p.add_argument("--host", default="", help="label of this machine in the report (default: detected)")


def _host_label() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda-{torch.cuda.get_device_name(0).replace(' ', '-')}"
    except ImportError:
        pass
    return f"cpu-{os.cpu_count()}core"


def _machine() -> dict[str, Any]:
    import PIL
    import torch

    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                            "pil": PIL.__version__, "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _dataset(kind: str, count: int, sample_bytes: int, cache_dir: str) -> str:
    """Shards on local disk, made once per parameter set."""
    outdir = os.path.join(cache_dir, "bench", f"{kind}-{count}-{sample_bytes}")
    if not os.path.exists(os.path.join(outdir, "complete")):
        log.warning("making the %s dataset (%d samples) in %s", kind, count, outdir)
        per_sample = sample_bytes if kind == "raw" else 60_000  # a ~500x375 JPEG is 40-80 kB
        # 32 shards, so that each worker gets as many: an epoch's tail (the last worker finishing
        # its last shard while the others idle) is then a small share of a short benchmark epoch
        shard_bytes = max(1 << 20, count * per_sample // 32)
        make_dataset(kind, outdir, count, shard_bytes, cache_dir, sample_bytes)
        open(os.path.join(outdir, "complete"), "w").close()
    return outdir


def _pil_is_simd() -> bool:
    """Where the PIL in use is stock Pillow already (a GPU image, say), it is the baseline as it is."""
    import PIL

    return PIL.__version__.endswith(".post0")


def _contender(name: str, workload: str, shards: str, args: argparse.Namespace, *extra: str,
               stock_pillow: bool = False, seconds: float | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    if stock_pillow and _pil_is_simd():
        if not os.path.isdir(STOCK_PILLOW):
            raise RuntimeError(f"{STOCK_PILLOW} is missing; run ./scripts/setup")
        env["PYTHONPATH"] = os.path.abspath(STOCK_PILLOW) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "app.bench.contenders", name, "--workload", workload, "--shards", shards,
           "--workers", str(args.workers), "--batch-size", str(args.batch_size),
           "--seconds", str(seconds if seconds is not None else args.seconds),
           "--sample-bytes", str(parse_size(args.sample_size)), *extra]
    label = " ".join([name, *extra]) + (" (stock Pillow)" if stock_pillow and _pil_is_simd() else "")
    print(f"  {workload:5s} {label} ...", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"contender {label} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["label"] = label
    print(f"        {result['samples_per_s']:9.1f} samples/s"
          + (f"  {result['mb_per_s']:9.1f} MB/s  main CPU {result['main_cpu_pct']:5.1f} %" if "mb_per_s" in result
             else ""), file=sys.stderr, flush=True)
    return result


def _cuda_copy_bandwidth() -> dict[str, float] | None:
    """Pinned host -> device bandwidth torch reaches on this machine (the H2D ceiling)."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    pinned = reps * n / (time.perf_counter() - t0) / 1e9
    pageable = torch.empty(n, dtype=torch.uint8)
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(pageable)
    torch.cuda.synchronize()
    return {"pinned_gb_per_s": pinned, "pageable_gb_per_s": 5 * n / (time.perf_counter() - t0) / 1e9}


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    shm_root = tempfile.mkdtemp(prefix="feedline-bench-", dir=args.shm)
    results: dict[str, Any] = {"machine": _machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "settings": {"workers": args.workers, "batch_size": args.batch_size,
                                            "seconds": args.seconds}, "workloads": {}}
    try:
        for workload in workloads:
            if workload == "sampler":
                results["sampler"] = _sampler_workload(args, shm_root)
                continue
            count = args.raw_samples if workload == "raw" else args.jpeg_samples
            src = _dataset(workload, count, parse_size(args.sample_size), args.cache_dir)
            dst = os.path.join(shm_root, workload)
            shutil.copytree(src, dst)
            shards = os.path.join(dst, "*.tar")
            rows: dict[str, Any] = {}
            if workload == "raw":
                rows["feedline (zero-copy)"] = _contender("feedline", workload, shards, args, "--zero-copy")
                rows["feedline (copy)"] = _contender("feedline", workload, shards, args)
                rows["DataLoader"] = _contender("dataloader", workload, shards, args)
                rows["webdataset + DataLoader"] = _contender("webdataset", workload, shards, args)
            else:
                rows["feedline (zero-copy)"] = _contender("feedline", workload, shards, args, "--zero-copy")
                rows["feedline (copy)"] = _contender("feedline", workload, shards, args)
                rows["DataLoader + stock Pillow"] = _contender("dataloader", workload, shards, args, stock_pillow=True)
                rows["DataLoader + pillow-simd"] = _contender("dataloader", workload, shards, args)
                rows["webdataset + DataLoader (stock Pillow)"] = _contender("webdataset", workload, shards, args,
                                                                            stock_pillow=True)
                single = min(args.seconds, 5.0)
                rows["1 core, draft"] = _contender("single-core", workload, shards, args, seconds=single)
                rows["1 core, stock Pillow, no draft"] = _contender("single-core", workload, shards, args,
                                                                    "--no-draft", stock_pillow=True, seconds=single)
            results["workloads"][workload] = rows
            shutil.rmtree(dst)
        results["cuda_copy"] = _cuda_copy_bandwidth()
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    results["targets"] = targets(results, args.workers)
    return results


def _sampler_workload(args: argparse.Namespace, shm_root: str) -> dict[str, Any]:
    from .sampler_bench import fill_rate, train_while_filling

    print("  sampler: fill rate from a loopback HTTP store, sidecar vs curl ...", file=sys.stderr, flush=True)
    raw = _dataset("raw", args.raw_samples, parse_size(args.sample_size), args.cache_dir)
    fill = fill_rate(raw, os.path.join(shm_root, "fill-rate"))
    print(f"        sidecar {fill['sampler_gb_per_s']:.2f} GB/s, curl {fill['curl_gb_per_s']:.2f} GB/s",
          file=sys.stderr, flush=True)
    jpeg = _dataset("jpeg", args.jpeg_samples, parse_size(args.sample_size), args.cache_dir)
    work = os.path.join(shm_root, "train-while-filling")
    os.makedirs(work)

    def contender(*extra: str) -> dict[str, Any]:
        return _contender("feedline", "jpeg", "unused", args, "--zero-copy", *extra)

    return {"fill": fill, "training": train_while_filling(jpeg, work, contender, args.seconds)}


def targets(results: dict[str, Any], workers: int) -> list[dict[str, Any]]:
    """The issue's performance targets, checked against this run's ratios."""
    out = []
    raw = results["workloads"].get("raw")
    if raw:
        zc, dl = raw["feedline (zero-copy)"], raw["DataLoader"]
        ratio = zc["mb_per_s"] / dl["mb_per_s"]
        out.append({"target": "raw 1 MiB: >= 5x DataLoader MB/s", "value": f"{ratio:.1f}x", "met": ratio >= 5})
        out.append({"target": "raw 1 MiB: main-process CPU <= 10 % of a core",
                    "value": f"{zc['main_cpu_pct']:.1f} %", "met": zc["main_cpu_pct"] <= 10})
    jpeg = results["workloads"].get("jpeg")
    if jpeg:
        fl, dl = jpeg["feedline (zero-copy)"], jpeg["DataLoader + stock Pillow"]
        ratio = fl["samples_per_s"] / dl["samples_per_s"]
        out.append({"target": "JPEG: >= 1.5x DataLoader + stock Pillow samples/s", "value": f"{ratio:.2f}x",
                    "met": ratio >= 1.5})
        core = jpeg["1 core, draft"]["samples_per_s"]
        share = fl["samples_per_s"] / (workers * core)
        out.append({"target": f"JPEG: >= 90 % of {workers} workers x the single-core decode+crop rate",
                    "value": f"{100 * share:.0f} % ({fl['samples_per_s']:.0f} of {workers} x {core:.0f})",
                    "met": share >= 0.9})
    sb = results.get("sampler")
    if sb:
        f = sb["fill"]
        out.append({"target": f"sampler: fill >= 1 GB/s from loopback HTTP with {f['threads']} fetch threads",
                    "value": f"{f['sampler_gb_per_s']:.2f} GB/s ({f['sampler_gb_per_s'] / f['curl_gb_per_s']:.2f}x "
                             f"curl --parallel-max {f['threads']}: {f['curl_gb_per_s']:.2f} GB/s)",
                    "met": f["sampler_gb_per_s"] >= 1.0})
        t = sb["training"]
        ratio = t["filling"]["samples_per_s"] / t["prefilled"]["samples_per_s"]
        out.append({"target": "training while the sidecar fills: within 10 % of a pre-filled cache",
                    "value": f"{100 * ratio:.0f} % ({t['filling']['samples_per_s']:.0f} vs "
                             f"{t['prefilled']['samples_per_s']:.0f} samples/s)", "met": ratio >= 0.9})
    cc = results.get("cuda_copy")
    if cc and raw:
        row = raw["feedline (copy)"]
        out.append({"target": "CUDA: H2D GB/s of the loader's copies vs torch's pinned copy bandwidth",
                    "value": f"{row.get('h2d_gb_per_s', 0):.1f} of {cc['pinned_gb_per_s']:.1f} GB/s while copying "
                             f"(delivering {row['mb_per_s'] / 1e3:.1f} GB/s end to end)", "met": None})
    return out


def render_markdown(doc: dict[str, Any]) -> str:
    lines = ["# Benchmarks", "",
             "Written by `./scripts/bench` (`feedline bench`): every contender reads the same tar shards from",
             "`/dev/shm` in one run, each in its own process, and hands batches to a loop that does nothing",
             "else (an infinitely fast training step). Samples/s and MB/s count batch payload delivered to",
             "that loop after a short warm-up; *main CPU* is the main process's CPU time (all its threads) per",
             "wall second. Machines here are noisy: compare the ratios within one run, not across runs.", ""]
    for host, r in sorted(doc.items()):
        m = r["machine"]
        lines += [f"## {host}", "",
                  f"{r['when']}; {m['cpus']} CPUs, Python {m['python']}, torch {m['torch']}, PIL {m['pil']}"
                  + (f", GPU {m['gpu']}" if "gpu" in m else "")
                  + f"; {r['settings']['workers']} workers, batch {r['settings']['batch_size']}, "
                    f"{r['settings']['seconds']:.0f} s per contender.", ""]
        if not m["pil"].endswith(".post0"):
            lines += [f"pillow-simd was not installed on this machine: every row ran with stock Pillow {m['pil']} "
                      f"(see the PIL column), so rows named after pillow-simd are stock too, and the JPEG rows "
                      f"compare the pipeline and draft mode, not the SIMD decoder.", ""]
        if "gpu" in m:
            lines += ["With CUDA the loader's batches are device tensors (zero-copy only changes CPU hosts), and "
                      "the baselines' batches are moved with `.to('cuda', non_blocking=True)` from pinned memory.",
                      ""]
        for workload, rows in r["workloads"].items():
            title = {"raw": "Raw 1 MiB incompressible samples",
                     "jpeg": "JPEG ~500x375 photos, decode + random-resized-crop to 224x224"}[workload]
            lines += [f"### {title}", "", "| contender | PIL | samples/s | MB/s | main CPU % | ratio to DataLoader |",
                      "|---|---|---:|---:|---:|---:|"]
            base_key = "DataLoader" if workload == "raw" else "DataLoader + stock Pillow"
            base = rows[base_key]["samples_per_s"]
            for name, row in rows.items():
                mb = f"{row['mb_per_s']:.0f}" if "mb_per_s" in row else "—"
                cpu = f"{row['main_cpu_pct']:.1f}" if "main_cpu_pct" in row else "—"
                ratio = f"{row['samples_per_s'] / base:.2f}x" if "mb_per_s" in row else "—"
                lines.append(f"| {name} | {row['pil']} | {row['samples_per_s']:.0f} | {mb} | {cpu} | {ratio} |")
            lines.append("")
        if r.get("sampler"):
            f, t = r["sampler"]["fill"], r["sampler"]["training"]
            lines += ["### Sampler sidecar", "",
                      f"Fill: {f['shards']} raw shards ({f['bytes'] / 1e9:.2f} GB) from `feedline serve` on 127.0.0.1 "
                      f"into an empty cache in /dev/shm with {f['threads']} fetch threads: "
                      f"**{f['sampler_gb_per_s']:.2f} GB/s**; `curl --parallel --parallel-max {f['threads']}` of "
                      f"the same files into /dev/shm: {f['curl_gb_per_s']:.2f} GB/s.", "",
                      f"Training (JPEG workload, zero-copy) from a pre-filled cache: "
                      f"{t['prefilled']['samples_per_s']:.0f} samples/s; from an empty cache the sidecar fills "
                      f"during the run at {t['fill_mb_per_s']:.0f} MB/s ({t['shards_cached_at_end']} of "
                      f"{t['shards']} shards cached at the end): {t['filling']['samples_per_s']:.0f} samples/s.", ""]
        if r.get("cuda_copy"):
            cc = r["cuda_copy"]
            lines += [f"torch's own host-to-device copy here: pinned {cc['pinned_gb_per_s']:.1f} GB/s, "
                      f"pageable {cc['pageable_gb_per_s']:.1f} GB/s.", ""]
        lines += ["### Targets", "", "| target | this run | met |", "|---|---|---|"]
        for t in r["targets"]:
            met = "—" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {t['value']} | {met} |")
        lines.append("")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    results = run_bench(args)
    host = args.host or _host_label()
    doc: dict[str, Any] = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            doc = json.load(f)
    doc[host] = results
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=2)
    with open(args.markdown, "w") as f:
        f.write(render_markdown(doc))
    print(render_markdown({host: results}))
    return 0
