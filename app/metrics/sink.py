"""``PrometheusSink``: the ``StatsSink`` the face gives a loader or a sampler, exposed as ``/metrics``.

It keeps the pushed values itself (one short lock per push) and is a
prometheus_client collector over them, so each process serves exactly what its
library part reported — no multiprocess mode, nothing read back from the parts.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .catalog import BUILD_INFO, PREFIX, MetricDef


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, n in zip([repr(float(b)) for b in self.buckets] + ["+Inf"], self.counts):
            total += n
            out.append((bound, float(total)))
        return out


class PrometheusSink(Collector):
    """Counters, gauges and histograms of one process, pushed by name, collected at scrape time."""

    def __init__(self, catalog: tuple[MetricDef, ...], const_labels: Mapping[str, str] | None = None,
                 registry: CollectorRegistry | None = None, parts: tuple[str, str, ...] | None = None):
        """``parts``: (label, value, value, ...) — one process serving several parts of the same kind (a
        sidecar mixing sources: ``("source", "web", "curated")``); every series but build_info carries it."""
        self._defs = {d.name: d for d in catalog}
        self._const = dict(const_labels or {})
        self._part_label = parts[0] if parts else None
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str, str], float] = {}
        self._hists: dict[tuple[str, str], _Histogram] = {}
        for part in (parts[1:] if parts else ("",)):
            for d in catalog:
                if d.name == BUILD_INFO.name:  # one per process, whatever its parts
                    continue
                if d.kind == "histogram":
                    self._hists[(d.name, part)] = _Histogram(d.buckets)
                else:
                    for v in d.values or ("",):
                        self._values[(d.name, v, part)] = 0.0
        self._values[(BUILD_INFO.name, BUILD_INFO.values[0], "")] = 1.0
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)

    def _key(self, name: str, labels: Mapping[str, str]) -> tuple[str, str, str]:
        d = self._defs[name]  # an unknown name is a bug in the caller: KeyError
        part = labels[self._part_label] if self._part_label is not None else ""
        return name, (labels[d.label] if d.label is not None else ""), part

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = self._key(name, labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        key = self._key(name, labels)
        with self._lock:
            self._values[key] = float(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        h = self._hists[(name, labels[self._part_label] if self._part_label is not None else "")]
        with self._lock:
            h.observe(value)

    def value(self, name: str, **labels: str) -> float:
        """The current value of a counter or gauge series (for tests and summaries)."""
        with self._lock:
            return self._values.get(self._key(name, labels), 0.0)

    def collect(self) -> Iterator[Metric]:
        const_names, const_values = list(self._const), list(self._const.values())
        with self._lock:
            values = dict(self._values)
            hists = {key: (h.cumulative(), h.sum) for key, h in self._hists.items()}
        parted = self._part_label is not None
        for d in self._defs.values():
            full = PREFIX + d.name
            own = parted and d.name != BUILD_INFO.name
            labels = const_names + ([self._part_label] if own else []) + ([d.label] if d.label else [])
            if d.kind == "histogram":
                fam: Metric = HistogramMetricFamily(full, d.help, labels=labels)
                for (name, part), (buckets, total) in hists.items():
                    if name == d.name:
                        fam.add_metric(const_values + ([part] if own else []), buckets, total)
                yield fam
                continue
            if d.kind == "counter":
                fam = CounterMetricFamily(full.removesuffix("_total"), d.help, labels=labels)
            else:
                fam = GaugeMetricFamily(full, d.help, labels=labels)
            for (name, v, part), x in values.items():
                if name == d.name:
                    fam.add_metric(const_values + ([part] if own else []) + ([v] if d.label else []), x)
            yield fam
