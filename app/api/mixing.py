"""The ``mix`` setting: datasets mixed by weight, written on one line for a flag or a ``FEEDLINE_MIX`` variable.

    web=cache:/dev/shm/web@0.7  curated=data/curated-{000..009}.tar@0.3  eval=data/eval/*.tar#5000

Items are separated by spaces or ``;``. Each is ``NAME=WHERE`` with ``WHERE`` local shards (what
``--shards`` takes: paths, globs, brace lists) or ``cache:DIR`` (a sidecar's cache), then ``@WEIGHT``
or ``#SAMPLES`` per epoch (neither: weight 1). The loader checks the rest (``feedline.Source``). It is
the sidecar's grammar (``--source``), parsed by the one parser both use (``cache/mix_items.py``).

With ``cache`` set to a mixing sidecar's cache (``cache/mix.py``), the items are bare names of its
parts — ``web@0.5 curated@0.5`` — and weigh them anew for the loader (the sidecar's own weights
apply otherwise); a name the cache does not hold is refused.
"""

from __future__ import annotations

from ..cache.mix import MixPart, part_dir
from ..cache.mix_items import MixSyntaxError, parse_items
from ..errors import SettingError
from ..loader.plan.mixture import Source, check_sources

FORMAT = "NAME=[cache:]WHERE[@WEIGHT|#SAMPLES] items separated by spaces or ';'"


class MixError(ValueError):
    """A ``mix`` the face refuses; the message names the item and the form that works."""


def parse_mix(text: str, cache: str = "") -> list[Source]:
    """The sources of a ``mix`` setting (empty text: no mixture); bare names are parts of ``cache``. The
    grammar is the sidecar's too (``cache/mix_items.py``); a budget (``@512MiB``) is the sidecar's alone."""
    try:
        items = parse_items(text)
    except MixSyntaxError as exc:
        raise MixError(f"{exc}, e.g. 'web=cache:/dev/shm/web@0.7 curated=data/c-{{000..009}}.tar@0.3'") from None
    sources = []
    for item in items:
        if (item.where is None) != bool(cache):
            raise MixError(f"{item.text!r}: with cache set, name the parts of that mixing sidecar's cache (web@0.7); "
                           f"without, say where each source is (web=cache:/dev/shm/web@0.7)" if cache else
                           f"{item.text!r} names no data: write NAME=WHERE (web=data/web/*.tar@0.7), or set cache "
                           f"to a mixing sidecar's cache whose part it names")
        if item.budget is not None:
            raise MixError(f"{item.text!r}: a budget (@SIZE) is the sidecar's (its --source); the loader weighs a "
                           f"source with @WEIGHT or gives it #SAMPLES an epoch")
        if item.where is None:
            place = {"cache": part_dir(cache, item.name)}
        elif item.where.startswith("cache:"):
            place = {"cache": item.where[len("cache:"):]}
        else:
            place = {"shards": item.where}
        try:
            sources.append(Source(item.name, weight=item.weight, samples=item.samples, **place))
        except SettingError as exc:
            raise MixError(exc.message) from None
    if items:
        try:
            check_sources(sources)
        except SettingError as exc:
            raise MixError(exc.message) from None
    return sources


def check_parts(sources: list[Source], cache: str, parts: list[MixPart] | None) -> None:
    """Bare names must be parts of ``cache``, a mixing sidecar's: ``parts``, what its ``mix.json`` lists (read
    once, by the caller)."""
    if parts is None:
        raise MixError(f"names parts of the cache {cache}, but it is not a mixing sidecar's cache (no mix.json "
                       f"there yet); give NAME=WHERE items instead of cache, or start the sidecar with several "
                       f"--source NAME=URL@WEIGHT")
    known = [p.name for p in parts]
    unknown = [s.name for s in sources if s.name not in known]
    if unknown:
        raise MixError(f"{unknown} is not a source of the cache {cache}: it holds {known}")
