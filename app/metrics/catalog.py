"""Every metric feedline exports (DESIGN.md, Metrics): name, type, help, label and its values.

One table for both processes. The library parts push by these names (without
the ``feedline_`` prefix) to their ``StatsSink``; ``PrometheusSink`` exposes
them, every series present at 0 from the first scrape.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import __version__
from ..loader.cost import THREAD_ROLES
from ..loader.stats import BYTE_STAGES, DIRECTIONS, ERROR_REASONS, PLACES, QUEUES, RESTART_REASONS, TIME_BUCKETS
from ..sampler.errors import FETCH_ERRORS

PREFIX = "feedline_"
FETCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class MetricDef:
    """One metric family: counters are named with their ``_total`` suffix, as pushed and exported."""

    name: str
    kind: str  # counter | gauge | histogram
    help: str
    label: str | None = None
    values: tuple[str, ...] = ()  # the label's values, each a series from the start
    buckets: tuple[float, ...] = ()


BUILD_INFO = MetricDef("build_info", "gauge", "Build metadata; the value is 1.", "version", (__version__,))

LOADER: tuple[MetricDef, ...] = (
    MetricDef("data_wait_seconds_total", "counter", "Time the training loop spent blocked in next(loader), "
              "nothing else."),
    MetricDef("data_wait_seconds", "histogram", "Time blocked in one next(loader) call.", buckets=TIME_BUCKETS),
    MetricDef("step_seconds_total", "counter", "Wall time between consecutive next(loader) calls returning "
              "(the consumer's step)."),
    MetricDef("gpu_starvation_ratio", "gauge", "Data wait / (data wait + step) over the loader's sliding window."),
    MetricDef("queue_depth", "gauge", "Items in each queue of the batch ring.", "queue", QUEUES),
    MetricDef("queue_capacity", "gauge", "Capacity of each queue of the batch ring.", "queue", QUEUES),
    MetricDef("workers", "gauge", "Decode worker processes, busy or idle.", "state", ("busy", "idle")),
    MetricDef("transfer_threads", "gauge", "Transfer threads in the trainer process, as set or as auto chose "
              "them (0 on a CPU host, which needs none)."),
    MetricDef("placed_cpus", "gauge", "CPUs CPU placement gave each side of this rank: the training process "
              "(its launching threads, on cores of their own) and its decode workers; 0 and 0 when nothing is "
              "pinned (placement off, or not possible here).", "side", ("trainer", "workers")),
    MetricDef("kept_batches_copied_total", "counter", "Batches copied out of the ring because the training loop "
              "still held them (copy mode on a CPU host; a loop that keeps nothing copies nothing)."),
    MetricDef("samples_total", "counter", "Samples decoded into the batch ring."),
    MetricDef("batches_decoded_total", "counter", "Batches decoded into the batch ring, by place: a local worker "
              "process, or a Ray actor of the remote decode cluster (remote=).", "place", PLACES),
    MetricDef("worker_places", "gauge", "Worker places by where their last batch was decoded: here, or by a Ray "
              "actor (remote=); remote falling to 0 mid-run: the actors or the cluster are gone.", "place", PLACES),
    MetricDef("decode_seconds_total", "counter", "Time spent decoding batches (read, decode, transform, write), "
              "by place: local worker processes, or the Ray actors of remote decoding.", "place", PLACES),
    MetricDef("remote_redone_batches_total", "counter", "Remote batches sent again to a new actor after theirs was "
              "lost (killed, its node gone): decoded once more, delivered once."),
    MetricDef("remote_bytes_total", "counter", "Bytes between this node and its remote decode actors: encoded "
              "samples sent, batch slots received.", "direction", DIRECTIONS),
    MetricDef("bytes_total", "counter", "Bytes per stage: read from shards, decoded into the ring, transferred "
              "to the loop.", "stage", BYTE_STAGES),
    MetricDef("h2d_seconds", "histogram", "Host-to-device copy time of a batch, sampled (one batch in 16 with "
              "h2d=slot).", buckets=TIME_BUCKETS),
    MetricDef("h2d_wait_seconds_total", "counter", "Time the consumer's CUDA stream spent on the batches' copies: "
              "waiting on a transfer thread's copy (h2d=fields), or running the copies next() issues on it "
              "(transfer_threads=0; estimated from the sampled copies). CUDA only."),
    MetricDef("trainer_cpu_seconds_total", "counter", "CPU time feedline's own threads spent inside the training "
              "process: the loop's thread inside next(), the dispatcher, transfer threads, the rest (what "
              "slows a launch-bound step though no batch is late).", "thread", THREAD_ROLES),
    MetricDef("trainer_cpu_per_batch_seconds", "gauge", "feedline's CPU in the training process per batch handed "
              "to the loop, over the loader's sliding window (the budget: 0.25 ms)."),
    MetricDef("sample_errors_total", "counter", "Samples skipped: corrupt, too large, missing field, ...",
              "reason", ERROR_REASONS),
    MetricDef("worker_restarts_total", "counter", "Worker processes replaced: crashed (died), stalled (no "
              "progress for worker_timeout) or memory (over worker_memory).", "reason", RESTART_REASONS),
    MetricDef("loader_epoch", "gauge", "The epoch the loader is in."),
    BUILD_INFO,
)

SAMPLER: tuple[MetricDef, ...] = (
    MetricDef("cache_bytes", "gauge", "Bytes of published shards in the cache."),
    MetricDef("cache_budget_bytes", "gauge", "The cache's byte budget."),
    MetricDef("cache_retained_bytes", "gauge", "Bytes of evicted shards kept on disk (beyond the budget) while the "
              "epoch of a reader, running or restarting, reads them."),
    MetricDef("cache_shards", "gauge", "Published shards in the cache."),
    MetricDef("cache_evictions_total", "counter", "Shards evicted from the cache."),
    MetricDef("fetch_bytes_total", "counter", "Bytes of shards fetched and published."),
    MetricDef("fetch_errors_total", "counter", "Failed shard fetch attempts, by reason.", "reason", FETCH_ERRORS),
    MetricDef("fetch_seconds", "histogram", "Time to fetch one shard, retries included.", buckets=FETCH_BUCKETS),
    MetricDef("fetch_retry_shards", "gauge", "Shards that failed and wait for their next try (never given up)."),
    MetricDef("fetch_breaker_open", "gauge", "1 while the store's circuit breaker is open: it failed several times "
              "in a row, and no fetch starts until its cool-down ends."),
    MetricDef("shm_bytes", "gauge", "Size and free bytes of the cache filesystem.", "kind", ("size", "free")),
    BUILD_INFO,
)
