"""The sampler's benchmark: fill rate from a loopback HTTP store (against curl), and training
throughput while the sidecar fills the cache (against a pre-filled cache)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from ..cache.manifest import read_manifest
from ..metrics.prometheus import free_port


class _Proc:
    """A feedline subprocess, stopped with SIGTERM (then SIGKILL) on exit."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)

    def __enter__(self) -> "_Proc":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _serve(root: str) -> tuple[_Proc, str]:
    server = _Proc("serve", root)
    assert server.proc.stdout is not None
    return server, server.proc.stdout.readline().strip()


def _until(pred: Callable[[], bool], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench: timed out waiting for {what}")
        time.sleep(0.005)
    return time.monotonic()


def _cached(cache: str) -> int:
    try:
        return len(read_manifest(cache).shards)
    except (FileNotFoundError, ValueError):
        return 0


def _up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
            return True
    except OSError:
        return False


def _pattern(url: str, shards: list[str]) -> str:
    first, last = os.path.basename(shards[0])[:-4], os.path.basename(shards[-1])[:-4]
    prefix = first.rsplit("-", 1)[0]
    return f"{url}/{prefix}-{{{first.rsplit('-', 1)[1]}..{last.rsplit('-', 1)[1]}}}.tar"


def _sampler(url: str, cache: str, budget: int, port: int, *extra: str) -> _Proc:
    return _Proc("sample", "--source", url, "--cache", cache, "--budget", str(budget), "--policy", "fill",
                 "--metrics-port", str(port), "--progress", "false", "--log-level", "WARNING", *extra)


def fill_rate(src: str, shm_root: str, threads: int = 4) -> dict[str, Any]:
    """Seconds to fill an empty cache with every shard of ``src`` (from the sidecar's start of work)."""
    shards = sorted(glob.glob(os.path.join(src, "*.tar")))
    total = sum(os.path.getsize(s) for s in shards)
    server, url = _serve(src)
    with server:
        cache = os.path.join(shm_root, "fill")
        port = free_port()
        with _sampler(_pattern(url, shards), cache, 2 * total, port, "--fetch-threads", str(threads)):
            t_up = _until(lambda: _up(port), 60, "the sampler to start")
            t_all = _until(lambda: _cached(cache) == len(shards), 300, "the cache to fill")
        sampler_s = t_all - t_up
        out = os.path.join(shm_root, "curl")
        os.makedirs(out)
        cmd = ["curl", "-s", "-f", "--parallel", "--parallel-max", str(threads)]
        for s in shards:
            cmd += ["-o", os.path.join(out, os.path.basename(s)), f"{url}/{os.path.basename(s)}"]
        t0 = time.monotonic()
        subprocess.run(cmd, check=True)
        curl_s = time.monotonic() - t0
    return {"shards": len(shards), "bytes": total, "threads": threads,
            "sampler_gb_per_s": total / sampler_s / 1e9, "curl_gb_per_s": total / curl_s / 1e9}


def train_while_filling(src: str, shm_root: str, run_contender: Callable[..., dict[str, Any]],
                        seconds: float) -> dict[str, Any]:
    """The loader on a pre-filled cache, then on an empty cache the sidecar fills during the run."""
    shards = sorted(glob.glob(os.path.join(src, "*.tar")))
    total = sum(os.path.getsize(s) for s in shards)
    server, url = _serve(src)
    with server:
        pattern = _pattern(url, shards)
        pre = os.path.join(shm_root, "prefilled")
        port = free_port()
        with _sampler(pattern, pre, 2 * total, port):
            _until(lambda: _cached(pre) == len(shards), 300, "the cache to fill")
        prefilled = run_contender("--cache", pre)
        live = os.path.join(shm_root, "filling")
        cap_mbps = total / 1e6 / seconds  # the fill spans the measured window
        with _sampler(pattern, live, 2 * total, free_port(), "--max-mbps", f"{cap_mbps:.3f}"):
            filling = run_contender("--cache", live)
            shards_at_end = _cached(live)
    return {"prefilled": prefilled, "filling": filling, "fill_mb_per_s": cap_mbps,
            "shards": len(shards), "shards_cached_at_end": shards_at_end}
