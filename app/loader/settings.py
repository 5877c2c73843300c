"""``LoaderSettings``: how a ``StagingLoader`` runs, as plain values checked in one place.

Every refusal is a ``SettingError`` naming the setting and what would work.
The face's ``Config`` builds one from flags and ``FEEDLINE_*`` variables;
``StagingLoader(...)``'s keyword arguments build one too.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from ..errors import SettingError
from ..formats.bounds import DEFAULT_MAX_MEMBER_BYTES  # one member, stored or decoded (formats/bounds.py)
from .cpus.placement import check_setting
from .device.decode_settings import DeviceDecode
from .plan.rank import Rank
from .remote.cluster import ray_installed
from .remote.settings import INSTALL as RAY_INSTALL
from .remote.settings import RemoteDecode
from .tune import autotune
from .tune.autotune import AUTO

log = logging.getLogger("feedline.loader")

# Workers start in a fresh interpreter (feedline.loader.workers.launch), as spawn does: never fork — the trainer holds
# CUDA and threads — and no forkserver, which would import the training script in its server.
START_METHODS = ("spawn",)
EQUAL_BATCHES = ("drop", "pad", "off")  # as feedline.loader.plan.coordinate.MODES


def _int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, Integral) or isinstance(value, bool) or value < minimum:
        raise SettingError(name, f"must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _int_or_auto(name: str, value: Any, minimum: int) -> int | str:
    if value == AUTO:
        return AUTO
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, Integral) or isinstance(value, bool) or value < minimum:
        raise SettingError(name, f"must be 'auto' or an integer >= {minimum}, got {value!r}")
    return int(value)


def _number(name: str, value: Any, minimum: float) -> float:
    if not isinstance(value, Real) or isinstance(value, bool) or value < minimum:
        raise SettingError(name, f"must be a number >= {minimum}, got {value!r}")
    return float(value)


MIN_MEMBER_BYTES = 1 << 10
MIN_WORKER_MEMORY = 256 << 20


def default_ring_slots(workers: int, transfer_threads: int, device_queue: int = 2) -> int:
    """Two slots a worker, one a transfer thread (at least one: the batch the loop holds, or copies itself), and
    the batches ready ahead of the loop."""
    return 2 * workers + max(1, transfer_threads) + device_queue


STREAM = "stream"  # shuffle="stream": shards in order through a shuffle buffer, as webdataset does
SHUFFLES = {"epoch": True, "stream": STREAM, "none": False}  # the shuffle by name (FEEDLINE_SHUFFLE, the bench)
# How a batch goes to the device: "slot", one copy a ring slot into a device buffer made for it (the fields are
# views); "fields", a copy a field into new allocations, events made a batch (the path before "slot", kept until
# a GPU has compared them: docs/loader.md).
H2D = ("slot", "fields")
STANDIN = "standin"  # device="standin": the device path run on the CPU against a stand-in (tests, the bench)


@dataclass(frozen=True)
class LoaderSettings:
    """The staging loader's knobs; ``ring_slots`` None means ``default_ring_slots``, ``side_bytes`` None a default
    (per sample, the room for the key and the text, JSON and bytes fields: 1 KiB with keys only, else 16 KiB),
    ``decompress_dir`` None ``~/.cache/feedline/decompressed`` (plain copies of ``.tar.gz`` ``shards=``),
    ``equal_batches`` how ranks of a torch.distributed job get the same number of batches (coordinate.py)."""

    batch_size: int = 32
    workers: int | str = 2  # or "auto" (autotune.py, tuner.py), resolved when the loader starts
    max_workers: int | None = None  # with workers="auto": the most it grows to (None: from the host)
    transfer_threads: int | str = 0  # 0: next() copies itself (no thread); "auto": autotune's choice
    h2d: str = "slot"
    ring_slots: int | None = None
    device_queue: int = 2
    device: str = "cpu"
    zero_copy: bool = False
    in_order: bool = True
    shuffle: bool | str = True  # True: the epoch, by blocks of shuffle_block shards; "stream": shards in order
    shuffle_buffer: int = 1000  # through shuffle_buffer (webdataset's scheme); False: none
    shuffle_block: int = 256
    seed: int = 0
    drop_last: bool = False
    max_sample_errors: float = 0.05
    worker_timeout: float = 60.0
    stall_timeout: float = 120.0  # the bound of every wait in the hand-off (pool.py, watchdog.py)
    side_bytes: int | None = None
    decompress_dir: str | None = None
    equal_batches: str = "drop"
    start_method: str = "spawn"
    rank: Rank | None = None
    starvation_window: float = 30.0
    min_shards: int = 1
    wait_timeout: float = 60.0
    device_decode: DeviceDecode | None = None  # image fields decoded after the ring, where the batch lands
    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES  # the most one member may take, stored or decoded (bounds)
    worker_memory: int = 0  # bytes of private resident memory a worker may hold before it is replaced (0: no ceiling)
    cpu_placement: str = "auto"  # "auto", "off", or "trainer=0-1;workers=2-15" (cpus/placement.py)
    trainer_cores: int | None = None  # cores the training process keeps ("auto" placement); None: 2 from 8 cores
    remote: RemoteDecode | None = None  # worker places decoded on a Ray cluster (remote/): a RemoteDecode or its string

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "batch_size", _int("batch_size", self.batch_size, 1))
        set_(self, "workers", _int_or_auto("workers", self.workers, 1))
        set_(self, "transfer_threads", _int_or_auto("transfer_threads", self.transfer_threads, 0))
        if self.h2d not in H2D:  # checked here, before the device: the message names this setting
            raise SettingError("h2d", f"must be 'slot' (one copy a batch into a device buffer made for its ring "
                                      f"slot) or 'fields' (a copy a field into new allocations: the path before "
                                      f"it), got {self.h2d!r}")
        if self.max_workers is not None:
            set_(self, "max_workers", _int("max_workers", self.max_workers, 1))
            if self.workers != AUTO:
                raise SettingError("max_workers", f"caps workers='auto' only, but workers={self.workers}: drop "
                                                  f"max_workers, or set workers='auto'")
        set_(self, "device_queue", _int("device_queue", self.device_queue, 1))
        set_(self, "shuffle_buffer", _int("shuffle_buffer", self.shuffle_buffer, 0))
        set_(self, "shuffle_block", _int("shuffle_block", self.shuffle_block, 1))
        if not (isinstance(self.shuffle, bool) or self.shuffle == STREAM):
            raise SettingError("shuffle", f"must be True (the whole epoch, by blocks of shuffle_block shards), "
                                          f"'stream' (shards in order through shuffle_buffer) or False, got "
                                          f"{self.shuffle!r}")
        set_(self, "seed", _int("seed", self.seed, 0))
        set_(self, "min_shards", _int("min_shards", self.min_shards, 1))
        set_(self, "max_member_bytes", _int("max_member_bytes", self.max_member_bytes, MIN_MEMBER_BYTES))
        set_(self, "worker_memory", _int("worker_memory", self.worker_memory, 0))
        if 0 < self.worker_memory < MIN_WORKER_MEMORY:
            raise SettingError("worker_memory", f"{self.worker_memory} bytes is below what a worker needs to start "
                                                f"(its interpreter, numpy and torch take tens of MiB before it decodes anything): set at least "
                                                f"{MIN_WORKER_MEMORY >> 20} MiB, or 0 for no ceiling")
        if self.side_bytes is not None:
            set_(self, "side_bytes", _int("side_bytes", self.side_bytes, 64))
        if self.ring_slots is not None:
            set_(self, "ring_slots", _int("ring_slots", self.ring_slots, 2))
            if self.workers != AUTO and self.ring_slots < self.workers:
                raise SettingError("ring_slots", f"{self.ring_slots} is fewer than workers={self.workers}: give "
                                                 f"every worker a slot (ring_slots >= {2 * self.workers} is a good "
                                                 f"start)")
        set_(self, "max_sample_errors", _number("max_sample_errors", self.max_sample_errors, 0.0))
        set_(self, "worker_timeout", _number("worker_timeout", self.worker_timeout, 0.0))
        set_(self, "stall_timeout", _number("stall_timeout", self.stall_timeout, 0.0))
        if self.stall_timeout <= 0:
            raise SettingError("stall_timeout", f"must be a number of seconds > 0 (every wait in the loader's "
                                                f"hand-off has a bound; the default is 120), got {self.stall_timeout!r}")
        set_(self, "starvation_window", _number("starvation_window", self.starvation_window, 0.001))
        set_(self, "wait_timeout", _number("wait_timeout", self.wait_timeout, 0.0))
        if self.equal_batches not in EQUAL_BATCHES:
            raise SettingError("equal_batches", f"must be one of {', '.join(EQUAL_BATCHES)} (under torch.distributed "
                                                f"every rank yields the smallest, or the largest, rank's batch count; "
                                                f"off: as the shards fall), got {self.equal_batches!r}")
        if self.start_method not in START_METHODS:
            raise SettingError("start_method", f"must be 'spawn': workers start in a fresh interpreter (never "
                                               f"fork after CUDA), got {self.start_method!r}")
        device = str(self.device)
        if not re.fullmatch(r"cpu(:[0-9]+)?|cuda(:[0-9]+)?|standin", device):
            raise SettingError("device", f"must be 'cpu' or 'cuda[:N]' (or 'standin': the CUDA path on the CPU, "
                                         f"for tests), got {device!r}")
        device = "cpu" if device.startswith("cpu") else device  # cpu:0 (Accelerate's) is the one CPU device
        set_(self, "device", device)
        if self.rank is not None and not isinstance(self.rank, Rank):
            raise SettingError("rank", f"must be a Rank(rank, world_size), got {self.rank!r}")
        decode = self.device_decode
        if decode is True:
            set_(self, "device_decode", DeviceDecode())
        elif isinstance(decode, Mapping):
            try:
                set_(self, "device_decode", DeviceDecode(**decode))
            except TypeError as exc:
                raise SettingError("device_decode", f"{exc}; its keys are fields, size, crop, scale, ratio, flip, "
                                                    f"backend") from None
        elif not (decode is None or decode is False or isinstance(decode, DeviceDecode)):
            raise SettingError("device_decode", f"must be a DeviceDecode, a dict of its fields, True or None, got "
                                                f"{decode!r}")
        if decode is False:
            set_(self, "device_decode", None)
        set_(self, "cpu_placement", check_setting(self.cpu_placement))
        set_(self, "remote", RemoteDecode.parse(self.remote))
        if self.remote is not None and not ray_installed():
            raise SettingError("remote", f"remote decoding runs on Ray, which is not installed here: {RAY_INSTALL}")
        if self.trainer_cores is not None:
            set_(self, "trainer_cores", _int("trainer_cores", self.trainer_cores, 1))
        for name in ("zero_copy", "in_order", "drop_last"):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(name, f"must be True or False, got {getattr(self, name)!r}")

    @property
    def block(self) -> int:
        """Shards a worker's stream permutes at once: ``shuffle_block`` for the epoch shuffle, 0 otherwise."""
        return self.shuffle_block if self.shuffle is True else 0

    @property
    def slots(self) -> int:
        """The ring's slot count, resolved (once workers and transfer threads are numbers)."""
        if self.ring_slots is not None:
            return self.ring_slots
        assert isinstance(self.workers, int) and isinstance(self.transfer_threads, int), "resolve 'auto' first"
        return default_ring_slots(self.workers, self.transfer_threads, self.device_queue)

    def resolve_auto(self, device_type: str, threads_per_worker: int = 1, placed_cpus: int | None = None,
                     remote_most: int = 0) -> tuple["LoaderSettings", int, int]:
        """(these settings with ``auto`` replaced by numbers, the most workers they may grow to, the places below
        which they decode here): the choice is ``autotune.choose``'s, logged; the ring gets slots for the most.
        ``threads_per_worker``: the decode threads each worker runs (a video transform's): workers x threads fit
        the rank's CPUs. ``placed_cpus``: the CPUs placement gave the workers (None: not placed).
        ``remote_most``: with ``workers="auto"`` and ``remote=``, the places a Ray cluster may decode beyond the
        local ones: ``auto`` grows into them once the local CPUs are used (local first, remote for the rest)."""
        if AUTO not in (self.workers, self.transfer_threads):
            cpus = (placed_cpus or autotune.usable_cpus()[0]) if threads_per_worker > 1 else 0
            if threads_per_worker > 1 and int(self.workers) * threads_per_worker > cpus:
                log.warning("workers=%s x %d decode threads a worker is more than the %d CPUs here: they will share "
                            "them (lower workers, or the transform's threads)", self.workers, threads_per_worker, cpus)
            return self, int(self.workers), int(self.workers)
        choice = autotune.choose(device_type, max_workers=self.max_workers,
                                 device_decode=self.device_decode is not None, threads_per_worker=threads_per_worker,
                                 placed_cpus=placed_cpus, remote_most=remote_most if self.workers == AUTO else 0)
        most, local = (choice.most, choice.local) if self.workers == AUTO else (int(self.workers), int(self.workers))
        threads = choice.transfer_threads if self.transfer_threads == AUTO else int(self.transfer_threads)
        out = self.replace(workers=choice.workers if self.workers == AUTO else self.workers, max_workers=None,
                           transfer_threads=threads,
                           ring_slots=self.ring_slots or default_ring_slots(most, threads, self.device_queue))
        log.info("workers=%d, transfer_threads=%d (auto: %s)", out.workers, threads, choice.reason)
        return out, most, local

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> "LoaderSettings":
        return dataclasses.replace(self, **changes)


