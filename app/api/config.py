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

from ..loader.cpus.placement import parse_setting
from ..loader.remote.settings import RemoteDecode
from ..loader.plan.rank import Rank
from ..loader.settings import MIN_WORKER_MEMORY, SHUFFLES, LoaderSettings
from ..cache.mix import wait_for_layout
from .mixing import MixError, check_parts, parse_mix
from ..sampler.http import MAX_INDEX_BYTES
from .owned_sidecar import remote_source
from ..sampler.settings import DEFAULT_CACHE, SidecarSettings
from .values import parse_auto_int, parse_bool, parse_size

__all__ = ["Config", "ConfigError", "parse_auto_int", "parse_bool", "parse_size"]

ENV_PREFIX = "FEEDLINE_"

class ConfigError(ValueError):
    """A flag or variable with a value that cannot work; the message says which, from where, and what would."""


# Which subcommands show a setting: each setting belongs to one or more groups (see COMMANDS).
GROUPS = ("data", "loader", "sampler", "job", "serve", "run", "process")


def parse_remote(value: Any) -> str:
    """The remote setting checked at start-up (the loader parses it again from the same string)."""
    text = str(value).strip()
    RemoteDecode.parse(text)
    return "" if text.lower() in ("off", "none") else text


def setting(default: Any, help: str, groups: str, *, parse: Callable[[Any], Any] | None = None,
            minimum: float | None = None, maximum: float | None = None,
            choices: Sequence[str] | None = None, secret: bool = False) -> Any:
    """A field of ``Config``; a ``secret`` one (a credential) is left out of its repr."""
    return field(default=default, repr=not secret,
                 metadata={"help": help, "parse": parse, "min": minimum, "max": maximum, "choices": choices,
                           "groups": tuple(groups.split())})


