"""What Grafana sends Prometheus for a panel: the dashboard's variables and interval macros substituted.

The panel test and ``feedline report`` evaluate the dashboard's queries through this one function, so
what they check or draw is what a user's Grafana asks for, not a hand-written stand-in:

- ``$__interval`` is the query's step: the time range over the panel's data points, never below the
  data source's minimum interval (``timeInterval`` in grafana/provisioning: the scrape interval);
- ``$__rate_interval`` is ``max($__interval + scrape interval, 4 × scrape interval)`` (Grafana's rule,
  so a ``rate()`` window always holds at least four scrapes);
- a multi-value variable left at "All" becomes its ``allValue`` (``.*``), a chosen value its
  regex-escaped text, several chosen values ``(a|b)``;
- a legend's ``{{label}}`` becomes the series' label value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ALL = ".*"  # the dashboard's allValue for $job and $instance
MAX_DATA_POINTS = 1000  # about a panel's width in pixels, Grafana's default for a time series panel


def parse_duration(text: str) -> float:
    """Prometheus' duration syntax (``15s``, ``1m30s``, ``2h``) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)", text.strip())
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"not a duration: {text!r} (e.g. 15s, 5m, 1h30m)")
    return sum(float(n) * units[u] for n, u in parts)


def _duration(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds))}s"


@dataclass(frozen=True)
class Variables:
    """The dashboard's template variables as a user left them: ``None`` is "All"."""

    job: Sequence[str] | None = None
    instance: Sequence[str] | None = None

    def value(self, name: str) -> str:
        chosen = getattr(self, name)
        if chosen is None:
            return ALL
        escaped = [re.escape(v) for v in chosen]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


@dataclass(frozen=True)
class Interval:
    """The step and rate window Grafana derives from a time range and the data source's scrape interval."""

    start: float
    end: float
    scrape_interval: float = 15.0
    max_data_points: int = MAX_DATA_POINTS
    step: float = field(init=False)
    rate_interval: float = field(init=False)

    def __post_init__(self) -> None:
        if self.end <= self.start:
            raise ValueError(f"the time range ends before it starts ({self.start} .. {self.end})")
        step = max(self.scrape_interval, (self.end - self.start) / self.max_data_points)
        object.__setattr__(self, "step", step)
        object.__setattr__(self, "rate_interval", max(step + self.scrape_interval, 4 * self.scrape_interval))


def substitute(expr: str, interval: Interval, variables: Variables = Variables()) -> str:
    """The PromQL Grafana sends for ``expr``."""
    out = expr.replace("$__rate_interval", _duration(interval.rate_interval))
    out = out.replace("$__interval", _duration(interval.step))
    for name in ("job", "instance"):
        out = out.replace(f"${{{name}}}", variables.value(name)).replace(f"${name}", variables.value(name))
    if "$" in out:
        raise ValueError(f"a variable Grafana would substitute is left in {out!r}")
    return out


def legend(template: str, labels: Mapping[str, str]) -> str:
    """A series' name from a legend format: ``{{stage}}`` -> the value of its ``stage`` label."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or "value"
