"""The sampler sidecar (``feedline sample``): plan -> fetch (N threads) -> verify -> index -> publish.

One object owns the fetch threads and the cache store; ``stop()`` (SIGTERM,
SIGINT) shuts the sockets of the downloads in flight, discards them and returns
within a couple of seconds. The loop watches ``readers/*.json`` for new loader
epochs and asks the policy how many shards to fetch; a shard that fails is tried
again later (``schedule.py``), never given up while the process runs. It takes
``SidecarSettings`` and pushes its statistics to the sink it is given; the face
serves them (and ``/readyz`` from ``ready()``).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..cache.readers import leased_ids, read_readers, remove_stale
from ..cache.ownership import claim_cache_dir
from ..cache.store import CACHE_FOLDERS, BudgetError, CacheDirError, CacheStore
from ..errors import SettingError
from ..formats.compressed import TooLarge, decompress
from ..formats.shard_index import ShardError
from ..formats.urls import is_remote, redact
from ..preflight import SHM_HEADROOM, check_memory_for, fmt_bytes, fs_space
from ..sink import NullSink, StatsSink
from .fetch import FetchAborted, Fetcher, FetchError
from .policy import FillPolicy, GrowPolicy, Policy, shard_plan
from .schedule import RetrySchedule
from .settings import SidecarSettings
from .sources import SourceError, SourceShard, list_shards

log = logging.getLogger("feedline.sampler")

PROBE_SHARDS = 8  # remote shards whose size is checked against the budget at start-up
PROBE_TIMEOUT = 10.0  # seconds one of those may take: the probe asks whether the store is up, not every shard
STOP_GRACE = 5.0  # seconds a stop waits for the downloads in flight to end (Kubernetes grants 30 before SIGKILL)
READER_STALE = 600.0  # seconds without a touch after which a reader's files go, where leases are off
RELEASE_EVERY = 5.0  # seconds between looks at the readers' leases (expiry) for evicted shards kept on disk
PROCESS_MEMORY = 128 << 20  # the sidecar's own memory, on top of the cache it writes


class Sidecar:
    """Keeps a bounded, epoch-growing shard cache filled from a source; ``run()`` until ``stop()``."""

    def __init__(self, settings: SidecarSettings, sink: StatsSink | None = None):
        self.settings = s = settings
        self.sink: StatsSink = sink if sink is not None else NullSink()
        self.cache_dir = os.path.abspath(s.cache)
        self.stop_event = threading.Event()
        self._wake = threading.Event()  # a fetch ended or a stop: the loop hands out the next shard at once
        self.fetcher = Fetcher.from_settings(s, self.stop_event,
                                             on_error=lambda reason: self.sink.inc("fetch_errors_total", reason=reason))
        self.shards = self._list_source()
        self._check_budget()
        try:
            self.store = CacheStore(self.cache_dir, s.budget,
                                    on_evict=lambda e: self.sink.inc("cache_evictions_total"),
                                    source_ids=frozenset(x.id for x in self.shards),
                                    leased=(lambda: leased_ids(self.cache_dir, s.reader_lease)) if s.reader_lease > 0
                                    else None, retain_bytes=self.retain_room())
        except CacheDirError as exc:
            raise SettingError("cache", str(exc)) from None
        self.policy: Policy = (GrowPolicy(s.initial_shards, s.grow_shards, s.replace_fraction)
                               if s.policy == "grow" else FillPolicy(s.fetch_threads, s.refresh_per_minute))
        self._plan = shard_plan(self.shards, s.seed)
        self._lock = threading.Lock()
        self._in_flight: dict[str, Future] = {}
        self._quota = 0
        self.schedule = RetrySchedule(maximum=s.retry_max_seconds)
        self.fetched = 0
        self.stuck: list[str] = []  # downloads still running when run() returned (see _drain)
        self._reconcile()

    # -- start-up checks ----------------------------------------------------------------------

    def _list_source(self) -> list[SourceShard]:
        s = self.settings
        try:
            shards = list_shards(s.source, self.fetcher.text, self.fetcher.list)
        except SourceError as exc:
            raise SettingError("source", str(exc)) from None
        except (OSError, FetchError) as exc:
            raise SettingError("source", f"{redact(s.source)!r} is unreachable: {exc}") from None
        if s.partition_count > 1:
            shards = shards[s.partition_index::s.partition_count]
            log.info("node partition %d of %d", s.partition_index, s.partition_count)
        if not shards:
            raise SettingError("source", f"{redact(s.source)!r} lists no shard"
                                         + (" for this partition" if s.partition_count > 1 else ""))
        self._largest_seen = self._probe([x for x in shards if is_remote(x.url)][:PROBE_SHARDS]) or max(
            (x.size or 0 for x in shards), default=0)
        log.info("source lists %d shards", len(shards))
        return shards

    def _probe(self, remote: list[SourceShard]) -> int:
        """The largest size among the first remote shards; refuses a store that is down or refuses us.

        A shard that does not answer in time is no reason to refuse: the store is up if any answers,
        and fetching tries every shard again until it comes. The shards are asked ``fetch_threads`` at a time,
        as they will be fetched: one after the other, a store 50 ms away would hold the start 8 round trips.
        """
        sizes = [x.size for x in remote if x.size is not None]
        unknown = [x for x in remote if x.size is None]
        answers: list[int | None | FetchError] = []
        if unknown:
            with ThreadPoolExecutor(min(len(unknown), self.settings.fetch_threads),
                                    thread_name_prefix="feedline-probe") as pool:
                answers = list(pool.map(self._size, unknown))
        problems = [a for a in answers if isinstance(a, FetchError)]
        denied = next((p for p in problems if p.reason == "denied"), None)
        if denied is not None:  # credentials or permissions: nothing will change by waiting
            raise SettingError("source", str(denied))
        sizes += [a for a in answers if isinstance(a, int)]
        if remote and not sizes and problems and all(p.reason == "connection" for p in problems):
            raise SettingError("source", f"{problems[0]}; is the store up and the URL right?")
        if remote and not sizes and problems and not any(p.retry for p in problems):
            raise SettingError("source", f"none of the first {len(remote)} shards exists: {problems[0]}; is the "
                                         f"URL (bucket, prefix, shard names) right?")
        if problems:
            log.warning("%d of the first %d shards did not answer the start-up probe (%s); starting anyway: "
                        "fetching tries them again", len(problems), len(remote), problems[0])
        return max(sizes, default=0)

    def _size(self, shard: SourceShard) -> int | None | FetchError:
        """One shard's size for ``_probe``, in a thread of its own; its connection closed with the probe."""
        try:
            return self.fetcher.size(shard.url, min(self.settings.fetch_timeout, PROBE_TIMEOUT))
        except FetchError as exc:
            return exc
        finally:
            self.fetcher.close_thread()

    def _check_budget(self) -> None:
        s = self.settings
        budget = s.budget
        if self._largest_seen and budget < self._largest_seen:
            raise SettingError("budget", f"{fmt_bytes(budget)} is smaller than a shard of "
                                         f"{fmt_bytes(self._largest_seen)}: set it to at least a few shards' worth")
        try:  # before anything in it is read: the cache must be this user's (cache/ownership.py)
            claim_cache_dir(self.cache_dir, CACHE_FOLDERS)
        except CacheDirError as exc:
            raise SettingError("cache", str(exc)) from None
        cached = 0
        for root, _, files in os.walk(self.cache_dir):
            cached += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        # downloads in flight, and the evicted shards kept for readers' leases (or held open by a running epoch)
        in_flight = self._largest_seen * s.fetch_threads + self.retain_room()
        size, free = fs_space(self.cache_dir)
        if free + cached < budget + in_flight:
            raise SettingError(
                "budget", f"{fmt_bytes(budget)} plus {s.fetch_threads} downloads in flight and the replaced shards "
                          f"an epoch still reads need {fmt_bytes(budget + in_flight)}, but the filesystem of the "
                          f"cache {self.cache_dir} has {fmt_bytes(free + cached)} for it ({fmt_bytes(size)} in all): "
                          f"lower the budget, or give /dev/shm more room (docker: shm_size; Kubernetes: the "
                          f"emptyDir's sizeLimit)")
        # tmpfs pages are charged to the memory limit of the container that writes them: this one
        mem = check_memory_for("the cache", max(0, budget + in_flight - cached) + PROCESS_MEMORY)
        if mem.ok is False:
            raise SettingError("budget", f"{mem.detail}; {mem.fix}")

    def retain_room(self) -> int:
        """Bytes the evicted shards that readers' leases keep may take beyond the budget: the replaced fraction of
        the budget, and at least two shards (one publish's victims). The store makes a publish wait rather than
        keep more, so the shards on disk stay within the budget plus this; the start-up check counts it."""
        s = self.settings
        if s.reader_lease <= 0:
            return 0
        return max(int(s.budget * s.replace_fraction), 2 * self._largest_seen)

    def _decompress_room(self) -> int:
        """What one decompression may write: never more than the budget (it could not be published), nor so much
        that the filesystem fills: the retain room not yet taken and some headroom stay free (a full /dev/shm
        fails every writer in it, the trainer's batch ring included). The shard may fill the budget's unfilled
        part: publishing it is what that room is for."""
        s = self.settings
        _, free = fs_space(self.cache_dir)
        reserved = max(0, self.retain_room() - self.store.retained_bytes) + SHM_HEADROOM
        return max(0, min(s.budget, free - reserved))

    def _reconcile(self) -> None:
        """The cache as this source has it, before anyone can ask ``ready()`` (the face serves /readyz from it once
        the sidecar exists): what a crash left is recovered, and shards the source now has in another format (a
        .tar became a .parquet of the same name) are evicted, so no reader is told to start on data the source
        no longer has."""
        self.store.recover()
        formats = {x.id: x.format for x in self.shards}
        stale = {e.id for e in self.store.entries if e.id in formats and e.format != formats[e.id]}
        if stale:
            log.warning("%d cached shard(s) are in another format than the source's now (%s, ...): evicted, to be "
                        "fetched anew", len(stale), sorted(stale)[0])
            self.store.evict(stale)

    # -- readiness --------------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        n = len(self.store.entries)
        store = self.schedule.describe(time.monotonic())
        if n >= self.settings.min_shards:
            return True, f"ready: {n} shards cached; {store}"
        if n and self.store.complete:
            return True, f"ready: the whole source is cached ({n} shards, fewer than min_shards="\
                         f"{self.settings.min_shards}); {store}"
        return False, f"not ready: {n} of min_shards={self.settings.min_shards} shards cached; {store}"

    # -- the loop -------------------------------------------------------------------------

    def _full(self) -> bool:
        entries = self.store.entries
        mean = (sum(e.bytes for e in entries) / len(entries)) if entries else self._largest_seen
        return self.store.total_bytes + mean > self.settings.budget

    def _next_shard(self, now: float) -> SourceShard | None:
        """The next shard of the plan to fetch now; None when none is due (or the whole source is cached)."""
        taken = self.store.ids() | set(self._in_flight)
        if len(taken) >= len(self.shards):
            return None
        for _ in range(2 * len(self.shards)):
            s = next(self._plan)
            if s.id not in taken and self.schedule.eligible(s.id, now):
                return s
        return None

    def _fetch_one(self, shard: SourceShard) -> None:
        partial = self.store.partial_path(shard.id)
        plain = partial + ".plain"
        try:
            result = self.fetcher.fetch(shard, partial, self.settings.budget)
            self.sink.inc("fetch_bytes_total", result.bytes)  # fetched, whatever becomes of them; before the publish
            if shard.compression is not None:  # published as the tar (or records) it holds: workers map plain files
                decompress(partial, plain, shard.compression, self._decompress_room(), self.stop_event.is_set)
                os.replace(plain, partial)
            self.store.publish(shard.id, partial, shard.shown, shard.sha256, shard.format, self.stop_event.is_set)
            self.sink.observe("fetch_seconds", result.seconds)
            self.schedule.succeeded(shard.id)
            self.fetched += 1
        except (FetchAborted, InterruptedError):
            log.info("stopping: discarded the partial download of %s", shard.id)
        except FetchError as exc:  # counted per attempt by the fetcher
            self._again(shard, str(exc), exc.store_down, exc.retry_after or 0.0)
        except TooLarge as exc:
            self.sink.inc("fetch_errors_total", reason="too_large")
            self._again(shard, exc.reason, False)
        except ShardError as exc:
            self.sink.inc("fetch_errors_total", reason="truncated" if "truncated" in exc.reason else "not_tar")
            self._again(shard, exc.reason, False)
        except BudgetError as exc:
            self.sink.inc("fetch_errors_total", reason="too_large")
            self._again(shard, str(exc), False)
        except OSError as exc:
            reason = "no_space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "connection"
            self.sink.inc("fetch_errors_total", reason=reason)
            self._again(shard, f"{reason}: {exc}", False)
        finally:
            for p in (partial, plain):
                if os.path.exists(p):
                    os.unlink(p)
            self._wake.set()

    def _again(self, shard: SourceShard, why: str, store_down: bool, at_least: float = 0.0) -> None:
        delay = self.schedule.failed(shard.id, store_down, time.monotonic(), at_least)
        log.warning("%s failed: %s; trying it again in %.0f s", shard.shown, why, delay)

    def _dispatch(self, pool: ThreadPoolExecutor) -> None:
        with self._lock:
            for sid in [k for k, f in self._in_flight.items() if f.done()]:
                self._in_flight.pop(sid)
            now = time.monotonic()
            while (self._quota > 0 and len(self._in_flight) < self.settings.fetch_threads
                   and self.schedule.allow(now, len(self._in_flight))):
                shard = self._next_shard(now)
                if shard is None:
                    if len(self.store.ids()) + len(self._in_flight) >= len(self.shards):
                        self._quota = 0  # the whole source is cached: nothing to add
                    break  # else: the rest wait for their next try; the quota stays
                self._quota -= 1
                self._in_flight[shard.id] = pool.submit(self._fetch_one, shard)

    def _report(self) -> None:
        now = time.monotonic()
        self.sink.set("fetch_retry_shards", self.schedule.waiting(now))
        self.sink.set("fetch_breaker_open", float(self.schedule.breaker_open(now)))
        self.sink.set("cache_bytes", self.store.total_bytes)
        self.sink.set("cache_budget_bytes", self.settings.budget)
        self.sink.set("cache_retained_bytes", self.store.retained_bytes)
        self.sink.set("cache_shards", len(self.store.entries))
        size, free = fs_space(self.cache_dir)
        self.sink.set("shm_bytes", size, kind="size")
        self.sink.set("shm_bytes", free, kind="free")

    def run(self) -> int:
        """Fill the cache until ``stop()``; returns the process exit code."""
        s = self.settings
        last_epoch = max((r.epoch for r in read_readers(self.cache_dir)), default=None)
        self._quota = self.policy.initial(len(self.store.entries))
        log.info("sampling into %s: budget %s, policy %s, %d fetch threads", self.cache_dir, fmt_bytes(s.budget),
                 s.policy, s.fetch_threads)
        pool = ThreadPoolExecutor(s.fetch_threads, thread_name_prefix="feedline-fetch")
        released, last_moved = 0.0, ()  # a reader that moved to another epoch frees what its last one kept
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
                moved = tuple((r.rank, r.epoch, r.updated_at) for r in readers)
                if moved != last_moved or time.monotonic() - released >= RELEASE_EVERY:
                    self.store.release()  # evicted shards kept for a reader's epoch, once no lease names them
                    self._drop_stale_readers()
                    released, last_moved = time.monotonic(), moved
                self._report()
                self._wake.wait(0.1)
                self._wake.clear()
        finally:
            self.stop_event.set()
            self.stuck = self._drain(pool)
            for p in os.listdir(self.store.partial_dir):
                os.unlink(os.path.join(self.store.partial_dir, p))
            self._drop_stale_readers()
            self._report()
        log.info("stopped: %d shards cached (%s)", len(self.store.entries), fmt_bytes(self.store.total_bytes))
        return 0

    def _drain(self, pool: ThreadPoolExecutor) -> list[str]:
        """Wait for the downloads in flight to end (``stop()`` cut them), at most STOP_GRACE seconds; the ids of
        those still running then. An object store's client blocked in a read of a store that drips bytes
        cannot be interrupted (obstore, boto3): the process leaves without it rather than outlive its
        SIGTERM-to-SIGKILL grace, its partial file removed (``stuck``; the CLI exits at once)."""
        pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            futures = dict(self._in_flight)
        _, running = wait(futures.values(), timeout=STOP_GRACE)
        stuck = sorted(sid for sid, f in futures.items() if f in running)
        if stuck:
            log.warning("%d download(s) did not stop within %.0f s of the stop (%s): their store's client cannot be "
                        "interrupted mid-read; their partial files are removed and the sidecar exits without them",
                        len(stuck), STOP_GRACE, ", ".join(stuck[:5]))
        return stuck

    def _drop_stale_readers(self) -> None:
        """A killed trainer's reader files go once stale (``reader_lease``, else READER_STALE, without a touch)."""
        gone = remove_stale(self.cache_dir, self.settings.reader_lease or READER_STALE)
        if gone:
            log.info("removed the reader files of rank(s) %s: not touched for %.0f s", ", ".join(map(str, gone)),
                     self.settings.reader_lease or READER_STALE)

    def stop(self) -> None:
        """Stop within seconds: downloads in flight are cut (their sockets shut) and discarded."""
        self.stop_event.set()
        self._wake.set()
        self.fetcher.abort()
