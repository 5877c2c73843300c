"""The sampler sidecar (``feedline sample``): plan -> fetch (N threads) -> verify -> index -> publish.

One object owns the fetch threads, the cache store and the metrics server;
``stop()`` (SIGTERM, SIGINT) discards the shards in flight and returns within
a few seconds. The loop watches ``readers/*.json`` for new loader epochs and
asks the policy how many shards to fetch.
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor

from ..cache.readers import read_readers
from ..cache.store import BudgetError, CacheStore
from ..config import Config, ConfigError
from ..formats.shard_index import ShardError
from ..metrics.exporter import MetricsServer
from ..metrics.sampler_metrics import SamplerMetrics
from ..preflight import check_memory_for, fmt_bytes, fs_space
from .fetch import FetchAborted, FetchError, Fetcher, RateLimiter
from .policy import FillPolicy, GrowPolicy, Policy, shard_plan
from .sources import SourceError, SourceShard, list_shards

log = logging.getLogger("feedline.sampler")

DEFAULT_CACHE = "/dev/shm/feedline"
DEFAULT_PORT = 9101
PROBE_SHARDS = 8  # HTTP shards whose size is checked against the budget at start-up
PROCESS_MEMORY = 128 << 20  # the sidecar's own memory, on top of the cache it writes


def _request(method: str, url: str, timeout: float) -> tuple[int, str, str | None, bytes]:
    """One plain request: (status, reason, Content-Length, body)."""
    u = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = cls(u.netloc, timeout=timeout)
    try:
        conn.request(method, u.path + (f"?{u.query}" if u.query else ""))
        resp = conn.getresponse()
        return resp.status, resp.reason, resp.getheader("Content-Length"), resp.read()
    finally:
        conn.close()


def _fetch_text(url: str, timeout: float) -> str:
    status, reason, _, body = _request("GET", url, timeout)
    if status != 200:
        raise SourceError(f"index {url}: HTTP {status} {reason}")
    return body.decode()


def _head_size(url: str, timeout: float) -> int | None:
    status, _, length, _ = _request("HEAD", url, timeout)
    return int(length) if status == 200 and length and length.isdigit() else None


class Sidecar:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.cache_dir = os.path.abspath(cfg.cache or DEFAULT_CACHE)
        self.stop_event = threading.Event()
        self.metrics = SamplerMetrics()
        self.shards = self._list_source()
        self._check_budget()
        self.store = CacheStore(self.cache_dir, cfg.budget, on_evict=lambda e: self.metrics.cache_evictions.inc())
        self.policy: Policy = (GrowPolicy(cfg.initial_shards, cfg.grow_shards, cfg.replace_fraction)
                               if cfg.policy == "grow" else FillPolicy(cfg.fetch_threads, cfg.refresh_per_minute))
        self.fetcher = Fetcher(cfg.fetch_timeout, cfg.retries, self.stop_event, RateLimiter(cfg.max_mbps * 1e6),
                               on_error=lambda reason: self.metrics.fetch_errors.labels(reason=reason).inc())
        self._plan = shard_plan(self.shards, cfg.seed)
        self._lock = threading.Lock()
        self._in_flight: dict[str, Future] = {}
        self._quota = 0
        self._failed: set[str] = set()
        self.server: MetricsServer | None = None
        self.fetched = 0

    # -- start-up checks ----------------------------------------------------------------------

    def _list_source(self) -> list[SourceShard]:
        try:
            shards = list_shards(self.cfg.source, lambda url: _fetch_text(url, self.cfg.fetch_timeout))
        except SourceError as exc:
            raise ConfigError(f"source (--source / FEEDLINE_SOURCE): {exc}") from None
        except OSError as exc:
            raise ConfigError(f"source (--source / FEEDLINE_SOURCE) {self.cfg.source!r} is unreachable: {exc}") \
                from None
        if self.cfg.partition_count > 1:
            shards = shards[self.cfg.partition_index::self.cfg.partition_count]
            log.info("node partition %d of %d", self.cfg.partition_index, self.cfg.partition_count)
        if not shards:
            raise ConfigError(f"source (--source / FEEDLINE_SOURCE) {self.cfg.source!r} lists no shard"
                              + (" for this partition" if self.cfg.partition_count > 1 else ""))
        http_shards = [s for s in shards if s.is_http]
        if http_shards:
            probe = http_shards[:PROBE_SHARDS]
            sizes = []
            for s in probe:
                try:
                    size = s.size if s.size is not None else _head_size(s.url, self.cfg.fetch_timeout)
                except OSError as exc:
                    raise ConfigError(f"source (--source / FEEDLINE_SOURCE): {s.url} is unreachable ({exc}); "
                                      f"is the store up and the URL right?") from None
                if size is not None:
                    sizes.append(size)
            self._largest_seen = max(sizes, default=0)
        else:
            self._largest_seen = max((s.size or 0 for s in shards), default=0)
        log.info("source lists %d shards", len(shards))
        return shards

    def _check_budget(self) -> None:
        budget = self.cfg.budget
        if self._largest_seen and budget < self._largest_seen:
            raise ConfigError(f"budget (--budget / FEEDLINE_BUDGET) is {fmt_bytes(budget)}, smaller than a shard of "
                              f"{fmt_bytes(self._largest_seen)}: set it to at least a few shards' worth")
        os.makedirs(self.cache_dir, exist_ok=True)
        cached = 0
        for root, _, files in os.walk(self.cache_dir):
            cached += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        # downloads in flight, and (grow) the replaced shards a running epoch still holds open
        in_flight = self._largest_seen * self.cfg.fetch_threads
        if self.cfg.policy == "grow":
            in_flight += int(budget * self.cfg.replace_fraction)
        size, free = fs_space(self.cache_dir)
        if free + cached < budget + in_flight:
            raise ConfigError(
                f"budget (--budget / FEEDLINE_BUDGET) {fmt_bytes(budget)} plus {self.cfg.fetch_threads} downloads in "
                f"flight and the replaced shards an epoch still reads need {fmt_bytes(budget + in_flight)}, but the "
                f"filesystem of cache {self.cache_dir} (--cache / "
                f"FEEDLINE_CACHE) has {fmt_bytes(free + cached)} for it ({fmt_bytes(size)} in all): lower the "
                f"budget, or give /dev/shm more room (docker: shm_size; Kubernetes: the emptyDir's sizeLimit)"
            )
        # tmpfs pages are charged to the memory limit of the container that writes them: this one
        mem = check_memory_for("the cache", max(0, budget + in_flight - cached) + PROCESS_MEMORY)
        if mem.ok is False:
            raise ConfigError(f"budget (--budget / FEEDLINE_BUDGET): {mem.detail}; {mem.fix}")

    # -- readiness --------------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        n = len(self.store.entries)
        if n >= self.cfg.min_shards:
            return True, f"ready: {n} shards cached"
        return False, f"not ready: {n} of min_shards={self.cfg.min_shards} shards cached"

    # -- the loop -------------------------------------------------------------------------

    def _full(self) -> bool:
        entries = self.store.entries
        mean = (sum(e.bytes for e in entries) / len(entries)) if entries else self._largest_seen
        return self.store.total_bytes + mean > self.cfg.budget

    def _next_shard(self) -> SourceShard | None:
        cached = self.store.ids() | set(self._in_flight) | self._failed
        if len(cached) >= len(self.shards):
            return None  # the whole source is cached (or failed): nothing new to add
        for _ in range(2 * len(self.shards)):
            s = next(self._plan)
            if s.id not in cached:
                return s
        return None

    def _fetch_one(self, shard: SourceShard) -> None:
        partial = self.store.partial_path(shard.id)
        try:
            result = self.fetcher.fetch(shard, partial, self.cfg.budget)
            self.store.publish(shard.id, partial, shard.url, shard.sha256)
            self.metrics.fetch_bytes.inc(result.bytes)
            self.metrics.fetch_seconds.observe(result.seconds)
            self.fetched += 1
        except FetchAborted:
            log.info("stopping: discarded the partial download of %s", shard.id)
        except FetchError as exc:  # counted per attempt by the fetcher
            self._failed.add(shard.id)
            log.warning("skipping %s: %s", shard.url, exc)
        except ShardError as exc:
            reason = "truncated" if "truncated" in exc.reason else "not_tar"
            self.metrics.fetch_errors.labels(reason=reason).inc()
            self._failed.add(shard.id)
            log.warning("skipping %s: %s", shard.url, exc.reason)
        except BudgetError as exc:
            self.metrics.fetch_errors.labels(reason="too_large").inc()
            self._failed.add(shard.id)
            log.warning("skipping %s", exc)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)

    def _dispatch(self, pool: ThreadPoolExecutor) -> None:
        with self._lock:
            for sid in [k for k, f in self._in_flight.items() if f.done()]:
                self._in_flight.pop(sid)
            while self._quota > 0 and len(self._in_flight) < self.cfg.fetch_threads:
                shard = self._next_shard()
                if shard is None:
                    self._quota = 0
                    break
                self._quota -= 1
                self._in_flight[shard.id] = pool.submit(self._fetch_one, shard)

    def run(self) -> int:
        """Serve until stop(); returns the process exit code."""
        self.store.recover()
        port = self.cfg.metrics_port if self.cfg.metrics_port >= 0 else DEFAULT_PORT
        self.server = MetricsServer(self.metrics.registry, self.cfg.metrics_addr, port, self.ready,
                                    setting="--metrics-port / FEEDLINE_METRICS_PORT")
        last_epoch = max((r.epoch for r in read_readers(self.cache_dir)), default=None)
        self._quota = self.policy.initial(len(self.store.entries))
        log.info("sampling into %s: budget %s, policy %s, %d fetch threads", self.cache_dir,
                 fmt_bytes(self.cfg.budget), self.cfg.policy, self.cfg.fetch_threads)
        pool = ThreadPoolExecutor(self.cfg.fetch_threads, thread_name_prefix="feedline-fetch")
        try:
            while not self.stop_event.is_set():
                readers = read_readers(self.cache_dir)
                epoch = max((r.epoch for r in readers), default=None)
                if epoch is not None and epoch != last_epoch:
                    add = self.policy.on_epoch(epoch, len(self.store.entries), self._full())
                    log.info("loader epoch %d started; fetching %d more shard(s)", epoch, add)
                    self._quota += add
                    last_epoch = epoch
                self._quota += self.policy.keep_busy(self._full(), time.monotonic(),
                                                     self._quota + len(self._in_flight))
                self._dispatch(pool)
                self.metrics.observe_cache(self.store.total_bytes, self.cfg.budget, len(self.store.entries),
                                           self.cache_dir)
                self.stop_event.wait(0.1)
        finally:
            self.stop_event.set()
            pool.shutdown(wait=True, cancel_futures=True)
            self.server.close()
            for p in os.listdir(self.store.partial_dir):
                os.unlink(os.path.join(self.store.partial_dir, p))
        log.info("stopped: %d shards cached (%s)", len(self.store.entries), fmt_bytes(self.store.total_bytes))
        return 0

    def stop(self) -> None:
        self.stop_event.set()

