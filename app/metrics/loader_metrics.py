"""The trainer's metrics (DESIGN.md, Metrics), read from ``StagingLoader.stats()`` at scrape time.

A collector, not live counters: the training loop's hot path pays nothing for
metrics, and every series exists (at 0) from the first scrape. Labels are of
low cardinality only: queue, state, stage, reason, and ``rank`` where torchrun
gives one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import __version__
from ..loader.stats import LoaderStats

log = logging.getLogger("feedline.metrics")


def _histogram(name: str, doc: str, h, labels: dict[str, str]) -> HistogramMetricFamily:  # type: ignore[no-untyped-def]
    fam = HistogramMetricFamily(name, doc, labels=list(labels))
    buckets = [(("+Inf" if b == float("inf") else repr(float(b))), float(n)) for b, n in h.cumulative()]
    fam.add_metric(list(labels.values()), buckets, h.sum)
    return fam


class LoaderCollector(Collector):
    """Turns one loader's stats snapshot into metric families; never raises into the scrape."""

    def __init__(self, stats: Callable[[], LoaderStats], rank: int | None = None):
        self._stats = stats
        self._base = {"rank": str(rank)} if rank is not None else {}
        self._failed_once = False

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stats()
        except Exception as exc:  # an exporter that cannot serve must never stop training
            if not self._failed_once:
                log.warning("cannot read the loader's statistics for /metrics: %s (logged once)", exc)
                self._failed_once = True
            return
        yield from self.families(s)

    def _one(self, fam_cls, name: str, doc: str, value: float, **labels: str):  # type: ignore[no-untyped-def]
        lab = {**self._base, **labels}
        fam = fam_cls(name, doc, labels=list(lab))
        fam.add_metric(list(lab.values()), value)
        return fam

    def _many(self, fam_cls, name: str, doc: str, label: str, values: dict):  # type: ignore[no-untyped-def]
        fam = fam_cls(name, doc, labels=[*self._base, label])
        for key, value in values.items():
            fam.add_metric([*self._base.values(), key], value)
        return fam

    def families(self, s: LoaderStats) -> Iterator[Metric]:
        b = self._base
        yield self._one(CounterMetricFamily, "feedline_data_wait_seconds",
                        "Time the training loop spent blocked in next(loader), nothing else.",
                        s.data_wait_seconds_total)
        yield _histogram("feedline_data_wait_seconds", "Time blocked in one next(loader) call.",
                         s.data_wait_seconds, b)
        yield self._one(CounterMetricFamily, "feedline_step_seconds",
                        "Wall time between consecutive next(loader) calls returning (the consumer's step).",
                        s.step_seconds_total)
        yield self._one(GaugeMetricFamily, "feedline_gpu_starvation_ratio",
                        "Data wait / (data wait + step) over the loader's sliding window.", s.gpu_starvation_ratio)
        yield self._many(GaugeMetricFamily, "feedline_queue_depth", "Items in each queue of the batch ring.",
                         "queue", s.queue_depth)
        yield self._many(GaugeMetricFamily, "feedline_queue_capacity", "Capacity of each queue of the batch ring.",
                         "queue", s.queue_capacity)
        yield self._many(GaugeMetricFamily, "feedline_workers", "Decode worker processes, busy or idle.",
                         "state", s.workers)
        yield self._one(CounterMetricFamily, "feedline_samples", "Samples decoded into the batch ring.",
                        s.samples_total)
        yield self._many(CounterMetricFamily, "feedline_bytes",
                         "Bytes per stage: read from shards, decoded into the ring, transferred to the loop.",
                         "stage", s.bytes_total)
        yield _histogram("feedline_h2d_seconds", "Host-to-device copy time per batch (a host copy on CPU hosts).",
                         s.h2d_seconds, b)
        yield self._one(CounterMetricFamily, "feedline_h2d_wait_seconds",
                        "Time the consumer's CUDA stream waited on the copy event (CUDA only).",
                        s.h2d_wait_seconds_total)
        yield self._many(CounterMetricFamily, "feedline_sample_errors",
                         "Samples skipped: corrupt, too large, missing field, ...", "reason", s.sample_errors_total)
        yield self._one(CounterMetricFamily, "feedline_worker_restarts",
                        "Worker processes replaced after a crash.", s.worker_restarts_total)
        yield self._one(GaugeMetricFamily, "feedline_loader_epoch", "The epoch the loader is in.", s.epoch)


class BuildInfo(Collector):
    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily("feedline_build_info", "Build metadata; the value is 1.", labels=["version"])
        fam.add_metric([__version__], 1)
        yield fam


def torchrun_rank() -> int | None:
    """The rank label: only where torchrun (or the launcher) says there are ranks."""
    return int(os.environ["RANK"]) if "RANK" in os.environ else None
