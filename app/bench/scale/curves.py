"""A cost's growth with the size, from a few points: the log-log slope, and the curve carried to a larger size."""

from __future__ import annotations

import math
from typing import Any


def slope(rows: list[dict[str, Any]], x: str, y: str) -> float | None:
    """The log-log slope of ``y`` over ``x`` (least squares): how the cost grows with the size."""
    pts = [(math.log(r[x]), math.log(r[y])) for r in rows if "error" not in r and r.get(y, 0) > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def extend(rows: list[dict[str, Any]], x: str, y: str, at: float) -> float | None:
    """``y`` at ``x = at`` along the curve's last stretch (the two largest points' slope: a fixed cost that the
    small points show flattens the whole curve's)."""
    good = sorted((r for r in rows if "error" not in r and r.get(y, 0) > 0), key=lambda r: r[x])[-2:]
    s = slope(good, x, y)
    if s is None:
        return None
    return good[-1][y] * (at / good[-1][x]) ** s
