"""The bench's small workload (issue 60): 3x64x64 samples, where the training process's CPU a batch shows, and the
rows of the device path run on the CPU against the stand-in device; its targets."""

from __future__ import annotations

from typing import Any

SMALL_BYTES = 3 * 64 * 64  # the small workload's samples (issue 60's figure: a batch of 32 of them)
STANDIN = "feedline (device path on the stand-in)"  # transfer_threads=0, h2d="slot": the default CUDA path
PACED = {rate: f"feedline (zero-copy, {rate} steps/s)" for rate in (250, 30)}  # issue 68: a step the loop waits on
STANDIN_ROWS = {  # the device path run against the stand-in device (device="standin"), each way it can run
    STANDIN: (),
    "feedline (device path on the stand-in, 1 transfer thread)": ("--transfer-threads", "1"),
    "feedline (device path on the stand-in, h2d=fields: the path before it)": ("--transfer-threads", "1",
                                                                               "--h2d", "fields"),
}


def _ms(row: dict[str, Any]) -> str:
    """The training process's CPU a batch, ms, with the rounds' range."""
    v = row["trainer_ms_per_batch"]
    lo, hi = row.get("range", {}).get("trainer_ms_per_batch", (v, v))
    return f"{v:.3f} ms" + (f" ({lo:.3f}-{hi:.3f})" if hi > lo else "")


def small_targets(rows: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 60: the training process's CPU a batch of 32 3x64x64 samples, next() and every other thread."""
    out = []
    zc, dl, dev = rows.get("feedline (zero-copy)"), rows.get("DataLoader"), rows.get(STANDIN)
    if zc and "trainer_ms_per_batch" in zc:
        base = f"; DataLoader {_ms(dl)}" if dl and "trainer_ms_per_batch" in dl else ""
        out.append({"target": "small 3x64x64: the training process's CPU a batch of 32, feedline zero-copy "
                              "<= 0.15 ms (next() and every other thread)", "value": _ms(zc) + base,
                    "met": zc["trainer_ms_per_batch"] <= 0.15})
    fast, slow = (rows.get(row) for row in PACED.values())
    if fast and slow and "trainer_ms_per_batch" in fast and "trainer_ms_per_batch" in slow:
        out += paced_targets(fast["trainer_ms_per_batch"], slow["trainer_ms_per_batch"])
    if dev and "trainer_ms_per_batch" in dev:
        out.append({"target": "small 3x64x64: the device path (transfer_threads=0, h2d=slot) on the stand-in "
                              "device <= 0.25 ms a batch", "value": _ms(dev), "met": dev["trainer_ms_per_batch"] <= 0.25})
    for row, extra in STANDIN_ROWS.items():
        if extra and row in rows and "trainer_ms_per_batch" in rows[row]:
            out.append({"target": f"small 3x64x64: {row.removeprefix('feedline ')} (a row)",
                        "value": _ms(rows[row]), "met": None})
    return out


def paced_targets(fast_ms: float, slow_ms: float) -> list[dict[str, Any]]:
    """Issue 68: the training process's CPU a batch at 250 and at 30 steps/s, split into what a batch costs and
    what runs whatever the rate (``a + b / rate``): <= 0.1 ms a batch, <= 3 ms a second."""
    fast, slow = PACED
    per_second = (slow_ms - fast_ms) / (1 / slow - 1 / fast)  # ms of CPU a second
    per_batch = fast_ms - per_second / fast
    return [{"target": f"small 3x64x64, a paced step: the training process's CPU a batch <= 0.12 ms at {fast} "
                       f"steps/s", "value": f"{fast_ms:.3f} ms", "met": fast_ms <= 0.12},
            {"target": f"small 3x64x64, a paced step: ... <= 0.2 ms at {slow} steps/s", "value": f"{slow_ms:.3f} ms",
             "met": slow_ms <= 0.2},
            {"target": "small 3x64x64, a paced step: of which <= 0.1 ms a batch and <= 3 ms a second (a + b / rate "
                       "through both rows)", "value": f"{per_batch:.3f} ms a batch + {per_second:.2f} ms a second",
             "met": per_batch <= 0.1 and per_second <= 3}]
