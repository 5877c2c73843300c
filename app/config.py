"""The one configuration object: defaults, then ``FEEDLINE_*`` environment variables, then CLI flags.

Every setting names its environment variable and flag; every invalid value is
refused at start-up with a message that names the setting and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "FEEDLINE_"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


class ConfigError(ValueError):
    """A setting with a value that cannot work; the message says which and what would."""


def parse_size(text: str | int) -> int:
    """Bytes from ``1048576``, ``512MiB``, ``8GiB``, ``1.5GB``."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (use bytes or a unit: 512MiB, 8GiB, 1.5GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use true/false, 1/0, yes/no)")


def setting(default: Any, help: str, *, parse: Callable[[Any], Any] | None = None, minimum: float | None = None,
            maximum: float | None = None, choices: Sequence[str] | None = None, flag: bool = True) -> Any:
    return field(default=default, metadata={"help": help, "parse": parse, "min": minimum, "max": maximum,
                                            "choices": choices, "flag": flag})


@dataclass
class Config:
    # where the data is
    shards: str = setting("", "shard paths or globs, comma-separated (data/*.tar)")
    cache: str = setting("", "a cache directory with manifest.json, filled by `feedline sample`")
    # the staging loader
    batch_size: int = setting(64, "samples per batch", minimum=1)
    workers: int = setting(2, "decode worker processes", minimum=1, maximum=512)
    transfer_threads: int = setting(1, "transfer threads in the trainer process", minimum=1, maximum=64)
    ring_slots: int = setting(0, "batches in the shared-memory ring (0: 2*workers + transfer_threads + 2)",
                              minimum=0)
    shuffle_buffer: int = setting(1000, "samples in each worker's shuffle buffer (0: no sample shuffle)",
                                  minimum=0)
    seed: int = setting(0, "seed of the shard and sample order", minimum=0)
    drop_last: bool = setting(False, "drop each worker's last partial batch", parse=parse_bool)
    in_order: bool = setting(True, "deliver batches in a deterministic order", parse=parse_bool)
    zero_copy: bool = setting(False, "CPU: hand out ring views valid until the next batch", parse=parse_bool)
    device: str = setting("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    max_sample_errors: float = setting(0.05, "bad samples allowed per epoch: a count (>= 1) or a fraction (< 1)",
                                       minimum=0)
    min_shards: int = setting(1, "cache shards needed before training starts (the sampler's /readyz too)",
                              minimum=1)
    wait_timeout: float = setting(120.0, "seconds the trainer waits for min_shards in the cache", minimum=0)
    # the sampler sidecar
    source: str = setting("", "dataset: http(s):// URLs with {000..123} braces, an index file, or a path")
    budget: int = setting(1 << 30, "cache budget in bytes or with a unit (512MiB, 8GiB)", parse=parse_size,
                          minimum=1)
    policy: str = setting("grow", "cache policy: grow (epoch by epoch) or fill (to the budget, then refresh)",
                          choices=("grow", "fill"))
    initial_shards: int = setting(4, "grow: shards fetched before the first epoch", minimum=1)
    grow_shards: int = setting(4, "grow: shards added at each new loader epoch until the budget is full",
                               minimum=0)
    replace_fraction: float = setting(0.1, "grow: share of the oldest shards replaced per epoch once full",
                                      minimum=0, maximum=1)
    refresh_per_minute: float = setting(6.0, "fill: shards replaced per minute once full", minimum=0)
    fetch_threads: int = setting(4, "concurrent shard downloads", minimum=1, maximum=64)
    max_mbps: float = setting(0.0, "bandwidth cap of the downloads in MB/s (0: none)", minimum=0)
    fetch_timeout: float = setting(30.0, "seconds without data before a download is retried", minimum=0.1)
    retries: int = setting(3, "retries of a failed download (with exponential backoff and jitter)", minimum=0)
    partition_index: int = setting(0, "sampler: which part of the source this node samples (multi-node)",
                                   minimum=0)
    partition_count: int = setting(1, "sampler: how many parts the source is split into (one per node)",
                                   minimum=1)
    rank_scope: str = setting("global", "loader: split shards by the global RANK, or by LOCAL_RANK when each "
                              "node's cache holds its own partition", choices=("global", "local"))
    metrics_port: int = setting(-1, "metrics/health port (-1: 9101 for sample, 9102 for train; 0: any free)",
                                minimum=-1, maximum=65535)
    metrics_addr: str = setting("127.0.0.1", "address the metrics endpoint binds (0.0.0.0 in containers)")
    # the demo training job
    epochs: int = setting(3, "epochs to train", minimum=1)
    step_ms: float = setting(0.0, "minimum time of one training step in ms (0: as fast as the model runs)",
                             minimum=0)
    image_size: int = setting(64, "side of the random-resized crop fed to the model", minimum=8, maximum=1024)
    classes: int = setting(10, "output classes of the demo model", minimum=2)
    max_steps: int = setting(0, "stop each epoch after this many steps (0: whole epoch)", minimum=0)
    # process
    log_level: str = setting("INFO", "logging level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    progress: bool = setting(True, "show progress bars", parse=parse_bool)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @staticmethod
    def env_name(name: str) -> str:
        return ENV_PREFIX + name.upper()

    @staticmethod
    def flag_name(name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
        """One flag per setting; the default is None so a flag only overrides what was given."""
        for f in dataclasses.fields(cls):
            if only is not None and f.name not in only:
                continue
            meta = f.metadata
            parser.add_argument(cls.flag_name(f.name), dest=f.name, default=None, metavar=f.name.upper(),
                                help=f"{meta['help']} (env {cls.env_name(f.name)}, default {f.default!r})")

    @classmethod
    def load(cls, args: argparse.Namespace | Mapping[str, Any] | None = None,
             env: Mapping[str, str] | None = None) -> "Config":
        """Defaults, then the environment, then flags; every value checked."""
        env = os.environ if env is None else env
        given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw, origin = f.default, "default"
            if cls.env_name(f.name) in env:
                raw, origin = env[cls.env_name(f.name)], f"environment variable {cls.env_name(f.name)}"
            if given.get(f.name) is not None:
                raw, origin = given[f.name], f"flag {cls.flag_name(f.name)}"
            values[f.name] = cls._check(f, raw, origin)
        unknown = sorted(k for k in env if k.startswith(ENV_PREFIX)
                         and k[len(ENV_PREFIX):].lower() not in values and k not in KNOWN_OTHER_ENV)
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: "
                              f"{', '.join(cls.env_name(n) for n in cls.names())}")
        cfg = cls(**values)
        cfg.validate()
        return cfg

    @classmethod
    def _check(cls, f: dataclasses.Field, raw: Any, origin: str) -> Any:
        meta = f.metadata
        where = f"{f.name} (from {origin})"
        try:
            if meta["parse"] is not None:
                value = meta["parse"](raw)
            elif isinstance(f.default, bool):
                value = parse_bool(raw)
            elif isinstance(f.default, int):
                value = int(raw)
            elif isinstance(f.default, float):
                value = float(raw)
            else:
                value = str(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {raw!r} is not valid: {exc}") from None
        if meta["min"] is not None and value < meta["min"]:
            raise ConfigError(f"{where}: {value!r} is below the minimum {meta['min']}")
        if meta["max"] is not None and value > meta["max"]:
            raise ConfigError(f"{where}: {value!r} is above the maximum {meta['max']}")
        if meta["choices"] is not None:
            value = str(value).upper() if f.name == "log_level" else value
            if value not in meta["choices"]:
                raise ConfigError(f"{where}: {value!r} is not one of {', '.join(meta['choices'])}")
        return value

    def validate(self) -> None:
        if self.shards and self.cache:
            raise ConfigError("shards and cache are both set: give one (FEEDLINE_SHARDS / --shards, "
                              "or FEEDLINE_CACHE / --cache)")
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ConfigError(f"device: {self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if self.partition_index >= self.partition_count:
            raise ConfigError(f"partition_index: {self.partition_index} is not below partition_count="
                              f"{self.partition_count} (FEEDLINE_PARTITION_INDEX / FEEDLINE_PARTITION_COUNT)")
        if self.ring_slots and self.ring_slots < self.workers:
            raise ConfigError(f"ring_slots: {self.ring_slots} is fewer than workers={self.workers}; "
                              f"use 0 (automatic) or at least {2 * self.workers}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def shard_list(self) -> list[str]:
        return [s.strip() for s in self.shards.split(",") if s.strip()]

    def loader_kwargs(self, serve_metrics: bool = False) -> dict[str, Any]:
        """The StagingLoader arguments this configuration sets; the trainer serves metrics (9102)."""
        kw: dict[str, Any] = dict(min_shards=self.min_shards, wait_timeout=self.wait_timeout,
            batch_size=self.batch_size, workers=self.workers, transfer_threads=self.transfer_threads,
            shuffle_buffer=self.shuffle_buffer, seed=self.seed, drop_last=self.drop_last, in_order=self.in_order,
            zero_copy=self.zero_copy, device=self.resolved_device(), max_sample_errors=self.max_sample_errors,
        )
        if self.ring_slots:
            kw["ring_slots"] = self.ring_slots
        kw["metrics_port"] = None if self.metrics_port == -1 and not serve_metrics else \
            (9102 if self.metrics_port == -1 else self.metrics_port)
        kw["metrics_addr"] = self.metrics_addr
        if self.rank_scope == "local":
            from .loader.plan import Rank

            kw["rank"] = Rank.detect(local=True)
        if self.cache:
            kw["cache"] = self.cache
        else:
            kw["shards"] = self.shard_list()
        return kw


# Variables with the prefix that are not settings of this object (read elsewhere).
KNOWN_OTHER_ENV = frozenset({"FEEDLINE_DATA", "FEEDLINE_DEMO_SAMPLES"})
