"""The ``feedline`` command: train, run, sample, serve, demo, soak, doctor, dashboard, make-shards, make-dataset, bench.

The face: it reads the one ``Config``, builds each library part's settings,
wires the metrics exporters, shows progress and summaries, and turns every
refused setting into one ``configuration error:`` line (exit code 2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from .. import __version__
from ..api.config import Config, ConfigError, parse_size
from ..errors import SettingError
from ..formats.urls import RedactingFormatter, redact_text
from ..loader.errors import LoaderError
from ..metrics.exporter import MetricsPortError
from .stopping import StopSignal, Stopped

log = logging.getLogger("feedline")
console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)


def _setup_logging(level: str) -> None:
    """Rich's columns for a person at a terminal; plain lines for a file, a pipe or `docker logs`.

    A log that is not a terminal is read by tools and by grep: one record per line, never wrapped. And a
    process that runs for weeks should not render through Rich, whose per-string render caches grew by
    ~25 KB a minute in the sidecar and the trainer of a soak run (docs/reliability.md).
    """
    if sys.stderr.isatty():
        handler: logging.Handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
        handler.setFormatter(RedactingFormatter("%(message)s", datefmt="[%X]"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(RedactingFormatter("[%(asctime)s] %(levelname)-8s %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler])
    for name in ("botocore", "boto3", "s3transfer", "urllib3"):  # at DEBUG botocore logs signed headers, a token
        logging.getLogger(name).setLevel(max(logging.INFO, logging.getLevelName(level)))


# -- train --------------------------------------------------------------------------------------

def cmd_train(args: argparse.Namespace) -> int:
    stop = StopSignal()  # first: a SIGTERM at any moment from here on ends in exit 0 (stopping.py)
    try:
        return _train(args, stop)
    except Stopped:
        log.warning("stopped during start-up (SIGTERM): nothing trained yet, nothing to save")
        return 0
    finally:
        stop.close()


def _train(args: argparse.Namespace, stop: StopSignal) -> int:
    cfg = Config.load(args)
    from ..trainer.distributed import Job, process_group

    job = Job.from_env(os.environ)
    _setup_logging(cfg.log_level if job.leader else "WARNING")  # under torchrun, rank 0 speaks for all
    if not cfg.shards and not cfg.cache and not cfg.mix:
        raise ConfigError("train needs data: set shards (--shards / FEEDLINE_SHARDS), cache "
                          "(--cache / FEEDLINE_CACHE) or mix (--mix / FEEDLINE_MIX)")
    import torch

    from ..trainer.keytrace import KeyTrace
    from ..trainer.train import build_loader, epoch_samples, print_summary, train

    with contextlib.ExitStack() as stack:
        with stop.starting():  # a SIGTERM from here until the loader is up ends the start-up
            stack.enter_context(process_group(job, torch.device(cfg.resolved_device()), cfg.dist_timeout))
            loader = stack.enter_context(build_loader(cfg, job))
        progress = Progress(TextColumn("[bold]epoch {task.fields[epoch]}[/bold] {task.fields[shards]} shards"),
                            BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]:>8.0f} samples/s  wait {task.fields[wait]:>4.0%}  "
                                       "queues free/decoded/device {task.fields[q]}"),
                            TimeElapsedColumn(), console=console, disable=not (cfg.progress and job.leader),
                            transient=False)
        tasks: dict[int, Any] = {}

        def on_epoch_start(epoch: int) -> None:
            for done in list(tasks):  # one bar, the current epoch's: a run of weeks must not keep every epoch's
                progress.remove_task(tasks.pop(done))
            total = epoch_samples(loader) if cfg.progress else None
            tasks[epoch] = progress.add_task("", total=total, epoch=epoch, rate=0.0, wait=0.0, q="-",
                                             shards=len(loader.epoch_shards))

        def on_step(es: Any, stats: Any) -> None:
            fields: dict[str, Any] = {"completed": es.samples}
            if stats is not None:
                d = stats.queue_depth
                fields.update(rate=es.samples / max(1e-9, es.elapsed()), wait=stats.gpu_starvation_ratio,
                              q=f"{d['free']}/{d['decoded']}/{d['device']}")
            progress.update(tasks[es.epoch], **fields)

        summary = None
        trace_path = f"{args.trace_keys}.rank{job.rank}" if args.trace_keys and job.distributed else args.trace_keys
        trace = KeyTrace(trace_path) if trace_path else None
        try:
            with progress:
                summary = train(cfg, loader, on_step=on_step, on_epoch_start=on_epoch_start, stop=stop.event,
                                trace_keys=trace, job=job)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted; shutting down the loader[/yellow]")
            return 130
        finally:
            if trace is not None:
                trace.close()
        if job.leader:
            print_summary(console, summary, loader)
    if args.summary_json and job.leader:
        with open(args.summary_json, "w") as f:
            json.dump(summary.to_json(), f, indent=2)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    cfg = Config.load(args)
    _setup_logging(cfg.log_level)
    from .run import run

    run(cfg, args.command_words)  # never returns: the process is the command now
    return 0


# -- data ---------------------------------------------------------------------------------------

def cmd_make_shards(args: argparse.Namespace) -> int:
    _setup_logging("INFO")
    from ..formats.shard_writer import (
        class_folders,
        samples_from_class_folders,
        samples_from_folder,
        samples_from_list,
        write_shards,
    )

    src = args.source
    seed = None if args.keep_order else args.seed
    if args.classes_from_folders:
        if not os.path.isdir(src):
            raise ConfigError(f"make-shards --classes-from-folders: source {src!r} is not a folder of class folders")
        classes = class_folders(src)
        if not classes:
            raise ConfigError(f"make-shards --classes-from-folders: {src!r} holds no class folder (<class>/<file>)")
        os.makedirs(args.outdir, exist_ok=True)
        with open(os.path.join(args.outdir, "classes.txt"), "w") as f:
            f.write("".join(f"{name}\n" for name in classes))
        samples = samples_from_class_folders(src, seed)
    elif os.path.isdir(src):
        samples = samples_from_folder(src, seed)
    elif os.path.isfile(src):
        samples = samples_from_list(src, seed)
    else:
        raise ConfigError(f"make-shards: source {src!r} is neither a folder nor a list file of 'path label' lines")
    shards = write_shards(samples, args.outdir, args.prefix, parse_size(args.shard_size))
    order = ("in the source's order (--keep-order)" if seed is None
             else f"samples shuffled (seed {seed}; --keep-order keeps the source's order)")
    console.print(f"wrote {len(shards)} shard(s) to {args.outdir}, {order}")
    return 0


def cmd_make_dataset(args: argparse.Namespace) -> int:
    _setup_logging("INFO")
    from ..demo.datasets import make_dataset

    with Progress(TextColumn(f"[bold]{args.kind} dataset"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("", total=args.samples)
        shards = make_dataset(args.kind, args.outdir, args.samples, parse_size(args.shard_size), args.cache_dir,
                              parse_size(args.sample_size), args.seed,
                              progress=lambda n: progress.update(task, completed=n))
    size = sum(os.path.getsize(s) for s in shards)
    console.print(f"wrote {args.samples} samples in {len(shards)} shards ({size / 1e6:.0f} MB) to {args.outdir}")
    return 0


def _on_stop_signals(stop: Any) -> None:
    """SIGTERM (docker stop, Kubernetes) and SIGINT (Ctrl-C) ask for a clean stop."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop())


