"""``feedline report --prometheus URL --since 30m``: a report of any run a Prometheus scraped."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from typing import Any

from ..metrics.grafana import Variables, parse_duration
from .prometheus import PrometheusError


class TimeError(ValueError):
    """A --since / --until that is neither a duration, a Unix time nor an ISO 8601 time."""


def parse_time(text: str, now: float) -> float:
    """``now``, a duration back from now (``30m``), a Unix time, or an ISO 8601 time (local unless zoned)."""
    text = text.strip()
    if text == "now":
        return now
    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise TimeError(f"{text!r} is not a time: give a duration back from now (30m, 2h), a Unix time, or an "
                        f"ISO 8601 time (2026-11-25T10:00:00)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prometheus", default="http://127.0.0.1:9090",
                   help="the Prometheus that scraped the run (default http://127.0.0.1:9090, the appliance's)")
    p.add_argument("--since", default="30m", help="the range's start: a duration back from now (30m), a Unix time "
                                                  "or an ISO 8601 time (default 30m)")
    p.add_argument("--until", default="now", help="the range's end, in the same forms (default now)")
    p.add_argument("--out", default="feedline-report.html", help="the HTML file to write")
    p.add_argument("--job", action="append", default=None, help="only this Prometheus job (repeat for several; "
                                                                 "default all, as the dashboard's $job)")
    p.add_argument("--instance", action="append", default=None, help="only this instance (repeat; default all)")
    p.add_argument("--summary-json", default=None, help="a `feedline train --summary-json` file: its per-epoch "
                                                        "table goes on the page")
    p.add_argument("--title", default="feedline run report")


def run(args: argparse.Namespace, console: Any) -> int:
    from .report import write_report

    now = time.time()
    try:
        start, end = parse_time(args.since, now), parse_time(args.until, now)
    except TimeError as exc:
        console.print(f"[red]report:[/red] {exc}")
        return 2
    if end <= start:
        console.print(f"[red]report:[/red] --until ({args.until}) is not after --since ({args.since})")
        return 2
    try:
        written = write_report(args.prometheus, start, end, args.out, Variables(args.job, args.instance),
                               args.summary_json, args.title)
    except PrometheusError as exc:
        console.print(f"[red]report:[/red] {exc}")
        return 2
    if not written.plots:
        console.print(f"[yellow]report: no feedline series in Prometheus at {args.prometheus} between "
                      f"{args.since} and {args.until}; the page says so[/yellow]")
    console.print(f"report: {os.path.abspath(written.path)} ({written.plots} plots)")
    return 0
