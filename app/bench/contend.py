"""Running the bench's contenders: each in a process of its own, its dataset made once, its JSON read back.

What every section of ``feedline bench`` (``runner.py``) and ``scripts/gpu-check`` (``gpu_check.py``) share: the
datasets in ``.cache/bench``, a contender process (``contenders.py``; stock Pillow on its path where asked), the
peers' venv and formats (``peers.py``), and torch's own host-to-device copy rate.
"""

from __future__ import annotations

import argparse
import logging
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from ..api.config import parse_size
from ..demo.datasets import make_dataset
from ..preflight import pil_is_simd
from . import zygote
from .shm import remove_orphaned_torch_shm, torch_shm

log = logging.getLogger("feedline.bench")

STOCK_PILLOW = os.path.join(".venv", "stock-pillow")
PEERS_VENV = ".venv-peers"  # scripts/setup-peers: the peer loaders, away from .venv's pins
FAST_VENV = ".venv-fast"  # scripts/setup-fast-peers: DALI and SPDL, away from .venv's size
FAST_ROWS = {"dali": "DALI CPU pipeline", "spdl": "SPDL pipeline"}  # the tar shards, as many threads as workers
PEER_ROWS = {"mosaic": "Mosaic Streaming + DataLoader", "litdata": "LitData StreamingDataLoader",
             "tfdata": "tf.data (TFRecord)", "hf": "HF datasets + DataLoader (Parquet)"}
_PEER_DIRS = shutil.ignore_patterns(*PEER_ROWS)  # the peers' copies of a dataset: only their rows read them
# feedline on the files tf.data's and Hugging Face's rows read (their writers' own TFRecord and Parquet files)
FILE_ROWS = {"tfdata": ("feedline (TFRecord)", "*.tfrecord"), "hf": ("feedline (Parquet)", "*.parquet")}


def _dataset(kind: str, count: int, sample_bytes: int, cache_dir: str, min_shard: int = 1 << 20) -> str:
    """Shards on local disk, made once per parameter set."""
    outdir = os.path.join(cache_dir, "bench", f"{kind}-{count}-{sample_bytes}"
                          + (f"-{min_shard}" if min_shard != 1 << 20 else ""))
    if not os.path.exists(os.path.join(outdir, "complete")):
        log.warning("making the %s dataset (%d samples) in %s", kind, count, outdir)
        per_sample = {"raw": sample_bytes, "video": 120_000}.get(kind, 60_000)  # a ~500x375 JPEG is 40-80 kB
        # 32 shards, so that each worker gets as many: an epoch's tail (the last worker finishing
        # its last shard while the others idle) is then a small share of a short benchmark epoch
        shard_bytes = max(min_shard, count * per_sample // 32)
        make_dataset(kind, outdir, count, shard_bytes, cache_dir, sample_bytes)
        open(os.path.join(outdir, "complete"), "w").close()
    return outdir


def _contender(name: str, workload: str, shards: str, args: argparse.Namespace, *extra: str,
               stock_pillow: bool = False, seconds: float | None = None, launch: Any = None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    if stock_pillow and pil_is_simd():
        if not os.path.isdir(STOCK_PILLOW):
            raise RuntimeError(f"{STOCK_PILLOW} is missing; run ./scripts/setup")
        env["PYTHONPATH"] = os.path.abspath(STOCK_PILLOW) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "feedline.bench.contenders", name, "--workload", workload, "--shards", shards,
           "--workers", str(args.workers), "--batch-size", str(args.batch_size),
           "--seconds", str(seconds if seconds is not None else args.seconds),
           "--sample-bytes", str(parse_size(args.sample_size)), *extra]
    label = " ".join([name, *extra]) + (" (stock Pillow)" if stock_pillow and pil_is_simd() else "")
    return (launch or _run_json)(cmd, env, workload, label)  # launch: gpu-check's profile runs it under py-spy


def _venv_python(venv: str, stamp: str, setting: str, script: str) -> str | None:
    """``venv``'s Python when its rows run (``setting``: auto, on, off), else None; on without it is refused."""
    python = os.path.join(venv, "bin", "python")
    ready = os.path.exists(os.path.join(venv, stamp)) and os.access(python, os.X_OK)
    if setting == "on" and not ready:
        raise SystemExit(f"{venv} is not installed; run {script}")
    return python if ready and setting != "off" else None


def _peers_python(args: argparse.Namespace) -> str | None:
    """``.venv-peers``'s Python when the peers' rows run, else None; ``--peers on`` without it is refused."""
    return _venv_python(PEERS_VENV, ".feedline-peers", args.peers, "./scripts/setup-peers")


def _fast_python(args: argparse.Namespace) -> str | None:
    """``.venv-fast``'s Python when DALI's and SPDL's rows run, else None; ``--fast-peers on`` without it is
    refused."""
    return _venv_python(FAST_VENV, ".feedline-fast", getattr(args, "fast_peers", "auto"), "./scripts/setup-fast-peers")


def _peer_formats(src: str, workload: str, python: str) -> None:
    """Each peer's format of a bench dataset, written once beside its tar shards (``src/mosaic``, ...)."""
    from .peers import MARK, PEERS

    missing = [peer for peer in PEERS if not os.path.exists(os.path.join(src, peer, MARK))]
    if not missing:
        return
    log.warning("writing the %s dataset in %s's formats under %s", workload, " and ".join(missing), src)
    cmd = [python, "-m", "feedline.bench.peers", "write", *missing, "--workload", workload,
           "--shards", os.path.join(src, "*.tar"), "--out", src]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"writing the peers' formats failed:\n{done.stderr[-3000:]}")


def _peer_contender(peer: str, workload: str, root: str, args: argparse.Namespace, python: str,
                    seconds: float | None = None, *extra: str) -> dict[str, Any]:
    """A peer of ``.venv-peers`` on its own format of the dataset under ``root``."""
    return _venv_contender(peer, workload, os.path.join(root, peer), args, python, seconds, *extra)


def _venv_contender(name: str, workload: str, shards: str, args: argparse.Namespace, python: str,
                    seconds: float | None = None, *extra: str) -> dict[str, Any]:
    """A contender run by another venv's Python (a peer's, DALI's and SPDL's)."""
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    cmd = [python, "-m", "feedline.bench.contenders", name, "--workload", workload,
           "--shards", shards, "--workers", str(args.workers), "--batch-size", str(args.batch_size),
           "--seconds", str(seconds if seconds is not None else args.seconds),
           "--sample-bytes", str(parse_size(args.sample_size)), *extra]
    return _run_json(cmd, env, workload, name)


def _run_json(cmd: list[str], env: dict[str, str], workload: str, label: str) -> dict[str, Any]:
    """Run one contender process; its last stdout line is its JSON result."""
    print(f"  {workload:5s} {label} ...", file=sys.stderr, flush=True)
    before = torch_shm()
    quick = zygote.current()  # --quick: a row forked from a process that imported torch already
    module = quick.module_of(cmd, env) if quick is not None else None
    try:
        if quick is not None and module is not None:
            out = quick.run(module, cmd[3:], env, timeout=600)
        else:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    finally:
        remove_orphaned_torch_shm(before, label)
    if out.returncode != 0:
        code = out.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
            else f"exit code {code}"
        raise RuntimeError(f"contender {label} failed ({how}):\n{out.stderr[-3000:]}")
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