def cmd_sample(args: argparse.Namespace) -> int:
    cfg = Config.load(args)
    _setup_logging(cfg.log_level)
    from .sample import sample

    stopping = threading.Event()
    _on_stop_signals(stopping.set)  # first: a SIGTERM while starting up still stops cleanly
    return sample(cfg, stopping, _on_stop_signals)


def cmd_serve(args: argparse.Namespace) -> int:
    _setup_logging("INFO")
    from ..demo.store import FileStore

    done = threading.Event()
    _on_stop_signals(done.set)
    if args.demo_samples:
        from ..demo.datasets import make_demo_store

        index = make_demo_store(args.root, args.demo_samples, parse_size(args.shard_size), args.cache_dir)
        log.info("demo dataset: %s lists its shards", index)
    # a process of its own: nobody can read its request log, so it keeps none (the soak run measures its memory)
    with FileStore(args.root, args.host, args.port, remember=False, min_client_rate=parse_size(args.min_client_rate),
                   floor_window=args.floor_window) as store:
        log.info("serving %s at %s", args.root, store.url)
        print(store.url, flush=True)
        done.wait()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = Config.load(args)
    _setup_logging(cfg.log_level)
    from ..demo.job import run_demo

    return run_demo(cfg, args.data, console)


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import run

    _setup_logging("WARNING")
    return run(Config.load(args), console)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from ..metrics.dashboard import render

    with open(args.out, "w") as f:
        f.write(render())
    console.print(f"wrote {args.out}")
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    _setup_logging("INFO")
    from ..soak.command import run

    return run(args)


def cmd_report(args: argparse.Namespace) -> int:
    _setup_logging("WARNING")
    from ..report.command import run

    return run(args, console)


def cmd_bench(args: argparse.Namespace) -> int:
    _setup_logging("WARNING")
    from ..bench.runner import main as bench_main

    return bench_main(args)


