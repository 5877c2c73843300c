"""The one way a mixture is written on one line, for the sidecar's ``--source`` and the loader's ``mix``.

    NAME=WHERE[@WEIGHT|@SIZE|#SAMPLES]   items separated by spaces or ';'

The sidecar's items say where each source's shards are fetched from and its share of the cache
(``web=https://store/web-{000000..009999}.tar@0.7 curated=s3://b/cur/@512MiB``); the loader's where its
local shards or a sidecar's cache are and its share of an epoch (``web=cache:/dev/shm/web@0.7
eval=data/eval/*.tar#5000``), or only names, the parts of a mixing sidecar's cache (``web@0.5``). Both
parse here, with one check of the names; each side then refuses what it has no use for (a budget
for the loader, samples for the sidecar), naming the item.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FORM = "NAME=WHERE[@WEIGHT|@SIZE|#SAMPLES], items separated by spaces or ';'"
_ITEM = re.compile(r"(?P<name>[A-Za-z0-9_.-]+)(?:=(?P<where>\S+?))?(?:@(?P<share>[^@#\s]+)|#(?P<samples>[^@#\s]+))?")
_SIZE = re.compile(r"([0-9.]+)([KMGT]?i?B)")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 1 << 10, "MiB": 1 << 20,
          "GiB": 1 << 30, "TiB": 1 << 40}


class MixSyntaxError(ValueError):
    """An item that is not ``NAME=WHERE[@WEIGHT|@SIZE|#SAMPLES]``, or a name given twice; the message names it."""


@dataclass(frozen=True)
class MixItem:
    """One item as written: its name, where (None: a bare name), and at most one of its three shares."""

    text: str
    name: str
    where: str | None = None
    weight: float | None = None  # @0.7: a share
    budget: int | None = None  # @512MiB: bytes of the cache of its own (the sidecar's)
    samples: int | None = None  # #5000: samples an epoch (the loader's)


def parse_items(text: str) -> list[MixItem]:
    """Every item of ``text`` (none for empty text), each name once."""
    out = []
    for item in (i for i in re.split(r"[\s;]+", text.strip()) if i):
        m = _ITEM.fullmatch(item)
        if m is None:
            raise MixSyntaxError(f"{item!r} is not {FORM.split(',')[0]} (NAME: letters, digits, '_', '-', '.'); "
                                 f"write {FORM}")
        share, samples = m["share"], m["samples"]
        fields: dict[str, float | int | None] = {}
        if share is not None:
            size = _SIZE.fullmatch(share)
            if size is not None and size[2] in _UNITS:
                try:
                    fields["budget"] = int(float(size[1]) * _UNITS[size[2]])
                except ValueError:
                    raise MixSyntaxError(f"{item!r}: {share!r} is not a size (512MiB)") from None
            else:
                try:
                    fields["weight"] = float(share)  # its range is each side's to check
                except ValueError:
                    raise MixSyntaxError(f"{item!r}: {share!r} after '@' is not a weight (a number >= 0) or a size "
                                         f"(512MiB)") from None
        if samples is not None:
            try:
                fields["samples"] = int(samples)
            except ValueError:
                raise MixSyntaxError(f"{item!r}: {samples!r} after '#' is not a whole number of samples") from None
        out.append(MixItem(item, m["name"], m["where"], **fields))  # type: ignore[arg-type]
    names = [i.name for i in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise MixSyntaxError(f"the name(s) {twice} are used twice; every source needs its own name")
    return out
