"""One call from a Prometheus and a time range to a report file: what ``feedline report`` and the demo run."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from ..metrics.grafana import Variables
from . import page
from .collect import PanelData, collect
from .prometheus import PrometheusAPI

log = logging.getLogger("feedline.report")


@dataclass
class Written:
    """What a report holds: its path, its panels, and how many of them drew data."""

    path: str
    panels: list[PanelData]
    plots: int

    @property
    def empty(self) -> list[str]:
        return [p.title for p in self.panels if not p.has_data and not p.optional_only]


def write_report(prometheus: str, start: float, end: float, path: str, variables: Variables = Variables(),
                 summary_path: str | None = None, title: str = "feedline run report") -> Written:
    """Query every panel of the dashboard over ``[start, end]`` and write the page to ``path``."""
    api = PrometheusAPI(prometheus)
    interval, panels = collect(api, start, end, variables)
    summary: dict[str, Any] | None = None
    if summary_path:
        with open(summary_path) as f:
            summary = json.load(f)
    html = page.render(panels, start, end, prometheus, interval.step, title=title, summary=summary)
    page.write(path, html)
    written = Written(path, panels, page.plot_count(html))
    if written.empty:
        log.info("report: no data in this range for %s", ", ".join(written.empty))
    return written
