"""The main job (``feedline demo``, what ``./scripts/run`` starts).

A real HTTP server on 127.0.0.1 serves the demo shards as the remote store; the
sampler sidecar (``feedline sample``) and the trainer (``feedline train``) run as
separate processes over a cache on ``/dev/shm``. Every process and the cache
directory are removed on success, on failure and on Ctrl-C.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

from ..api.config import Config, ConfigError
from .procs import free_port, stop_process
from .prometheus import PrometheusServer
from .store import FileStore

log = logging.getLogger("feedline.demo")

DEMO_CACHE = "/dev/shm/feedline"


def _sampler_args(cfg: Config, url: str, cache: str, port: int) -> list[str]:
    keys = ("budget", "policy", "initial_shards", "grow_shards", "replace_fraction", "refresh_per_minute",
            "fetch_threads", "max_mbps", "fetch_timeout", "retries", "min_shards", "seed", "log_level")
    args = ["--source", url, "--cache", cache, "--metrics-port", str(port), "--progress", "false"]
    for k in keys:
        args += [Config.flag_name(k), str(getattr(cfg, k))]
    return args


def _trainer_args(cfg: Config, cache: str, summary: str, port: int) -> list[str]:
    keys = ("batch_size", "workers", "transfer_threads", "ring_slots", "shuffle", "shuffle_block", "shuffle_buffer",
            "seed", "drop_last",
            "in_order", "zero_copy", "device", "max_sample_errors", "worker_timeout", "stall_timeout", "epochs",
            "step_ms", "image_size", "classes", "max_steps", "log_level", "progress", "min_shards", "wait_timeout")
    args = ["--cache", cache, "--summary-json", summary, "--metrics-port", str(port)]
    for k in keys:
        args += [Config.flag_name(k), str(getattr(cfg, k))]
    return args


def _start_prometheus(ports: dict[str, int], console: Any, stack: ExitStack) -> PrometheusServer | None:
    try:
        prom = stack.enter_context(PrometheusServer(ports))
        prom.wait_until_ready()
    except (FileNotFoundError, RuntimeError) as exc:
        console.print(f"[yellow]Prometheus not started: {exc}[/yellow]")
        return None
    console.print(f"prometheus: {prom.url} scraping the sampler (:{ports['sampler']}) and the trainer "
                  f"(:{ports['trainer']}) every second, with the rules of deploy/prometheus/rules/")
    return prom


def _prometheus_starvation(prom: PrometheusServer) -> float | None:
    """The run's starvation as Prometheus computes it from the trainer's counters."""
    wait = 'max_over_time(feedline_data_wait_seconds_total{component="trainer"}[1h])'
    step = 'max_over_time(feedline_step_seconds_total{component="trainer"}[1h])'
    try:
        return prom.value(f"sum({wait}) / (sum({wait}) + sum({step}))")
    except (OSError, RuntimeError):
        return None


def _wait_for_first_scrape(prom: PrometheusServer, component: str, timeout: float = 30.0) -> None:
    """Prometheus's first scrape lands seconds after it starts: wait, so the report covers epoch 0 too."""
    try:
        prom.wait_for(f'up{{component="{component}"}} == 1', timeout=timeout)
    except (OSError, RuntimeError):
        pass  # the run goes on; the report then starts where the scrapes do


def _report(prom: PrometheusServer, started: float, path: str, summary: str, console: Any) -> None:
    """The run as a page (``feedline report``), from the demo's Prometheus before it stops."""
    from ..report.prometheus import PrometheusError
    from ..report.report import write_report

    try:
        written = write_report(prom.url, started, time.time(), path,
                               summary_path=summary if os.path.exists(summary) else None,
                               title="feedline demo run")
    except (PrometheusError, OSError) as exc:
        console.print(f"[yellow]no report: {exc}[/yellow]")
        return
    console.print(f"report: {written.path} ({written.plots} plots; open it in a browser)")


