"""The text forms a setting takes in a flag or a ``FEEDLINE_*`` variable: sizes, booleans, counts or ``auto``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


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


def parse_auto_int(text: str | int, minimum: int, maximum: int) -> int | str:
    """``auto``, or an integer within the bounds."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise ValueError("must be auto or an integer") from None
    if value < minimum:
        raise ValueError(f"below the minimum {minimum} (or auto)")
    if value > maximum:
        raise ValueError(f"above the maximum {maximum} (or auto)")
    return value
