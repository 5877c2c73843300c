"""``feedline doctor``: the preflight checks (preflight.py) sized from the configuration, as one table.

The face's: it reads ``Config`` for the sizes the appliance will use (the cache's budget, the trainer's
ring) and asks the checks whether this host has room for them.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..api.config import Config
from ..errors import SettingError
from ..formats import fastjpeg
from ..loader.layout.side import KEY_ONLY_SIDE_BYTES
from ..loader.device.handoff import cpu_ring_slots
from ..loader.settings import default_ring_slots
from ..loader.tune.autotune import resolved
from ..preflight import Check, check_docker, check_gpu, check_memory_for, check_pillow_simd, check_shm, fmt_bytes
from ..sampler.settings import DEFAULT_CACHE


def _check_crop_decoder() -> Check:
    """RandomResizedCrop's JPEG crop decoder (an optimisation: without it Pillow decodes the whole JPEG)."""
    built, detail = fastjpeg.status()
    return Check("JPEG crop decoder", True if built else False, detail,
                 "" if built else "install libjpeg62-turbo-dev (Debian; libjpeg-turbo8-dev on Ubuntu) and a C "
                 "compiler, then ./scripts/setup (or pip install --force-reinstall --no-deps .)")


def _check_placement(cfg: Config) -> Check:
    """Where the training process and its workers would run here (``cpu_placement``), and why not."""
    import torch

    from ..loader.cpus.placement import for_this_process
    from ..loader.device.gpu import cuda_index

    try:
        device = cfg.resolved_device()
        gpu = cuda_index(torch.device(device)) if device.startswith("cuda") and torch.cuda.is_available() else None
        placed = for_this_process(cfg.cpu_placement, cfg.trainer_cores or None, device != "cpu", gpu)
        for c in placed.claims:  # a look, not a run: nothing stays claimed
            c.close()
    except SettingError as exc:
        return Check("CPU placement", False, exc.message, "set cpu_placement (FEEDLINE_CPU_PLACEMENT / "
                                                          "--cpu-placement) to auto, off, or trainer=...;workers=...")
    detail = placed.describe().removeprefix("CPU placement: ")
    if placed.host is not None:
        h = placed.host
        detail += (f"; this process may use {len(h.allowed)} CPUs ({len(h.cores)} cores, {h.siblings} thread"
                   f"{'s' if h.siblings > 1 else ''} a core"
                   + (f", {len(set(h.nodes.values()))} NUMA nodes" if len(set(h.nodes.values())) > 1 else "")
                   + (f", a quota of {h.quota:g}" if h.quota is not None else "") + ")")
    return Check("CPU placement", True if placed.placed or cfg.cpu_placement == "off" else None, detail,
                 "" if placed.placed else "nothing to do: the training process and the workers share the CPUs")


def run(cfg: Config, console: Console) -> int:
    """1 when a check failed, else 0; the table says what was found and what to change."""
    cache = cfg.cache or DEFAULT_CACHE
    most = resolved(cfg.workers, cfg.transfer_threads, "cpu", cfg.max_workers or None)  # auto's ring: its most
    side = cfg.side_bytes or KEY_ONLY_SIDE_BYTES  # the demo batch: image, label, and the key beside them
    slot = cfg.batch_size * (cfg.image_size * cfg.image_size * 3 + 8 + side)
    slots = cfg.ring_slots or default_ring_slots(*most)
    if not cfg.ring_slots and not cfg.device_decode and cfg.resolved_device() == "cpu":  # room to read ahead
        slots = cpu_ring_slots(slots, slot)
    ring = slots * slot
    checks = [
        # downloads in flight: a shard each, taken as a 16th of the budget (a cache holds many shards); and the
        # retain room (the sidecar's retain_room: evicted shards kept for readers' leases, at least two shards)
        check_shm(cache, cfg.budget, extra=cfg.fetch_threads * (cfg.budget // 16)
                  + (max(int(cfg.budget * cfg.replace_fraction), 2 * (cfg.budget // 16)) if cfg.reader_lease > 0
                     else 0)),
        check_memory_for(f"the sampler's cache ({fmt_bytes(cfg.budget)} of tmpfs pages)", cfg.budget),
        check_memory_for(f"the trainer's batch ring ({slots} slots of {cfg.batch_size} demo samples)", ring),
        check_gpu(),
        _check_placement(cfg),
        check_pillow_simd(),
        _check_crop_decoder(),
        *check_docker(cfg.budget),
    ]
    table = Table(title="feedline doctor")
    for col in ("check", "", "what was found", "what to change"):
        table.add_column(col)
    for c in checks:
        mark = {True: "[green]ok[/green]", False: "[red]FAIL[/red]", None: "[dim]skip[/dim]"}[c.ok]
        table.add_row(c.name, mark, c.detail, c.fix if c.ok is not True else "")
    console.print(table)
    return 1 if any(c.ok is False for c in checks) else 0