# -- entry point --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="feedline", description=__doc__)
    parser.add_argument("--version", action="version", version=f"feedline {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train the demo model on shards or a cache, fed by the staging loader")
    Config.add_arguments(p, ("data", "loader", "job", "serve", "process"))
    p.add_argument("--summary-json", default=None, help="also write the summary to this JSON file")
    p.add_argument("--trace-keys", default=None, help="append the key of every sample trained to this file (an "
                                                      "audit of what a run, or a resumed run, trained on); "
                                                      "{epoch} in the path makes one file per epoch")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("run", help="your own training command, once the cache is ready (preflight, then exec)")
    Config.add_arguments(p, ("data", "run", "process"), extra=("min_shards", "wait_timeout"))
    p.add_argument("command_words", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the training command (default: FEEDLINE_TRAIN_CMD)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("make-shards", help="pack a folder, or a list file of 'path label' lines, into tar shards")
    p.add_argument("source", help="a folder (files sharing a basename form a sample) or a list file")
    p.add_argument("outdir")
    p.add_argument("--prefix", default="shard")
    p.add_argument("--shard-size", default="256MiB", help="target shard size (bytes or 512MiB, 1GiB)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the samples' shuffle (default 0)")
    p.add_argument("--keep-order", action="store_true",
                   help="write samples in the source's order (sorted paths, list lines) instead of shuffled")
    p.add_argument("--classes-from-folders", action="store_true",
                   help="the source holds a folder per class (<class>/<video or image>): each sample's cls is its "
                        "class's index in sorted order, the names written to OUTDIR/classes.txt")
    p.set_defaults(func=cmd_make_shards)

    p = sub.add_parser("make-dataset", help="write a demo/benchmark dataset of real tar shards")
    p.add_argument("kind", choices=("jpeg", "raw"))
    p.add_argument("outdir")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--shard-size", default="64MiB")
    p.add_argument("--sample-size", default="1MiB", help="raw: bytes per sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=".cache", help="where the photo source is kept")
    p.set_defaults(func=cmd_make_dataset)

    p = sub.add_parser("sample", help="the sampler sidecar: fill a bounded cache from a remote store")
    Config.add_arguments(p, ("sampler", "serve", "process"))
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("serve", help="serve a folder over HTTP (a stand-in for the remote store)")
    p.add_argument("root")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    p.add_argument("--demo-samples", type=int, default=0,
                   help="first write the demo JPEG dataset of this many samples into an empty ROOT, with an "
                        "index.txt listing its shards (compose's demo profile)")
    p.add_argument("--shard-size", default="16MiB", help="with --demo-samples: the shards' size")
    p.add_argument("--cache-dir", default=".cache", help="with --demo-samples: where the sample photos are kept")
    p.add_argument("--min-client-rate", default="64KiB",
                   help="bytes a second a client must read a shard at, over --floor-window, to keep its connection "
                        "(0: no floor); a slower one is closed, so no reader holds a connection as long as it likes")
    p.add_argument("--floor-window", type=float, default=30.0, help="seconds the client's rate is measured over")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="the main job: store, sampler and trainer as separate processes")
    Config.add_arguments(p, ("loader", "sampler", "job", "process"))
    p.add_argument("--data", default="data/demo-jpeg", help="the demo dataset's shards, served over HTTP")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("doctor", help="preflight: /dev/shm, memory limits, GPU, pillow-simd, Docker")
    Config.add_arguments(p, (), extra=("cache", "budget", "policy", "replace_fraction", "fetch_threads", "workers",
                                       "transfer_threads", "ring_slots", "batch_size", "image_size", "device",
                                       "cpu_placement", "trainer_cores"))
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("dashboard", help="write the Grafana dashboard JSON generated from code")
    p.add_argument("--out", default="grafana/dashboards/feedline.json")
    p.set_defaults(func=cmd_dashboard)

    from ..report.command import add_arguments as report_arguments
    from ..soak.command import add_arguments as soak_arguments

    p = sub.add_parser("report", help="a self-contained HTML report of a run, from the Prometheus that scraped it")
    report_arguments(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("soak", help="the appliance for an hour under faults: memory, descriptors, threads, "
                                    "/dev/shm and every epoch's samples checked (scripts/soak)")
    soak_arguments(p)
    p.set_defaults(func=cmd_soak)

    from ..bench.options import add_arguments as bench_arguments

    p = sub.add_parser("bench", help="this loader against torch DataLoader and webdataset, side by side")
    bench_arguments(p)
    p.set_defaults(func=cmd_bench)
    return parser


def _refuse(message: str, what: str = "configuration error") -> None:
    """The one line every refused setting (exit code 2) or failed run (a LoaderError: 1) becomes, no traceback."""
    from rich.markup import escape

    console.print(f"[red]{what}:[/red] {escape(redact_text(message))}", soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SettingError as exc:
        _refuse(f"{Config.describe(exc.setting)}: {exc.message}")
        return 2
    except (ConfigError, MetricsPortError, TimeoutError) as exc:
        _refuse(str(exc))
        return 2
    except LoaderError as exc:  # the data, not a setting: the run failed
        _refuse(str(exc), "error")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
