"""What ``from feedline import StagingLoader`` gives: the library loader, plus a metrics endpoint on request
and a sampler sidecar of its own for remote shards.

The library's ``feedline.loader.loader.StagingLoader`` serves nothing, knows no
Prometheus and reads local files; this front wires the face's parts to it: with
``metrics_port=`` it starts this process's ``/metrics``, ``/healthz`` and ``/readyz``
(the port is bound first, so one in use is refused before any worker starts) and
hands the loader the exporter's sink; with remote ``shards=`` (URLs, ``pipe:``) it
starts and owns a sidecar (``owned_sidecar.py``) and reads its cache. Both close with
the loader.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from .config import Config, ConfigError, parse_size
from .owned_sidecar import OwnedSidecar, remote_source, split_shards
from ..loader import loader
from ..loader.plan.rank import Rank
from ..metrics.catalog import LOADER
from ..metrics.exporter import Exporter
from ..sink import StatsSink, combine

METRICS_PORT_SETTING = "metrics_port (--metrics-port / FEEDLINE_METRICS_PORT)"


class StagingLoader(loader.StagingLoader):
    """The staging loader; ``metrics_port`` (0: a free port) and ``metrics_addr`` serve its metrics; remote
    ``shards`` are fetched by a sidecar it owns into ``cache`` (default ``/dev/shm/feedline-<uid>-<hash>``), at
    most ``cache_budget`` bytes (default: half the free space there, at most 16 GiB), removed on close unless
    ``keep_cache``."""

    def __init__(self, *args: Any, metrics_port: int | None = None, metrics_addr: str = "127.0.0.1",
                 sink: StatsSink | None = None, cache_budget: int | str | None = None, keep_cache: bool = False,
                 **kwargs: Any):
        self.metrics: Exporter | None = None
        self.sidecar: OwnedSidecar | None = None
        source = remote_source(split_shards(args, kwargs))
        if source is None and (cache_budget is not None or keep_cache):
            raise ConfigError("cache_budget and keep_cache are for remote shards= (URLs or pipe:), which the loader "
                              "fetches with a sidecar of its own; local shards and cache= need neither")
        if source is not None:
            args, kwargs = args[1:], {k: v for k, v in kwargs.items() if k != "shards"}
            min_shards = int(kwargs.get("min_shards", 1))
            budget = parse_size(cache_budget) if cache_budget is not None else None
            self.sidecar = OwnedSidecar(source, cache=kwargs.pop("cache", None), budget=budget,
                                        min_shards=min_shards, keep_cache=keep_cache)
            kwargs["cache"] = self.sidecar.cache
            try:
                self.sidecar.wait(min_shards, float(kwargs.get("wait_timeout", 60.0)))
            except BaseException:
                self.sidecar.close()
                raise
        try:
            self._start(args, metrics_port, metrics_addr, sink, kwargs)
        except BaseException:
            if self.sidecar is not None:
                self.sidecar.close()
            raise

    def _start(self, args: Any, metrics_port: int | None, metrics_addr: str, sink: StatsSink | None,
               kwargs: dict[str, Any]) -> None:
        if metrics_port is None:
            super().__init__(*args, sink=sink, **kwargs)
            return
        launched = Rank.launched()
        exporter = Exporter(LOADER, metrics_addr, metrics_port, setting=METRICS_PORT_SETTING,
                            const_labels={"rank": str(launched.rank)} if launched is not None else None)
        try:
            super().__init__(*args, sink=combine(sink, exporter.sink), **kwargs)
        except BaseException:
            exporter.close()
            raise
        self.metrics = exporter
        exporter.server.before_scrape = self.flush_stats  # a scrape sees every batch handed out so far
        self.count_thread(exporter.thread)
        self._close_metrics = weakref.finalize(self, exporter.close)

    @classmethod
    def from_env(cls, shards: Any = None, *, env: dict[str, str] | None = None, **kwargs: Any) -> "StagingLoader":
        """A loader set up the way the appliance is: the ``FEEDLINE_*`` settings compose and Kubernetes pass
        (cache or shards, batch size, workers, device, ...; ``feedline train``'s defaults where unset), the
        metrics endpoint on FEEDLINE_METRICS_PORT (9102; + LOCAL_RANK under torchrun), and the caller's
        data code (``spec=``, ``transform=``, ``decode=``). A keyword argument wins over its setting."""
        cfg = Config.load(env=env)
        settings = cfg.loader_settings()
        settings = settings.replace(**{k: kwargs.pop(k) for k in list(kwargs) if k in settings.names()})
        if shards is not None:
            source: dict[str, Any] = {"shards": shards}
        elif "cache" in kwargs:
            source = {"cache": kwargs.pop("cache")}
        elif "sources" in kwargs:
            source = {"sources": kwargs.pop("sources")}
        elif cfg.cache or cfg.shards or cfg.mix:
            source = cfg.loader_source()
        else:
            raise ConfigError("StagingLoader.from_env needs data: set FEEDLINE_CACHE (the sidecar's cache), "
                              "FEEDLINE_SHARDS or FEEDLINE_MIX, or pass shards= / cache= / sources=")
        if "metrics_port" not in kwargs:
            kwargs["metrics_port"] = cfg.trainer_port(int(os.environ.get("LOCAL_RANK", 0)))
            kwargs.setdefault("metrics_addr", cfg.metrics_addr)
        return cls.from_settings(settings, **source, **kwargs)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.metrics is not None:
                self._close_metrics()
            if self.sidecar is not None:
                self.sidecar.close()
