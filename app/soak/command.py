"""``feedline soak`` (what ``scripts/soak`` runs): its flags, the run, the files it writes, its exit code."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
from typing import Any

from .settings import SoakSettings, Targets

log = logging.getLogger("feedline.soak")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SoakSettings()
    p.add_argument("--minutes", type=float, default=d.minutes, help="how long the appliance runs (default 60)")
    p.add_argument("--interval", type=float, default=d.interval, help="seconds between samples of every process")
    p.add_argument("--warmup", type=float, default=d.warmup,
                   help="seconds after the start, and after each restart of a process, that the slopes leave out "
                        "(default 600)")
    p.add_argument("--worker-warmup", type=float, default=d.worker_warmup,
                   help="seconds after a decode worker's (re)start that its slope leaves out (default 60: workers "
                        "live minutes)")
    p.add_argument("--worker-every", type=float, default=d.worker_every,
                   help="a decode worker is SIGKILLed this often, in seconds (at most a twelfth of the run)")
    p.add_argument("--store-down", type=float, default=d.store_down, help="seconds the store is down, once")
    p.add_argument("--workers", type=int, default=d.workers, help="the trainer's decode workers")
    p.add_argument("--cached-shards", type=int, default=d.cached_shards,
                   help=f"the sidecar's budget in shards, of {d.shards} (default {d.cached_shards}: it evicts all the "
                        f"time; {d.shards}: the whole dataset, nothing evicted)")
    p.add_argument("--step-ms", type=float, default=d.step_ms, help="the training step's least duration")
    p.add_argument("--out", default=d.out, help="where soak.md, soak.png, soak.json, the logs and keys go")
    p.add_argument("--rss-target", type=float, default=Targets().rss_mib_per_hour,
                   help="the most RSS growth per process, MiB per hour after the warm-up (default 1)")
    p.add_argument("--fds-target", type=float, default=Targets().fds_per_hour,
                   help="the most growth of open descriptors and threads per hour (default 1)")
    p.add_argument("--throughput-target", type=float, default=Targets().throughput_ratio,
                   help="samples/s of the last window against the first after the warm-up (default 0.95)")
    p.add_argument("--window", type=float, default=Targets().window,
                   help="seconds in each of the two throughput windows (default 600)")


def _code_version() -> str:
    """The commit the run measured (and whether the checkout had changes), for the record."""
    import subprocess

    here = os.path.dirname(os.path.realpath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=os.path.dirname(here),
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + (" with uncommitted changes" if dirty else "")) if commit else "unknown"


def run(args: argparse.Namespace) -> int:
    """0 when every target was met, 1 when one was not (the table says which)."""
    from .analysis import judge, table  # the run's machinery: imported by this command alone
    from .chart import render
    from .run import Soak

    settings = SoakSettings(minutes=args.minutes, interval=args.interval, warmup=args.warmup,
                            worker_warmup=args.worker_warmup, worker_every=args.worker_every,
                            store_down=args.store_down, workers=args.workers, cached_shards=args.cached_shards,
                            step_ms=args.step_ms, out=args.out)
    targets = Targets(rss_mib_per_hour=args.rss_target, fds_per_hour=args.fds_target,
                      threads_per_hour=args.fds_target, throughput_ratio=args.throughput_target, window=args.window)
    os.makedirs(settings.out, exist_ok=True)

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # SIGTERM ends the run as Ctrl-C does: everything stopped and removed
    with Soak(settings) as soak:
        soak.record.settings["code"] = _code_version()
        record = soak.run()
    verdict = judge(record, soak.keys_dir, settings.warmup, settings.worker_warmup, targets)
    text = table(record, verdict)
    with open(os.path.join(settings.out, "soak.md"), "w") as f:
        f.write(text)
    with open(os.path.join(settings.out, "soak.json"), "w") as f:
        json.dump({"record": dataclasses.asdict(record), "verdict": dataclasses.asdict(verdict),
                   "targets": dataclasses.asdict(targets)}, f)
    render(record, os.path.join(settings.out, "soak.png"))
    print(text)
    log.info("wrote %s (soak.md, soak.png, soak.json, logs/, keys/)", settings.out)
    return 0 if verdict.ok else 1
