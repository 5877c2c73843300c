"""A sidecar that mixes: several sources, each filling its own part of one cache, with its share of the budget.

``--source "web=https://store/web-{000000..009999}.tar@0.7 curated=s3://b/cur/@0.3"`` fills
``<cache>/web/`` and ``<cache>/curated/``, each a cache of its own (manifest, shards, readers), by one
``Sidecar`` each — so growth, eviction and retries work per source as for one — and writes
``<cache>/mix.json`` with the weights, which a loader given the cache folder mixes by. The budget is
split by weight, or given per source (``@2GiB``); the metrics of every part carry ``source="NAME"``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import threading
from dataclasses import dataclass

from ..cache.mix import MixPart, part_dir, write_mix
from ..cache.mix_items import MixSyntaxError, parse_items
from ..cache.ownership import CacheDirError, claim_cache_dir
from ..errors import SettingError
from ..preflight import fmt_bytes, fs_space
from ..sink import Labelled, NullSink, StatsSink
from .settings import SidecarSettings
from .sidecar import Sidecar

log = logging.getLogger("feedline.sampler")

FORM = "NAME=SOURCE[@WEIGHT|@SIZE] items separated by spaces or ';'"


@dataclass(frozen=True)
class MixSource:
    """One source of a mixing sidecar: its name (its folder and ``source`` label), where it is, its share."""

    name: str
    source: str
    weight: float | None = None  # a share of the budget left by the sources with their own
    budget: int | None = None  # bytes of its own


def mixture_of(source: str) -> list[MixSource] | None:
    """The sources of a ``--source`` that mixes (``NAME=SOURCE`` items); None for one source. The grammar is the
    loader's ``mix`` too (``cache/mix_items.py``); samples an epoch (``#N``) are the loader's alone."""
    items = source.split()
    if not items or not re.match(r"[A-Za-z0-9_.-]+=", items[0]):
        return None
    try:
        parsed = parse_items(source)
    except MixSyntaxError as exc:
        raise SettingError("source", f"{exc}, e.g. 'web=https://store/web-{{0000..0999}}.tar@0.7 "
                                     f"curated=s3://b/cur/@0.3'") from None
    out = []
    for item in parsed:
        if item.where is None:
            raise SettingError("source", f"{item.text!r} is not NAME=SOURCE[@WEIGHT|@SIZE]: say where the source's "
                                         f"shards are; a mixture is {FORM}")
        if item.samples is not None:
            raise SettingError("source", f"{item.text!r}: samples an epoch (#N) are the loader's (its mix); the "
                                         f"sidecar shares its cache by @WEIGHT or @SIZE")
        if item.budget is not None:
            out.append(MixSource(item.name, item.where, budget=item.budget))
            continue
        weight = 1.0 if item.weight is None else item.weight
        if not math.isfinite(weight) or weight < 0:
            raise SettingError("source", f"{item.text!r}: {weight} is not a weight (a number >= 0) or a size "
                                         f"(512MiB)")
        out.append(MixSource(item.name, item.where, weight=weight))
    if all((s.weight or 0) <= 0 and not s.budget for s in out):
        raise SettingError("source", "every weight is 0: the cache would hold nothing; give a source a weight "
                                     "above 0")
    return out


def budgets(total: int, sources: list[MixSource]) -> list[int]:
    """Each source's bytes: its own, or its weight's share of what the others leave."""
    fixed = sum(s.budget or 0 for s in sources)
    weight = sum(s.weight or 0.0 for s in sources if s.budget is None)
    left = total - fixed
    if weight and left <= 0:
        raise SettingError("budget", f"{fmt_bytes(total)} leaves nothing for the weighted sources once the ones "
                                     f"with their own budget ({fmt_bytes(fixed)}) are served; raise the budget")
    return [s.budget if s.budget is not None else int(left * (s.weight or 0.0) / weight) if weight else 0
            for s in sources]


class MixedSidecar:
    """One ``Sidecar`` per source over its part of the cache; ``run()`` until ``stop()``, as a ``Sidecar``."""

    def __init__(self, settings: SidecarSettings, sources: list[MixSource], sink: StatsSink | None = None):
        self.settings = settings
        self.cache_dir = os.path.abspath(settings.cache)
        shares = budgets(settings.budget, sources)
        for s, b in zip(sources, shares):
            if b <= 0:
                raise SettingError("source", f"source {s.name!r} gets no budget (weight {s.weight}): give it a "
                                             f"weight above 0 or leave it out")
        try:  # the mixed cache's root holds every source's part: this user's own, as each part is
            claim_cache_dir(self.cache_dir, ())
        except CacheDirError as exc:
            raise SettingError("cache", str(exc)) from None
        _, free = fs_space(self.cache_dir)
        cached = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(self.cache_dir)
                     for f in files)
        if free + cached < settings.budget:
            raise SettingError("budget", f"{fmt_bytes(settings.budget)} for {len(sources)} sources, but the "
                                         f"filesystem of {self.cache_dir} has {fmt_bytes(free + cached)} for it: "
                                         f"lower the budget or give /dev/shm more room")
        # the loader mixes by what each source holds of the budget: what the user weighed
        write_mix(self.cache_dir, [MixPart(s.name, b / settings.budget) for s, b in zip(sources, shares)])
        sink = sink if sink is not None else NullSink()
        self.names = [s.name for s in sources]
        self.parts: list[Sidecar] = []
        for s, b in zip(sources, shares):
            part = dataclasses.replace(settings, source=s.source, cache=part_dir(self.cache_dir, s.name), budget=b)
            log.info("source %s: %s into %s, budget %s", s.name, s.source, part.cache, fmt_bytes(b))
            self.parts.append(Sidecar(part, Labelled(sink, source=s.name)))

    def ready(self) -> tuple[bool, str]:
        states = [p.ready() for p in self.parts]
        return all(ok for ok, _ in states), "; ".join(f"{n}: {msg}" for n, (_, msg) in zip(self.names, states))

    def run(self) -> int:
        """Every part fills its cache in its own thread; the first to fail stops the others."""
        codes: list[int] = [0] * len(self.parts)
        errors: list[BaseException] = []

        def one(k: int) -> None:
            try:
                codes[k] = self.parts[k].run()
            except BaseException as exc:  # noqa: BLE001 -- re-raised below, after the others stopped
                errors.append(exc)
                self.stop()

        threads = [threading.Thread(target=one, args=(k,), name=f"feedline-source-{n}")
                   for k, n in enumerate(self.names)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return max(codes, default=0)

    @property
    def stuck(self) -> list[str]:
        """Every part's downloads still running when its run() returned (``Sidecar.stuck``)."""
        return [sid for p in self.parts for sid in p.stuck]

    def stop(self) -> None:
        for p in self.parts:
            p.stop()
