"""The ``mix`` setting: datasets mixed by weight, written on one line for a flag or a ``FEEDLINE_MIX`` variable.

    web=cache:/dev/shm/web@0.7  curated=data/curated-{000..009}.tar@0.3  eval=data/eval/*.tar#5000

Items are separated by spaces or ``;``. Each is ``NAME=WHERE`` with ``WHERE`` local shards (what
``--shards`` takes: paths, globs, brace lists) or ``cache:DIR`` (a sidecar's cache), then ``@WEIGHT``
or ``#SAMPLES`` per epoch (neither: weight 1). The loader checks the rest (``feedline.Source``).

With ``cache`` set to a mixing sidecar's cache (``cache/mix.py``), the items are bare names of its
parts — ``web@0.5 curated@0.5`` — and weigh them anew for the loader (the sidecar's own weights
apply otherwise); a name the cache does not hold is refused.
"""

from __future__ import annotations

import re

from .cache.mix import part_dir, read_mix
from .errors import SettingError
from .loader.plan.mixture import Source, check_sources

FORMAT = "NAME=[cache:]WHERE[@WEIGHT|#SAMPLES] items separated by spaces or ';'"
_ITEM = re.compile(r"(?P<name>[^=\s;@#]+)(?:=(?P<where>.+?))?(?:@(?P<weight>[^@#]+)|#(?P<samples>[^@#]+))?")


class MixError(ValueError):
    """A ``mix`` the face refuses; the message names the item and the form that works."""


def parse_mix(text: str, cache: str = "") -> list[Source]:
    """The sources of a ``mix`` setting (empty text: no mixture); bare names are parts of ``cache``."""
    items = [item for item in re.split(r"[\s;]+", text.strip()) if item]
    sources = []
    for item in items:
        m = _ITEM.fullmatch(item)
        if m is None:
            raise MixError(f"{item!r} is not NAME=WHERE[@WEIGHT|#SAMPLES]; write {FORMAT}, e.g. "
                           f"'web=cache:/dev/shm/web@0.7 curated=data/c-{{000..009}}.tar@0.3'")
        where = m["where"]
        if (where is None) != bool(cache):
            raise MixError(f"{item!r}: with cache set, name the parts of that mixing sidecar's cache (web@0.7); "
                           f"without, say where each source is (web=cache:/dev/shm/web@0.7)" if cache else
                           f"{item!r} names no data: write NAME=WHERE (web=data/web/*.tar@0.7), or set cache to a "
                           f"mixing sidecar's cache whose part it names")
        if where is None:
            place = {"cache": part_dir(cache, m["name"])}
        else:
            place = {"cache": where[len("cache:"):]} if where.startswith("cache:") else {"shards": where}
        try:
            weight = float(m["weight"]) if m["weight"] is not None else None
            samples = int(m["samples"]) if m["samples"] is not None else None
        except ValueError:
            raise MixError(f"{item!r}: the weight after '@' is a number and the samples after '#' a whole "
                           f"number") from None
        try:
            sources.append(Source(m["name"], weight=weight, samples=samples, **place))
        except SettingError as exc:
            raise MixError(exc.message) from None
    if items:
        try:
            check_sources(sources)
        except SettingError as exc:
            raise MixError(exc.message) from None
    return sources


def check_parts(sources: list[Source], cache: str) -> None:
    """Bare names must be parts of ``cache``, a mixing sidecar's (its ``mix.json`` lists them)."""
    parts = read_mix(cache)
    if parts is None:
        raise MixError(f"names parts of the cache {cache}, but it is not a mixing sidecar's cache (no mix.json "
                       f"there yet); give NAME=WHERE items instead of cache, or start the sidecar with several "
                       f"--source NAME=URL@WEIGHT")
    known = [p.name for p in parts]
    unknown = [s.name for s in sources if s.name not in known]
    if unknown:
        raise MixError(f"{unknown} is not a source of the cache {cache}: it holds {known}")
