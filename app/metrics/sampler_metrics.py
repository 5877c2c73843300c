"""The sampler sidecar's metrics (DESIGN.md, Metrics), pre-initialised so every series exists at 0."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from .. import __version__
from ..sampler.fetch import FETCH_ERRORS

disable_created_metrics()  # no *_created series: nothing on the dashboard would use them

FETCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class SamplerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.cache_bytes = Gauge("feedline_cache_bytes", "Bytes of published shards in the cache.", registry=r)
        self.cache_budget_bytes = Gauge("feedline_cache_budget_bytes", "The cache's byte budget.", registry=r)
        self.cache_shards = Gauge("feedline_cache_shards", "Published shards in the cache.", registry=r)
        self.cache_evictions = Counter("feedline_cache_evictions_total", "Shards evicted from the cache.",
                                       registry=r)
        self.fetch_bytes = Counter("feedline_fetch_bytes_total", "Bytes of shards fetched and published.",
                                   registry=r)
        self.fetch_errors = Counter("feedline_fetch_errors_total", "Failed shard fetch attempts, by reason.",
                                    ["reason"], registry=r)
        self.fetch_seconds = Histogram("feedline_fetch_seconds", "Time to fetch one shard, retries included.",
                                       buckets=FETCH_BUCKETS, registry=r)
        self.shm_bytes = Gauge("feedline_shm_bytes", "Size and free bytes of the cache filesystem.", ["kind"],
                               registry=r)
        self.build_info = Gauge("feedline_build_info", "Build metadata; the value is 1.", ["version"], registry=r)
        for reason in FETCH_ERRORS:
            self.fetch_errors.labels(reason=reason)
        for kind in ("size", "free"):
            self.shm_bytes.labels(kind=kind)
        self.build_info.labels(version=__version__).set(1)

    def observe_cache(self, total_bytes: int, budget: int, shards: int, cache_dir: str) -> None:
        self.cache_bytes.set(total_bytes)
        self.cache_budget_bytes.set(budget)
        self.cache_shards.set(shards)
        st = os.statvfs(cache_dir)
        self.shm_bytes.labels(kind="size").set(st.f_blocks * st.f_frsize)
        self.shm_bytes.labels(kind="free").set(st.f_bavail * st.f_frsize)