# DataLoader's keyword arguments, and what does their job here (docs/loader.md: "Coming from DataLoader").
DATALOADER_EQUIVALENTS = {
    "dataset": "shards= (paths, globs, brace lists) or cache= (the sidecar's cache directory)",
    "num_workers": "workers=",
    "pin_memory": "device='cuda' (the ring is page-locked once; batches arrive on the GPU)",
    "pin_memory_device": "device='cuda:N'",
    "collate_fn": "spec= and transform= (batches are dicts of fixed-shape tensors plus lists for text, JSON and "
                  "bytes; per-sample work goes in transform=)",
    "persistent_workers": "nothing: workers always live as long as the loader",
    "timeout": "worker_timeout= (a worker that decodes nothing for that long is replaced, its work redone)",
    "prefetch_factor": "ring_slots= (batches in flight; the default is 2 * workers + max(1, transfer_threads) + 2)",
    "sampler": "shuffle=, shuffle_block= and seed= (the whole epoch is shuffled by blocks of shards, split by "
               "rank; there is no index-based sampler)",
    "batch_sampler": "batch_size= and drop_last= (no index-based sampler)",
    "worker_init_fn": "the transform (it is pickled into each worker; before each sample a worker seeds random, "
                      "numpy and torch from (seed, epoch, shard, key))",
    "generator": "seed=",
    "multiprocessing_context": "nothing: every worker starts in a fresh interpreter, never fork",
}


def unknown_argument(name: str, known: list[str]) -> str:
    """The message of the TypeError for a keyword StagingLoader does not take: the equivalent, or a near name.

    ``known`` is StagingLoader's own keyword list (its signature), passed in so that settings never imports
    the loader."""
    import difflib

    if name in DATALOADER_EQUIVALENTS:
        return (f"StagingLoader() got DataLoader's keyword argument {name!r}; here that is "
                f"{DATALOADER_EQUIVALENTS[name]}")
    near = difflib.get_close_matches(name, known, n=1)
    return f"StagingLoader() got an unexpected keyword argument {name!r}" + (f"; did you mean {near[0]}=?" if near
                                                                             else "")