def run_demo(cfg: Config, data: str, console: Any) -> int:
    shards = sorted(glob.glob(os.path.join(data, "*.tar")))
    if not shards:
        raise ConfigError(f"demo: no shards in {data}; make them with `feedline make-dataset jpeg {data}`")
    cache = os.path.abspath(cfg.cache or DEMO_CACHE)
    if os.path.exists(cache):
        raise ConfigError(f"demo: the cache {cache} exists already (another run?); remove it or set --cache")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEEDLINE_")}  # flags carry the config
    env["PYTHONUNBUFFERED"] = "1"
    first, last = os.path.basename(shards[0]), os.path.basename(shards[-1])
    prefix, ext = first.rsplit("-", 1)[0], ".tar"
    numbers = (first[len(prefix) + 1: -len(ext)], last[len(prefix) + 1: -len(ext)])
    tmp = tempfile.mkdtemp(prefix="feedline-demo-")
    summary_path = os.path.join(tmp, "summary.json")
    sampler_log = os.path.join(os.path.dirname(os.path.abspath(data)), "sampler.log")
    procs: list[tuple[str, subprocess.Popen]] = []
    ports = {"sampler": free_port(), "trainer": free_port()}
    try:
        with FileStore(data) as store, open(sampler_log, "w") as slog, ExitStack() as stack:
            prom = _start_prometheus(ports, console, stack)
            url = f"{store.url}/{prefix}-{{{numbers[0]}..{numbers[1]}}}{ext}"
            console.print(f"remote store: {store.url} serving {len(shards)} shards "
                          f"({sum(os.path.getsize(s) for s in shards) / 1e6:.0f} MB) from {data}")
            console.print(f"sampler: {url} -> {cache} (budget {cfg.budget / 2**20:.0f} MiB, policy {cfg.policy}); "
                          f"log in {sampler_log}")
            sampler = subprocess.Popen([sys.executable, "-m", "feedline", "sample",
                                        *_sampler_args(cfg, url, cache, ports["sampler"])],
                                       stdout=slog, stderr=subprocess.STDOUT, env=env)
            procs.append(("sampler", sampler))
            if prom is not None:
                _wait_for_first_scrape(prom, "sampler")
            started = time.time()
            trainer = subprocess.Popen([sys.executable, "-m", "feedline", "train",
                                        *_trainer_args(cfg, cache, summary_path, ports["trainer"])], env=env)
            procs.append(("trainer", trainer))
            while trainer.poll() is None:
                if sampler.poll() is not None:
                    raise RuntimeError(f"the sampler exited with code {sampler.returncode}; see {sampler_log}")
                time.sleep(0.2)
            code = trainer.returncode
            stop_process(sampler, "sampler")
            if sampler.returncode != 0:
                console.print(f"[red]the sampler exited with code {sampler.returncode}[/red]; see {sampler_log}")
            if code == 0 and os.path.exists(summary_path):
                with open(summary_path) as f:
                    doc = json.load(f)
                growth = ", ".join(f"{e['shards']} ({e['shard_bytes'] / 1e6:.0f} MB)" for e in doc["epochs"])
                console.print(f"cache per epoch, shards (size): {growth}; store requests: "
                              f"{sum(store.requests.values())}")
                loader = doc["loader"]
                own = loader["data_wait_seconds_total"] / max(1e-9, loader["data_wait_seconds_total"]
                                                               + loader["step_seconds_total"])
                seen = _prometheus_starvation(prom) if prom is not None else None
                console.print(f"starvation over the run: loader {own:.3f}, Prometheus "
                              + (f"{seen:.3f} (from its scrapes of the trainer's /metrics)" if seen is not None
                                 else "not available"))
            if prom is not None:
                _report(prom, started, os.path.join(os.path.dirname(os.path.abspath(data)), "report.html"),
                        summary_path, console)
            return code
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the trainer and the sampler[/yellow]")
        return 130
    finally:
        for name, proc in reversed(procs):
            stop_process(proc, name)
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
