"""The report's HTML: one self-contained page (plotly.js inlined once), readable with no network.

The page checks itself as it loads: it records every script error and ``console.error``, and after the
plots are drawn writes on ``<body>`` how many traces each plot drew with points (``data-plots``) and the
errors (``data-errors``) — what the browser test reads, and what a user's browser shows if a plot is empty.
"""

from __future__ import annotations

import datetime as dt
import html
import json
from collections.abc import Sequence
from typing import Any

from .. import __version__
from ..formats.urls import redact
from .collect import PanelData

# Grafana's units, as axis formats.
_AXES: dict[str, dict[str, Any]] = {
    "percentunit": {"tickformat": ".0%", "rangemode": "tozero"},
    "bytes": {"tickformat": "~s", "ticksuffix": "B", "rangemode": "tozero"},
    "Bps": {"tickformat": "~s", "ticksuffix": "B/s", "rangemode": "tozero"},
    "s": {"tickformat": ".3~g", "ticksuffix": " s", "rangemode": "tozero"},
    "short": {"tickformat": "~s", "rangemode": "tozero"},
}

_HEAD_SCRIPT = """
window.feedlineErrors = [];
window.addEventListener("error", function (e) { window.feedlineErrors.push(String(e.message)); });
(function () {
  var original = console.error;
  console.error = function () {
    window.feedlineErrors.push(Array.prototype.map.call(arguments, String).join(" "));
    return original.apply(console, arguments);
  };
})();
"""

