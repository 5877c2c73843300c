"""The Grafana dashboard, generated from code so it stays true to the exported metrics.

``feedline dashboard`` writes ``grafana/dashboards/feedline.json``, the file Grafana
loads; a test checks the committed file is exactly what this code produces, that
every expression names only exported metrics, and that every exported metric is
shown somewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

UID = "feedline"
DATASOURCE_UID = "feedline-prometheus"
SEL = '{job=~"$job", instance=~"$instance"}'
RI = "$__rate_interval"


@dataclass
class Query:
    """One PromQL expression on a panel, with its legend."""

    expr: str
    legend: str
    optional: bool = False  # only present where an extra exporter runs (DCGM)


@dataclass
class Panel:
    """One dashboard panel: what it answers (description), its unit and queries."""

    title: str
    description: str
    unit: str
    queries: list[Query]
    kind: str = "timeseries"
    width: int = 8
    max: float | None = None
    right_axis: list[str] = field(default_factory=list)  # legends drawn on a right axis


def _rate(metric: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{SEL}[{RI}]))"


def _quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{SEL}[{RI}])))"


STARVATION = (f"{_rate('feedline_data_wait_seconds_total')} / ({_rate('feedline_data_wait_seconds_total')} + "
              f"{_rate('feedline_step_seconds_total')})")

ROWS: list[tuple[str, list[Panel]]] = [
    ("Starvation: is the training loop waiting for data?", [
        Panel("GPU starvation ratio",
              "Share of wall time the training loop spent blocked in next(loader): data wait / (data wait + step). "
              "Near 0: the pipeline keeps up. Above 0.2 for 10 minutes fires FeedlineInputStarved.",
              "percentunit", [Query(STARVATION, "from rates"),
                              Query(f"avg(feedline_gpu_starvation_ratio{SEL})", "loader's own (30 s window)")],
              max=1, width=6),
        Panel("feedline's CPU in the training process",
              "What starvation cannot show: the CPU feedline's own threads take inside the training process (the "
              "loop's thread inside next(), the dispatcher, transfer threads), in cores, and per batch (right axis). "
              "A launch-bound step slows by about this much though no batch is late; the budget is 0.25 ms a batch.",
              "short", [Query(_rate("feedline_trainer_cpu_seconds_total", "thread"), "{{thread}} (cores)"),
                        Query(f"max(feedline_trainer_cpu_per_batch_seconds{SEL}) * 1000", "ms a batch")],
              right_axis=["ms a batch"], width=6),
        Panel("Data wait per step",
              "Quantiles of the time one next(loader) call blocked. The step's compute is not in it.",
              "s", [Query(_quantile(q, "feedline_data_wait_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)],
              width=6),
        Panel("GPU utilisation (DCGM)",
              "The GPU's own view, from dcgm-exporter when its compose profile runs: graphics engine active and "
              "GPU utilisation. Low utilisation with high starvation means the input pipeline is the bottleneck.",
              "percentunit", [Query("avg(DCGM_FI_PROF_GR_ENGINE_ACTIVE)", "engine active", optional=True),
                              Query("avg(DCGM_FI_DEV_GPU_UTIL) / 100", "GPU util", optional=True)], max=1,
              width=6),
    ]),
    ("Throughput", [
        Panel("Samples per second", "Samples decoded into the batch ring, per second.", "short",
              [Query(_rate("feedline_samples_total"), "samples/s")]),
        Panel("Bytes per second by stage",
              "read: shard bytes the workers read; decoded: bytes written into the ring; transferred: bytes handed "
              "to the training loop (to the GPU with CUDA).", "Bps",
              [Query(_rate("feedline_bytes_total", "stage"), "{{stage}}")]),
        Panel("Host-to-device copy",
              "Copy time per batch (p90), and the time the consumer's CUDA stream waited on the copy event per "
              "second (CUDA only; 0 on CPU hosts).", "s",
              [Query(_quantile(0.9, "feedline_h2d_seconds"), "copy p90"),
               Query(_rate("feedline_h2d_wait_seconds_total"), "stream wait per second")]),
    ]),
    ("Queues", [
        Panel("Queue depth vs capacity",
              "Slots of the shared-memory ring: free (waiting for a worker), decoded (filled, waiting for a transfer "
              "thread), device (ready for the loop). An empty decoded queue with starvation: workers are too slow.",
              "short", [Query(f"sum by (queue) (feedline_queue_depth{SEL})", "{{queue}} depth"),
                        Query(f"sum by (queue) (feedline_queue_capacity{SEL})", "{{queue}} capacity")], width=12),
        Panel("Loader epoch", "The epoch the training loop is in; the cache grows at each new one.", "short",
              [Query(f"max(feedline_loader_epoch{SEL})", "epoch")], width=6),
        Panel("Kept batches copied", "Batches per second copied out of the ring because the training loop still "
              "held them at a next() (copy mode on a CPU host): 0 unless the loop keeps batches.", "short",
              [Query(_rate("feedline_kept_batches_copied_total"), "copied/s")], width=6),
    ]),
    ("Workers", [
        Panel("Workers busy / idle", "Decode worker processes holding a slot to fill, or waiting (their sum: the "
              "workers set, or what workers=auto chose), and the trainer's transfer threads.", "short",
              [Query(f"sum by (state) (feedline_workers{SEL})", "{{state}}"),
               Query(f"sum(feedline_transfer_threads{SEL})", "transfer threads")]),
        Panel("CPUs placed", "The CPUs CPU placement gave the training processes (their launching threads, on "
              "cores of their own) and their decode workers; 0 where nothing is pinned.", "short",
              [Query(f"sum by (side) (feedline_placed_cpus{SEL})", "{{side}}")]),
        Panel("Worker restarts", "Worker processes replaced per second: crashed (the process died), stalled "
              "(no sample decoded for worker_timeout; its stack is in the trainer log) or memory (private "
              "resident memory over worker_memory).", "short",
              [Query(_rate("feedline_worker_restarts_total", "reason"), "{{reason}}")]),
        Panel("Sample errors by reason", "Samples skipped (and counted) per second, by reason; the trainer logs "
              "each shard and key.", "short", [Query(_rate("feedline_sample_errors_total", "reason"), "{{reason}}")]),
        Panel("Batches by place", "Batches decoded per second by local worker processes and by the Ray actors "
              "of remote decoding (remote=), and remote batches sent again to a new actor after theirs was lost "
              "(each still delivered once). Remote falling to 0 mid-run: the cluster is gone, local carries on.",
              "short", [Query(_rate("feedline_batches_decoded_total", "place"), "{{place}}"),
                        Query(_rate("feedline_remote_redone_batches_total"), "redone")]),
        Panel("Remote decode traffic", "Bytes per second to the decode actors (encoded samples) and back (batch "
              "slots).", "Bps", [Query(_rate("feedline_remote_bytes_total", "direction"), "{{direction}}")]),
        Panel("Decode time by place", "Seconds of decoding per second, by local worker processes and by the Ray "
              "actors, and the worker places each has now (actors alive).", "short",
              [Query(_rate("feedline_decode_seconds_total", "place"), "{{place}} decode s/s"),
               Query(f"sum by (place) (feedline_worker_places{SEL})", "{{place}} places")]),
    ]),
    ("Cache (sampler sidecar)", [
        Panel("Cache bytes vs budget", "Published shard bytes in the cache, the budget they never exceed, and "
              "evicted shards kept on disk while a reader's epoch (a trainer restarting included) reads them.",
              "bytes", [Query(f"sum(feedline_cache_bytes{SEL})", "cached"),
                        Query(f"sum(feedline_cache_budget_bytes{SEL})", "budget"),
                        Query(f"sum(feedline_cache_retained_bytes{SEL})", "kept for readers")]),
        Panel("Cache shards and growth per epoch",
              "Shards in the cache next to the loader's epoch: with the grow policy the cache steps up at each "
              "new epoch until the budget is full, then turns over.", "short",
              [Query(f"sum(feedline_cache_shards{SEL})", "shards"),
               Query(f"max(feedline_loader_epoch{SEL})", "epoch")], right_axis=["epoch"]),
        Panel("Evictions", "Shards evicted (oldest first) per second.", "short",
              [Query(_rate("feedline_cache_evictions_total"), "evictions/s")]),
        Panel("Fetch rate", "Bytes fetched and published per second, and the p90 time to fetch one shard.",
              "Bps", [Query(_rate("feedline_fetch_bytes_total"), "fetched"),
                      Query(_quantile(0.9, "feedline_fetch_seconds"), "fetch p90 (s)")],
              right_axis=["fetch p90 (s)"]),
        Panel("Fetch errors by reason", "Failed download attempts per second, retried ones included.", "short",
              [Query(_rate("feedline_fetch_errors_total", "reason"), "{{reason}}")]),
        Panel("Store health", "Shards waiting for their next try after a failure (none is given up), and 1 while "
              "the store's circuit breaker is open (several failures of the store in a row: no fetch until its "
              "cool-down ends).", "short",
              [Query(f"sum(feedline_fetch_retry_shards{SEL})", "shards waiting"),
               Query(f"max(feedline_fetch_breaker_open{SEL})", "breaker open")], right_axis=["breaker open"]),
        Panel("Build", "feedline version of each process.", "short",
              [Query(f"sum by (instance, version) (feedline_build_info{SEL})", "{{instance}} {{version}}")],
              kind="table"),
    ]),
    ("Shared memory", [
        Panel("/dev/shm size and free", "The cache filesystem's size and free bytes; under 10 % free for 5 minutes "
              "fires FeedlineShmAlmostFull.", "bytes",
              [Query(f"min by (kind) (feedline_shm_bytes{SEL})", "{{kind}}")], width=24),
    ]),
]


def _target(q: Query, ref: str) -> dict[str, Any]:
    return {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": q.expr,
            "legendFormat": q.legend, "refId": ref, "range": True}


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": p.unit}
    if p.max is not None:
        defaults.update(min=0, max=p.max)
    overrides = [{"matcher": {"id": "byName", "options": name},
                  "properties": [{"id": "custom.axisPlacement", "value": "right"}, {"id": "unit", "value": "short"}]}
                 for name in p.right_axis]
    panel: dict[str, Any] = {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": overrides},
        "targets": [_target(q, chr(ord("A") + i)) for i, q in enumerate(p.queries)],
    }
    if p.kind == "table":
        panel["targets"][0]["format"] = "table"
        panel["targets"][0]["instant"] = True
        panel["targets"][0]["range"] = False
    else:
        panel["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
    return panel


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "includeAll": True,
            "multi": True, "allValue": ".*", "current": {"selected": True, "text": "All", "value": "$__all"},
            "sort": 1}


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x = pid + 1, y + 1, 0
        for p in row:
            if x + p.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(p, pid, x, y))
            pid, x = pid + 1, x + p.width
        y += 8
    return {
        "uid": UID, "title": "feedline: is the GPU fed?", "tags": ["feedline", "training", "data-loading"],
        "description": "Starvation, throughput, queues, workers, cache and /dev/shm of the feedline appliance.",
        "editable": True, "graphTooltip": 1, "refresh": "10s", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-30m", "to": "now"}, "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {"selected": True, "text": "Prometheus", "value": DATASOURCE_UID}, "refresh": 1},
            _variable("job", "Job", "label_values(feedline_build_info, job)"),
            _variable("instance", "Instance", 'label_values(feedline_build_info{job=~"$job"}, instance)'),
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def expressions(include_optional: bool = True) -> list[str]:
    """Every PromQL expression on the dashboard (template variables not substituted)."""
    return [q.expr for _, row in ROWS for p in row for q in p.queries if include_optional or not q.optional]


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"
