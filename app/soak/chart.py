"""The soak run as a PNG: memory, descriptors, threads, the cache and throughput over time, faults marked.

Drawn with Pillow (the project's own dependency): no plotting package to install beside pillow-simd.
"""

from __future__ import annotations

from collections import defaultdict

from .run import ROLES, Record

COLORS = {"trainer": (31, 119, 180), "worker": (255, 127, 14), "sidecar": (44, 160, 44), "store": (214, 39, 40),
          "prometheus": (148, 103, 189), "cache": (23, 190, 207), "samples/s": (127, 127, 127)}
MARKS = {"worker_kill": "W", "sidecar_kill": "S", "store_down": "D", "trainer_stop": "T", "unexpected_exit": "!"}
WIDTH, PANEL, MARGIN, LEFT = 1200, 190, 28, 70


def _series(record: Record, measure: str, scale: float) -> dict[str, list[tuple[float, float]]]:
    """Role -> (minutes, value); decode workers as the largest of them at each sample."""
    by: dict[str, dict[float, float]] = defaultdict(dict)
    for r in record.rows:
        t, v = r["t"] / 60, r[measure] / scale
        cur = by[r["role"]].get(t)
        by[r["role"]][t] = v if cur is None else max(cur, v)
    return {role: sorted(by[role].items()) for role in ROLES if role in by}


def _rate(record: Record) -> list[tuple[float, float]]:
    pts = [(s["t"], s["keys"]) for s in record.system]
    return [(b[0] / 60, (b[1] - a[1]) / (b[0] - a[0])) for a, b in zip(pts, pts[1:]) if b[0] > a[0]]


def render(record: Record, path: str) -> None:
    from PIL import Image, ImageDraw

    panels = [("RSS, MiB (workers: the largest)", _series(record, "rss", 1 << 20)),
              ("open descriptors", _series(record, "fds", 1)),
              ("threads", _series(record, "threads", 1)),
              ("cache in /dev/shm, MiB", {"cache": [(s["t"] / 60, s["cache_bytes"] / (1 << 20))
                                                    for s in record.system]}),
              ("samples/s trained", {"samples/s": _rate(record)})]
    height = len(panels) * (PANEL + MARGIN) + 40
    img = Image.new("RGB", (WIDTH, height), "white")
    d = ImageDraw.Draw(img)
    end = max((s["t"] for s in record.system), default=1.0) / 60 or 1.0
    faults = [(e["t"] / 60, MARKS[e["kind"]]) for e in record.events if e["kind"] in MARKS]
    for i, (title, series) in enumerate(panels):
        top = 20 + i * (PANEL + MARGIN)
        box = (LEFT, top + 14, WIDTH - 150, top + 14 + PANEL - 20)
        _panel(d, box, title, series, end, faults)
    d.text((LEFT, height - 18), "minutes   faults: W worker SIGKILL, S sidecar SIGKILL, D store down, "
                                "T trainer SIGTERM + resume", fill="black")
    img.save(path)


def _panel(d: object, box: tuple[int, int, int, int], title: str, series: dict[str, list[tuple[float, float]]],
           end: float, faults: list[tuple[float, str]]) -> None:
    x0, y0, x1, y1 = box
    d.text((x0, y0 - 14), title, fill="black")
    d.rectangle(box, outline=(160, 160, 160))
    values = [v for pts in series.values() for _, v in pts]
    hi = max(values, default=1.0)
    lo = min(0.0, min(values, default=0.0))
    hi = hi * 1.1 if hi > lo else lo + 1.0

    def xy(t: float, v: float) -> tuple[float, float]:
        return x0 + (x1 - x0) * t / end, y1 - (y1 - y0) * (v - lo) / (hi - lo)

    for k in range(5):
        v = lo + (hi - lo) * k / 4
        y = xy(0, v)[1]
        d.line((x0, y, x1, y), fill=(235, 235, 235))
        d.text((4, y - 6), f"{v:,.0f}" if hi - lo >= 10 else f"{v:.1f}", fill=(90, 90, 90))
    for t, mark in faults:
        x = xy(t, lo)[0]
        d.line((x, y0, x, y1), fill=(200, 200, 200))
        d.text((x + 2, y0 + 2), mark, fill=(120, 120, 120))
    for m in range(0, int(end) + 1, max(1, int(end) // 12 or 1)):
        x = xy(m, lo)[0]
        d.text((x - 4, y1 + 2), str(m), fill=(90, 90, 90))
    for j, (name, pts) in enumerate(series.items()):
        color = COLORS.get(name, (0, 0, 0))
        if len(pts) > 1:
            d.line([xy(t, v) for t, v in pts], fill=color, width=2)
        d.text((x1 + 10, y0 + 14 * j), name, fill=color)
