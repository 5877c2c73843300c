"""The few calls of Prometheus' HTTP API a report needs: a range query and the scrape interval."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from ..formats.urls import redact, redact_text
from ..metrics.grafana import parse_duration


class PrometheusError(RuntimeError):
    """Prometheus did not answer, or refused a query: the message names the URL and the query."""


@dataclass(frozen=True)
class Series:
    """One series of a range query: its labels and its points (NaN points dropped: Grafana draws none)."""

    labels: dict[str, str]
    times: list[float]
    values: list[float]


class PrometheusAPI:
    """A Prometheus server's HTTP API at ``url`` (``http://host:9090``)."""

    def __init__(self, url: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.shown = redact(self.url)  # what errors say: a user or a token in the URL stays out of them
        self.timeout = timeout

    def _get(self, path: str, **params: Any) -> Any:
        where = f"{self.url}/api/v1/{path}"
        try:
            with urllib.request.urlopen(f"{where}?{urllib.parse.urlencode(params)}", timeout=self.timeout) as r:
                doc = json.load(r)
        except urllib.error.HTTPError as exc:  # a refused query: Prometheus says why in the body
            try:
                doc = json.load(exc)
            except ValueError:
                raise PrometheusError(f"Prometheus at {self.shown}: HTTP {exc.code} for {path}") from None
        except (OSError, ValueError) as exc:
            raise PrometheusError(f"Prometheus at {self.shown} did not answer ({redact_text(str(exc))}); is it "
                                  f"running? (--prometheus URL)") from None
        if doc.get("status") != "success":
            raise PrometheusError(f"Prometheus at {self.shown} refused {params.get('query', path)!r}: "
                                  f"{doc.get('error', doc)}")
        return doc["data"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        data = self._get("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:.3f}")
        out = []
        for result in data["result"]:
            points = [(float(t), float(v)) for t, v in result["values"]]
            points = [(t, v) for t, v in points if not math.isnan(v)]
            out.append(Series(result["metric"], [t for t, _ in points], [v for _, v in points]))
        return out

    def scrape_interval(self, default: float = 15.0) -> float:
        """The global scrape interval of the server's configuration (Grafana's minimum step for it)."""
        config = self._get("status/config").get("yaml", "")
        found = re.search(r"^\s+scrape_interval:\s*(\S+)", config, re.M)
        return parse_duration(found.group(1)) if found else default