_CHECK_SCRIPT = """
window.addEventListener("load", function () {
  var drawn = {};
  document.querySelectorAll(".js-plotly-plot").forEach(function (plot) {
    var n = 0;
    plot.querySelectorAll(".scatterlayer .trace").forEach(function (trace) {
      var line = trace.querySelector("path.js-line");
      if ((line && /L/.test(line.getAttribute("d") || "")) || trace.querySelectorAll("path.point").length) n += 1;
    });
    drawn[plot.id] = n;
  });
  document.body.setAttribute("data-plots", JSON.stringify(drawn));
  document.body.setAttribute("data-errors", JSON.stringify(window.feedlineErrors));
});
"""

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1280px; color: #222; }
h1 { margin-bottom: 4px; } h2 { margin-top: 32px; border-bottom: 1px solid #ddd; }
.meta { color: #555; } .grid { display: grid; grid-template-columns: repeat(2, 1fr); gap: 12px; }
.panel { border: 1px solid #e3e3e3; border-radius: 6px; padding: 8px; }
.panel p { margin: 2px 4px 6px; color: #555; font-size: 13px; } .empty { color: #a55; font-size: 13px; }
table { border-collapse: collapse; font-size: 14px; } td, th { border: 1px solid #ddd; padding: 3px 8px; }
th { background: #f5f5f5; } td.num { text-align: right; }
"""


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t).isoformat(timespec="seconds")


def _figure(panel: PanelData, div_id: str) -> str:
    import plotly.graph_objects as go

    fig = go.Figure()
    for line in panel.lines:
        times = [dt.datetime.fromtimestamp(t) for t in line.times]
        fig.add_trace(go.Scatter(x=times, y=line.values, name=line.name, mode="lines" if len(times) > 1 else "markers",
                                 yaxis="y2" if line.right_axis else "y"))
    layout: dict[str, Any] = {"height": 280, "margin": {"l": 60, "r": 50, "t": 10, "b": 30},
                              "legend": {"orientation": "h", "y": -0.15}, "yaxis": _AXES.get(panel.unit, {}),
                              "template": "plotly_white"}
    if any(line.right_axis for line in panel.lines):
        layout["yaxis2"] = {"overlaying": "y", "side": "right", "rangemode": "tozero", "showgrid": False}
    fig.update_layout(**layout)
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def _table_panel(panel: PanelData) -> str:
    rows = "".join(f"<tr><td>{html.escape(line.name)}</td></tr>" for line in panel.lines)
    return f"<table><tr><th>{html.escape(panel.title)}</th></tr>{rows}</table>"


def _epochs(summary: dict[str, Any] | None) -> str:
    """The run's per-epoch table (``feedline train --summary-json``), when the report is given one."""
    if not summary or not summary.get("epochs"):
        return ""
    cols = [("epoch", "epoch", "{}"), ("shards", "shards trained on", "{}"), ("shard_bytes", "their MB", "{:.0f}"),
            ("samples", "samples", "{}"), ("sources", "samples per source", "{}"), ("samples_per_s", "samples/s", "{:.0f}"), ("mb_per_s", "MB/s", "{:.1f}"),
            ("starvation", "starvation", "{:.3f}"), ("data_wait_seconds", "data wait (s)", "{:.2f}"),
            ("loss", "loss", "{:.4f}")]
    present = [c for c in cols if any(e.get(c[0]) not in (None, {}) for e in summary["epochs"])]
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title, _ in present)
    body = ""
    for e in summary["epochs"]:
        cells = []
        for key, _, fmt in present:
            v = e.get(key)
            if key == "shard_bytes" and v is not None:
                v = v / 1e6
            if key == "sources" and isinstance(v, dict):  # a mixture's epoch
                v = ", ".join(f"{name} {n}" for name, n in sorted(v.items()))
            cells.append(f"<td class=num>{html.escape(fmt.format(v)) if v is not None else ''}</td>")
        body += "<tr>" + "".join(cells) + "</tr>"
    return f"<h2>The run, epoch by epoch</h2><table><tr>{head}</tr>{body}</table>"


def render(panels: Sequence[PanelData], start: float, end: float, source: str, step: float,
           title: str = "feedline run report", summary: dict[str, Any] | None = None) -> str:
    """The whole page."""
    from plotly.offline import get_plotlyjs

    sections: list[str] = []
    row = None
    n = 0
    for panel in panels:
        if panel.optional_only and not panel.has_data:
            continue  # DCGM: only where dcgm-exporter runs; the dashboard shows it, the report leaves it out
        if panel.row != row:
            if row is not None:
                sections.append("</div>")
            row = panel.row
            sections.append(f"<h2>{html.escape(row)}</h2><div class=grid>")
        body = ""
        if panel.kind == "table":
            body = _table_panel(panel)
        elif panel.has_data:
            n += 1
            body = _figure(panel, f"plot-{n}")
        empty = (f"<div class=empty>no data in this range: {html.escape(', '.join(panel.empty))}</div>"
                 if panel.empty else "")
        sections.append(f"<div class=panel><b>{html.escape(panel.title)}</b><p>{html.escape(panel.description)}</p>"
                        f"{body}{empty}</div>")
    if row is not None:
        sections.append("</div>")
    meta = (f"{_when(start)} to {_when(end)} ({end - start:.0f} s, a point every {step:g} s) from Prometheus at "
            f"{html.escape(redact(source))}; feedline {html.escape(__version__)}; made {_when(dt.datetime.now().timestamp())}")
    return (f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style><script>{_HEAD_SCRIPT}</script>"
            f"<script>{get_plotlyjs()}</script></head>\n"
            f"<body><h1>{html.escape(title)}</h1><div class=meta>{meta}</div>{_epochs(summary)}\n"
            + "\n".join(sections) + f"\n<script>{_CHECK_SCRIPT}</script></body></html>\n")


def plot_count(page: str) -> int:
    """How many plots a rendered page holds (the browser test compares it with what was drawn)."""
    return page.count('class="plotly-graph-div"')


def write(path: str, page: str) -> None:
    """Written whole or not at all: a reader never opens half a report."""
    import os

    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(page)
    os.replace(tmp, path)


def as_json(panels: Sequence[PanelData]) -> str:
    """The panels' data as JSON (``feedline report --json``): for scripts and tests."""
    return json.dumps([{"row": p.row, "title": p.title, "empty": p.empty, "lines": [
        {"name": line.name, "points": len(line.values), "last": line.values[-1] if line.values else None,
         "first": line.values[0] if line.values else None} for line in p.lines]} for p in panels], indent=1)
