"""A run's data, panel by panel: every query of the Grafana dashboard, as Grafana would send it, over one range."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..metrics import dashboard
from ..metrics.grafana import Interval, Variables, legend, substitute
from .prometheus import PrometheusAPI, Series


@dataclass
class Line:
    """One drawn series: its legend (the panel's legend format filled in) and its points."""

    name: str
    times: list[float]
    values: list[float]
    right_axis: bool = False


@dataclass
class PanelData:
    """One dashboard panel over the range: its lines, and the queries that returned nothing (with why)."""

    row: str
    title: str
    description: str
    unit: str
    kind: str
    lines: list[Line] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)  # legends of queries without data
    optional_only: bool = False  # every query needs an exporter feedline does not run (DCGM)

    @property
    def has_data(self) -> bool:
        return any(line.values for line in self.lines)


_TEMPLATE = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def collect(api: PrometheusAPI, start: float, end: float, variables: Variables = Variables(),
            scrape_interval: float | None = None, max_data_points: int = 400) -> tuple[Interval, list[PanelData]]:
    """Every panel of the dashboard over ``[start, end]`` (Unix seconds)."""
    interval = Interval(start, end, api.scrape_interval() if scrape_interval is None else scrape_interval,
                        max_data_points)
    panels = []
    for row, members in dashboard.ROWS:
        for p in members:
            data = PanelData(row, p.title, p.description, p.unit, p.kind,
                             optional_only=all(q.optional for q in p.queries))
            for q in p.queries:
                found: list[Series] = api.query_range(substitute(q.expr, interval, variables), start, end,
                                                      interval.step)
                found = [s for s in found if s.values]
                if not found:
                    data.empty.append(_TEMPLATE.sub(r"each \1", q.legend))  # "{{stage}}" -> "each stage"
                for s in sorted(found, key=lambda s: sorted(s.labels.items())):
                    data.lines.append(Line(legend(q.legend, s.labels), s.times, s.values,
                                           right_axis=q.legend in p.right_axis))
            panels.append(data)
    return interval, panels