@dataclass
class Config:
    """Every setting of every ``feedline`` command; builds the library parts' own settings."""

    # where the data is
    shards: str = setting("", "shard paths or globs, comma-separated (data/*.tar)", "data")
    cache: str = setting("", "a cache directory with manifest.json, filled by `feedline sample`", "data sampler")
    mix: str = setting("", "datasets mixed by weight: NAME=[cache:]WHERE[@WEIGHT|#SAMPLES] items separated by "
                           "spaces or ';' (web=cache:/dev/shm/web@0.7 cur=data/c/*.tar@0.3); with cache set to a "
                           "mixing sidecar's cache, its parts weighed anew (web@0.5 cur@0.5)", "data")
    # the staging loader
    batch_size: int = setting(64, "samples per batch", "loader", minimum=1)
    workers: int | str = setting("auto", "decode worker processes, or auto: starts with half of this rank's CPUs "
                                         "less one and grows in the first epoch while the loop waits and CPUs are "
                                         "idle", "loader", parse=lambda v: parse_auto_int(v, 1, 512))
    max_workers: int = setting(0, "with workers=auto, the most it grows to (0: this rank's CPUs less one)",
                               "loader", minimum=0, maximum=512)
    transfer_threads: int | str = setting("auto", "transfer threads in the trainer process (0: next() issues "
                                                  "each batch's copy itself), or auto: 0, or 1 with device_decode "
                                                  "on CUDA", "loader", parse=lambda v: parse_auto_int(v, 0, 64))
    h2d: str = setting("slot", "how a batch goes to the GPU: slot (one copy a batch into a device buffer made "
                               "for its ring slot) or fields (a copy a field into new allocations, the path before "
                               "it: needs transfer_threads >= 1)", "loader", choices=("slot", "fields"))
    ring_slots: int = setting(0, "batches in the shared-memory ring (0: 2*workers + max(1, transfer_threads) + 2)",
                              "loader", minimum=0)
    shuffle: str = setting("epoch", "epoch: the whole epoch mixed, by blocks of shuffle_block shards; stream: "
                                    "shards in order through shuffle_buffer (webdataset's scheme); none",
                           "loader", choices=("epoch", "stream", "none"))
    shuffle_block: int = setting(256, "shards a worker mixes at once with shuffle=epoch (each mapped meanwhile; "
                                      "fewer keep reads from a slow disk more sequential)", "loader", minimum=1)
    shuffle_buffer: int = setting(1000, "samples in each worker's shuffle buffer with shuffle=stream (0: none)",
                                  "loader", minimum=0)
    seed: int = setting(0, "seed of the shard and sample order (and the sampler's plan)", "loader sampler",
                        minimum=0)
    drop_last: bool = setting(False, "drop each worker's last partial batch", "loader", parse=parse_bool)
    in_order: bool = setting(True, "deliver batches in a deterministic order", "loader", parse=parse_bool)
    zero_copy: bool = setting(False, "CPU: hand out ring views valid until the next batch", "loader",
                              parse=parse_bool)
    device: str = setting("auto", "cpu, cuda, cuda:N, or auto (cuda when available)", "loader")
    max_sample_errors: float = setting(0.05, "bad samples allowed per epoch: a count (>= 1) or a fraction (< 1)",
                                       "loader", minimum=0)
    worker_timeout: float = setting(60.0, "seconds a worker may hold a batch without decoding a sample before it "
                                          "is replaced (0: never)", "loader", minimum=0)
    max_member_bytes: int = setting(256 << 20, "the most one shard member may take, as stored or once decoded "
                                               "(decompressed .gz/.bz2/.xz/.zst, image pixels at 4 bytes each, "
                                               "msgpack/CBOR/JSON values): a sample with a larger member is skipped "
                                               "and counted (member_too_large)", "loader", parse=parse_size,
                                    minimum=1024)
    worker_memory: int = setting(0, "private resident memory a decode worker may hold (e.g. 2GiB); above it the "
                                    "worker is replaced and the sample it was decoding handled as a crash's "
                                    "(0: no ceiling)", "loader", parse=parse_size, minimum=0)
    cpu_placement: str = setting("auto", "where the training process and its workers run: auto (cores of its own "
                                         "for the training process, the rest for the workers, one a core), off, or "
                                         "CPU lists as trainer=0-1;workers=2-15", "loader", parse=parse_setting)
    trainer_cores: int = setting(0, "with cpu_placement=auto, the cores the training process keeps (0: 2 where "
                                    "a rank has 8 cores or more, else 1)", "loader", minimum=0)
    remote: str = setting("", "worker places decoded on a Ray cluster: ADDRESS[,places=N][,cpus=C][,inflight=N]"
                              "[,fallback=local][,connect_timeout=S][,stream=off] "
                              "(ADDRESS: auto or the head's host:6379; empty: all decoding here; needs "
                              "feedline[ray])", "loader", parse=parse_remote)
    stall_timeout: float = setting(120.0, "seconds any stage of the loader's hand-off (the dispatcher thread, a "
                                          "worker's start, a transfer thread, the workers while the loop waits) "
                                          "may go without answering before the run stops with an error naming it",
                                   "loader", minimum=0.1)
    side_bytes: int = setting(0, "per-sample bytes for the key, text, JSON and bytes fields (0: 1 KiB with keys "
                                 "only, else 16 KiB)", "loader", parse=parse_size, minimum=0)
    decompress_dir: str = setting("", "where plain copies of .tar.gz/.tar.zst shards= go (default "
                                      "~/.cache/feedline/decompressed)", "loader")
    min_shards: int = setting(1, "cache shards needed before training starts (the sampler's /readyz too)",
                              "loader sampler", minimum=1)
    wait_timeout: float = setting(120.0, "seconds the trainer waits for min_shards in the cache", "loader",
                                  minimum=0)
    rank_scope: str = setting("global", "split shards by the global RANK, or by LOCAL_RANK when each node's "
                                        "cache holds its own partition", "loader", choices=("global", "local"))
    # the sampler sidecar
    source: str = setting("", "dataset: http(s):// URLs with {000..123} braces, an index file, or a path",
                          "sampler")
    budget: int = setting(1 << 30, "cache budget in bytes or with a unit (512MiB, 8GiB)", "sampler",
                          parse=parse_size, minimum=1)
    policy: str = setting("grow", "cache policy: grow (epoch by epoch) or fill (to the budget, then refresh)",
                          "sampler", choices=("grow", "fill"))
    initial_shards: int = setting(4, "grow: shards fetched before the first epoch", "sampler", minimum=1)
    grow_shards: int = setting(4, "grow: shards added at each new loader epoch until the budget is full",
                               "sampler", minimum=0)
    replace_fraction: float = setting(0.1, "grow: share of the oldest shards replaced per epoch once full",
                                      "sampler", minimum=0, maximum=1)
    refresh_per_minute: float = setting(6.0, "fill: shards replaced per minute once full", "sampler", minimum=0)
    reader_lease: float = setting(600.0, "seconds an evicted shard stays on disk for a reader whose epoch reads it "
                                         "after that reader's last sign of life (a trainer restarting from its "
                                         "checkpoint finds its epoch whole); 0: removed at once", "sampler",
                                  minimum=0)
    remove_cache_on_exit: bool = setting(False, "remove the cache when the sampler exits, however it is stopped "
                                                "(the loader's own sidecar: its trainer may die without a word)",
                                         "sampler", parse=parse_bool)
    fetch_threads: int = setting(4, "concurrent shard downloads", "sampler", minimum=1, maximum=64)
    max_mbps: float = setting(0.0, "bandwidth cap of the downloads in MB/s (0: none)", "sampler", minimum=0)
    fetch_timeout: float = setting(30.0, "seconds without data before a download is retried", "sampler",
                                   minimum=0.1)
    retries: int = setting(3, "quick retries of a failed download (exponential backoff and jitter, or what the "
                              "store's Retry-After asks); then the shard waits for a later try", "sampler", minimum=0)
    retry_max_seconds: float = setting(300.0, "longest wait before a failed shard, or a failing store, is tried "
                                              "again (the wait doubles up to it; nothing is given up)", "sampler",
                                       minimum=1)
    fetch_min_mbps: float = setting(0.01, "a download slower than this (MB/s) over fetch_timeout seconds is "
                                          "abandoned and retried (0: no floor)", "sampler", minimum=0)
    auth_header: str = setting("", "a header for private stores, 'Name: value' (or a bare token, sent as a bearer "
                                   "token)", "sampler", secret=True)
    auth_header_file: str = setting("", "a file holding that header or token, read at each request (a mounted "
                                        "Secret)", "sampler")
    auth_extra_hosts: str = setting("", "origins besides the source's own that the auth header may go to, "
                                        "comma-separated (https://cdn.example.com, http://host:8080; a bare host "
                                        "means https)", "sampler")
    max_index_bytes: int = setting(MAX_INDEX_BYTES, "the largest remote index file the sampler reads (an index "
                                                    "of a million shards with sha256 and size is ~150 MB)",
                                   "sampler", parse=parse_size, minimum=1)
    partition_index: int = setting(0, "which part of the source this node samples (multi-node)", "sampler",
                                   minimum=0)
    partition_count: int = setting(1, "how many parts the source is split into (one per node)", "sampler",
                                   minimum=1)
    # the metrics endpoint
    metrics_port: int = setting(-1, "metrics/health port (-1: 9101 for sample, 9102 for train; 0: any free)",
                                "serve", minimum=-1, maximum=65535)
    metrics_addr: str = setting("127.0.0.1", "address the metrics endpoint binds (0.0.0.0 in containers)",
                                "serve")
    # the demo training job
    epochs: int = setting(3, "epochs to train", "job", minimum=1)
    step_ms: float = setting(0.0, "minimum time of one training step in ms (0: as fast as the model runs)",
                             "job", minimum=0)
    image_size: int = setting(64, "side of the random-resized crop fed to the model", "job", minimum=8,
                              maximum=1024)
    device_decode: bool = setting(False, "demo job: the workers copy the JPEGs compressed; they are decoded, "
                                         "cropped and resized where the batch lands (nvJPEG on CUDA)", "job",
                                  parse=parse_bool)
    classes: int = setting(10, "output classes of the demo model", "job", minimum=2)
    max_steps: int = setting(0, "stop each epoch after this many steps (0: whole epoch)", "job", minimum=0)
    checkpoint: str = setting("", "a directory for checkpoints (model, optimizer, loader state); saved every "
                                  "checkpoint_every steps, on SIGTERM and at the end", "job")
    checkpoint_every: int = setting(0, "steps between checkpoints (0: only on SIGTERM and at the end)", "job",
                                    minimum=0)
    dist_timeout: float = setting(300.0, "seconds a collective of a torchrun job waits for the other ranks "
                                         "before the job fails (a rank that died)", "job", minimum=1)
    equal_batches: str = setting("drop", "under torchrun every rank yields the same number of batches: the "
                                         "smallest rank's (drop), the largest's (pad), or off", "loader",
                                 choices=("drop", "pad", "off"))
    resume: bool = setting(False, "start from the newest complete checkpoint in the checkpoint directory", "job",
                           parse=parse_bool)
    # bring your own training (`feedline run`)
    train_cmd: str = setting("", "the training command `feedline run` starts once the cache is ready, as shell "
                                 "words (python /workspace/train.py); the words after `feedline run --` win",
                             "run")
    # process
    log_level: str = setting("INFO", "logging level", "process", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    progress: bool = setting(True, "show progress bars", "process", parse=parse_bool)

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
    def describe(cls, name: str) -> str:
        """``name (--flag / FEEDLINE_NAME)``: how a message names a setting to a person."""
        return f"{name} ({cls.flag_name(name)} / {cls.env_name(name)})" if name in cls.names() else name

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, groups: Sequence[str] = GROUPS,
                      extra: Sequence[str] = ()) -> None:
        """One flag per setting of ``groups`` (and the ``extra`` names); a flag only overrides what was given."""
        for f in dataclasses.fields(cls):
            if f.name not in extra and not set(f.metadata["groups"]) & set(groups):
                continue
            boolean = isinstance(f.default, bool)  # `--resume` alone means true; `--resume false` works too
            parser.add_argument(cls.flag_name(f.name), dest=f.name, default=None, metavar=f.name.upper(),
                                nargs="?" if boolean else None, const="true" if boolean else None,
                                help=f"{f.metadata['help']} (env {cls.env_name(f.name)}, default {f.default!r})")

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
        """What only this object can check; each library part checks its own settings when they are built."""
        if self.resume and not self.checkpoint:
            raise ConfigError("resume is set but checkpoint is not: give the checkpoint directory to resume from "
                              "(--checkpoint / FEEDLINE_CHECKPOINT)")
        if self.shards and self.cache:
            raise ConfigError("shards and cache are both set: give one (FEEDLINE_SHARDS / --shards, "
                              "or FEEDLINE_CACHE / --cache)")
        if self.mix:
            if self.shards:
                raise ConfigError("mix is set with shards: a mixture names its sources' shards itself; give mix "
                                  "alone (FEEDLINE_MIX / --mix), or with cache to weigh a mixing sidecar's parts")
            try:
                parse_mix(self.mix, self.cache)
            except MixError as exc:
                raise ConfigError(f"mix (FEEDLINE_MIX / --mix): {exc}") from None
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ConfigError(f"device: {self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if 0 < self.worker_memory < MIN_WORKER_MEMORY:  # feedline run checks it too, before the user's loader
            raise ConfigError(f"worker_memory (FEEDLINE_WORKER_MEMORY / --worker-memory): {self.worker_memory} bytes "
                              f"is below what a worker needs to start; set at least {MIN_WORKER_MEMORY >> 20}MiB, "
                              f"or 0 for no ceiling")

    def resolved_device(self) -> str:
        """``auto`` made ``cuda`` or ``cpu``; under torchrun ``cuda`` is this process's GPU, ``cuda:LOCAL_RANK``."""
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and "LOCAL_RANK" in os.environ:
            device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        return device

    def shard_list(self) -> list[str]:
        return [s.strip() for s in self.shards.split(",") if s.strip()]

    def loader_source(self) -> dict[str, Any]:
        """``sources=``, ``cache=`` or ``shards=``, as the loader takes them."""
        if self.mix:
            sources = parse_mix(self.mix, self.cache)
            if self.cache:  # its parts, weighed anew: they must be there (the sidecar may still be starting)
                parts = wait_for_layout(self.cache, self.wait_timeout)  # mix.json, read once
                try:
                    check_parts(sources, self.cache, parts)
                except MixError as exc:
                    raise ConfigError(f"mix (FEEDLINE_MIX / --mix): {exc}") from None
            return {"sources": sources}
        if self.cache:
            return {"cache": self.cache}
        shards = self.shard_list()
        # remote shards: the loader's own sidecar fetches them, into at most the sampler's budget
        return {"shards": shards, **({"cache_budget": self.budget} if remote_source(shards) else {})}

    def loader_settings(self) -> LoaderSettings:
        return LoaderSettings(
            batch_size=self.batch_size, workers=self.workers, max_workers=self.max_workers or None,
            transfer_threads=self.transfer_threads, h2d=self.h2d, ring_slots=self.ring_slots or None,
            shuffle_buffer=self.shuffle_buffer, seed=self.seed,
            shuffle=SHUFFLES[self.shuffle], shuffle_block=self.shuffle_block,
            drop_last=self.drop_last, in_order=self.in_order, zero_copy=self.zero_copy,
            device=self.resolved_device(), max_sample_errors=self.max_sample_errors,
            worker_timeout=self.worker_timeout, stall_timeout=self.stall_timeout, side_bytes=self.side_bytes or None,
            decompress_dir=self.decompress_dir or None, equal_batches=self.equal_batches,
            min_shards=self.min_shards, wait_timeout=self.wait_timeout, max_member_bytes=self.max_member_bytes,
            worker_memory=self.worker_memory, rank=Rank.detect(local=True) if self.rank_scope == "local" else None,
            cpu_placement=self.cpu_placement, trainer_cores=self.trainer_cores or None, remote=self.remote or None)

    def sidecar_settings(self) -> SidecarSettings:
        return SidecarSettings(
            source=self.source, cache=self.cache or DEFAULT_CACHE, budget=self.budget, policy=self.policy,
            initial_shards=self.initial_shards, grow_shards=self.grow_shards, replace_fraction=self.replace_fraction,
            refresh_per_minute=self.refresh_per_minute, fetch_threads=self.fetch_threads, max_mbps=self.max_mbps,
            fetch_timeout=self.fetch_timeout, fetch_min_mbps=self.fetch_min_mbps, retries=self.retries,
            retry_max_seconds=self.retry_max_seconds, auth_header=self.auth_header,
            auth_header_file=self.auth_header_file, auth_extra_hosts=self.auth_extra_hosts,
            max_index_bytes=self.max_index_bytes, partition_index=self.partition_index,
            partition_count=self.partition_count, seed=self.seed, min_shards=self.min_shards,
            reader_lease=self.reader_lease)

    def port(self, default: int) -> int:
        """The metrics port: the setting, or the command's default where it is -1."""
        return default if self.metrics_port == -1 else self.metrics_port

    def trainer_port(self, local_rank: int) -> int:
        """A training process's metrics port: 9102 (or the setting) + its LOCAL_RANK; 0 stays 'any free'."""
        port = self.port(9102)
        return port + local_rank if port else port


COMPOSE_ENV = frozenset({
    "FEEDLINE_BASE_IMAGE", "FEEDLINE_BIND", "FEEDLINE_GPUS", "FEEDLINE_GRAFANA_PASSWORD", "FEEDLINE_GRAFANA_PORT",
    "FEEDLINE_IMAGE", "FEEDLINE_PROMETHEUS_IMAGE", "FEEDLINE_PROMETHEUS_PORT", "FEEDLINE_SAMPLER_MEMORY",
    "FEEDLINE_SAMPLER_PORT", "FEEDLINE_SHM_SIZE", "FEEDLINE_TRAINER_PORT", "FEEDLINE_WORKSPACE",
    "FEEDLINE_RAY_TOKEN", "FEEDLINE_RAY_DECODE_CPUS"})
# Variables with the prefix that are not settings of this object (read elsewhere): the demo's, and compose's own
# (.env.example), which a shell that ran `docker compose` may still export when it runs `feedline`.
KNOWN_OTHER_ENV = frozenset({"FEEDLINE_DATA", "FEEDLINE_DEMO_SAMPLES"}) | COMPOSE_ENV

