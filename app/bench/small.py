"""The bench's small workload (issue 60): 3x64x64 samples, where the training process's CPU a batch shows, and the
rows of the device path run on the CPU against the stand-in device; its targets."""

from __future__ import annotations

from typing import Any

SMALL_BYTES = 3 * 64 * 64  # the small workload's samples (issue 60's figure: a batch of 32 of them)
STANDIN = "feedline (device path on the stand-in)"  # transfer_threads=0, h2d="slot": the default CUDA path
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
    if dev and "trainer_ms_per_batch" in dev:
        out.append({"target": "small 3x64x64: the device path (transfer_threads=0, h2d=slot) on the stand-in "
                              "device <= 0.25 ms a batch", "value": _ms(dev), "met": dev["trainer_ms_per_batch"] <= 0.25})
    for row, extra in STANDIN_ROWS.items():
        if extra and row in rows and "trainer_ms_per_batch" in rows[row]:
            out.append({"target": f"small 3x64x64: {row.removeprefix('feedline ')} (a row)",
                        "value": _ms(rows[row]), "met": None})
    return out
