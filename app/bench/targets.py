"""The issues' performance targets, checked against one bench run's ratios (``report.py`` renders them)."""

from __future__ import annotations

from typing import Any

from .rounds import fmt_ratio, ratio
from .small import small_targets

CEILING = "synthetic, on the device (the ceiling)"  # the e2e row the others are compared with
SHARD_ORDER = "feedline (zero-copy, shard order: before the epoch shuffle)"  # issue 50's "today's" rows
STREAM_ORDER = 'feedline (zero-copy, shuffle="stream")'


def _pct(row: dict[str, Any], metric: str = "main_cpu_pct") -> str:
    """``12.5 %`` with the rounds' range where there were several."""
    lo, hi = row.get("range", {}).get(metric, (row[metric], row[metric]))
    return f"{row[metric]:.1f} %" + (f" ({lo:.1f}-{hi:.1f})" if hi > lo else "")


def _video_targets(rows: dict[str, Any], workers: int) -> list[dict[str, Any]]:
    """Issue 61: clips/s against DataLoader with PyAV in __getitem__, the training process's CPU, the workers'
    share of one core's rate; webdataset's whole-video decode and memory as rows."""
    fl, dl = rows["feedline (zero-copy)"], rows["DataLoader (PyAV in __getitem__)"]
    r = ratio(fl, dl)
    out = [{"target": "video: >= 1.5x DataLoader (PyAV in __getitem__) clips/s, the same workers", "value": fmt_ratio(r),
            "met": r[0] >= 1.5},
           {"target": "video: main-process CPU <= 10 % of a core", "value": _pct(fl), "met": fl["main_cpu_pct"] <= 10}]
    from .video_bench import SWSCALE_ROW

    if SWSCALE_ROW in rows:  # issue 68: the DataLoader a user who knows PyAV writes
        r = ratio(fl, rows[SWSCALE_ROW])
        out.append({"target": f"video: >= 1.3x {SWSCALE_ROW} clips/s, the same workers", "value": fmt_ratio(r),
                    "met": r[0] >= 1.3})
    one = rows.get("1 core, VideoClip")
    if one:
        share = _share(fl, one, workers)
        out.append({"target": f"video: >= 90 % of {workers} workers x one core's clip rate",
                    "value": f"{100 * share[0]:.0f} % ({100 * share[1]:.0f}-{100 * share[2]:.0f}; "
                             f"{fl['samples_per_s']:.1f} of {workers} x {one['samples_per_s']:.1f})",
                    "met": share[0] >= 0.9})
    wd = rows.get("webdataset + DataLoader (read_video's whole-video decode)")
    if wd:
        out.append({"target": "video: vs webdataset's own video decoding (a row)", "value": fmt_ratio(ratio(fl, wd)),
                    "met": None})
    if "worker_rss_mb" in fl:
        out.append({"target": "video: a worker's resident memory, feedline vs DataLoader (a row)",
                    "value": f"{fl['worker_rss_mb']:.0f} vs {dl.get('worker_rss_mb', float('nan')):.0f} MB",
                    "met": None})
    return out


def _peer_targets(rows: dict[str, Any], workload: str, metric: str,
                  least: dict[str, float], ours: str = "feedline (zero-copy)") -> list[dict[str, Any]]:
    """feedline (``ours``) against each peer loader that ran (issues 35, 36): at least ``least[row]`` times its
    rate."""
    out = []
    for row, k in least.items():
        if row in rows and ours in rows:
            r = ratio(rows[ours], rows[row], metric)
            unit = "MB/s" if metric == "mb_per_s" else "samples/s"
            mine = "" if ours == "feedline (zero-copy)" else f"{ours} "
            out.append({"target": f"{workload}: {mine}>= {k:g}x {row} {unit}",
                        "value": fmt_ratio(r), "met": r[0] >= k})
    return out


def _file_targets(rows: dict[str, Any], workload: str, metric: str, least: float) -> list[dict[str, Any]]:
    """feedline on TFRecord and Parquet files against tf.data and HF datasets on the same files (issue 36): at
    least ``least`` times their rate, at <= 10 % of a core in the training process."""
    out = []
    for ours, peer in (("feedline (TFRecord)", "tf.data (TFRecord)"),
                       ("feedline (Parquet)", "HF datasets + DataLoader (Parquet)")):
        out += _peer_targets(rows, workload, metric, {peer: least}, ours)
        if ours in rows and peer in rows:
            out.append({"target": f"{workload}: {ours} main-process CPU <= 10 % of a core", "value": _pct(rows[ours]),
                        "met": rows[ours]["main_cpu_pct"] <= 10})
    return out


def _order_targets(rows: dict[str, Any], workload: str, metric: str) -> list[dict[str, Any]]:
    """Issue 50: the default epoch shuffle (the feedline rows) within 5 % of the order the rows had before it."""
    ours, before, stream = rows["feedline (zero-copy)"], rows.get(SHARD_ORDER), rows.get(STREAM_ORDER)
    if not before:
        return []
    r = ratio(ours, before, metric)
    value = fmt_share(r)
    if stream:
        s = ratio(ours, stream, metric)
        value += f"; vs the stream order {fmt_share(s)}"
    unit = {"mb_per_s": "MB/s", "samples_per_s": "samples/s"}[metric]
    return [{"target": f"{workload}: the default epoch shuffle >= 95 % of the shard order's {unit} "
                       "(the rows before it)", "value": value, "met": r[0] >= 0.95}]


def targets(results: dict[str, Any], workers: int) -> list[dict[str, Any]]:
    """The issue's performance targets, checked against this run's ratios."""
    out = []
    raw = results["workloads"].get("raw")
    if raw:
        zc, cp, dl = raw["feedline (zero-copy)"], raw["feedline (copy)"], raw["DataLoader"]
        r = ratio(zc, dl, "mb_per_s")
        out.append({"target": "raw 1 MiB: >= 5x DataLoader MB/s", "value": fmt_ratio(r, 1), "met": r[0] >= 5})
        out.append({"target": "raw 1 MiB: main-process CPU <= 10 % of a core", "value": _pct(zc),
                    "met": zc["main_cpu_pct"] <= 10})
        r = ratio(cp, zc, "mb_per_s")
        out.append({"target": "raw 1 MiB: copy mode >= 80 % of zero-copy MB/s",
                    "value": fmt_share(r), "met": r[0] >= 0.8})
        out.append({"target": "raw 1 MiB: copy mode main-process CPU <= 15 % of a core", "value": _pct(cp),
                    "met": cp["main_cpu_pct"] <= 15})
        out += _peer_targets(raw, "raw 1 MiB", "mb_per_s", {"Mosaic Streaming + DataLoader": 3.0,
                                                             "LitData StreamingDataLoader": 3.0,
                                                             "DALI CPU pipeline": 1.8})
        out += _file_targets(raw, "raw 1 MiB", "mb_per_s", 3.0)
        out += _order_targets(raw, "raw 1 MiB", "mb_per_s")
    small = results["workloads"].get("small")
    if small:
        out += small_targets(small)
    video = results["workloads"].get("video")
    if video:
        out += _video_targets(video, workers)
    jpeg = results["workloads"].get("jpeg")
    if jpeg:
        fl = jpeg["feedline (zero-copy)"]
        r = ratio(fl, jpeg["DataLoader + stock Pillow"])
        out.append({"target": "JPEG: >= 1.5x DataLoader + stock Pillow samples/s", "value": fmt_ratio(r),
                    "met": r[0] >= 1.5})
        r = ratio(fl, jpeg["DataLoader + pillow-simd"])
        out.append({"target": "JPEG: >= 1.2x DataLoader + pillow-simd samples/s", "value": fmt_ratio(r),
                    "met": r[0] >= 1.2})
        out += _peer_targets(jpeg, "JPEG", "samples_per_s", {"Mosaic Streaming + DataLoader": 1.8,
                                                             "LitData StreamingDataLoader": 1.4,
                                                             "DALI CPU pipeline": 1.5})
        out += _file_targets(jpeg, "JPEG", "samples_per_s", 1.5)
        out += _order_targets(jpeg, "JPEG", "samples_per_s")
        mix = jpeg.get("feedline (two-source mix)")
        if mix:
            r = ratio(mix, fl)
            out.append({"target": "JPEG: a two-source mixture >= 95 % of one source's samples/s (the same data)",
                        "value": fmt_share(r), "met": r[0] >= 0.95})
        pil_core, core = jpeg["1 core, draft"], jpeg.get("1 core, crop decoder", jpeg["1 core, draft"])
        if "1 core, crop decoder" in jpeg:
            r = ratio(core, pil_core)
            out.append({"target": "JPEG: decode + RandomResizedCrop per core, the crop decoder >= 1.4x Pillow's "
                                  "draft decode (the same boxes)", "value": fmt_ratio(r), "met": r[0] >= 1.4})
        share = _share(fl, core, workers)
        out.append({"target": f"JPEG: >= 90 % of {workers} workers x the single-core decode+crop rate",
                    "value": f"{100 * share[0]:.0f} % ({100 * share[1]:.0f}-{100 * share[2]:.0f}; "
                             f"{fl['samples_per_s']:.0f} of {workers} x {core['samples_per_s']:.0f})",
                    "met": share[0] >= 0.9})
        if fl.get("workers_cpu_pct"):  # where the rest goes: the cores the workers had, and their rate on them
            had = fl["workers_cpu_pct"] / 100
            per_cpu = per_cpu_share(fl, core)
            out.append({"target": f"JPEG: where the rest of workers x one core goes ({workers} workers): per "
                                  f"CPU-second a worker decodes >= 95 % of one core's rate alone",
                        "value": f"{fmt_share(per_cpu)}; the workers had {100 * had / workers:.0f} % of {workers} "
                                 f"cores", "met": per_cpu[0] >= 0.95})
    book = results.get("bookkeeping")
    if book:  # issue 68: what a worker spends on a sample beside decoding it, in instructions (callgrind)
        out.append({"target": "JPEG: a worker's per-sample bookkeeping <= 3 % of its instructions a sample (callgrind)",
                    "value": f"{100 * book['bookkeeping_share']:.1f} % ({book['bookkeeping_instructions_a_sample']:,} "
                             f"of {book['worker_instructions_a_sample']:,})",
                    "met": book["bookkeeping_share"] <= 0.03})
    cap = results["workloads"].get("captioned")
    if cap:
        fl, wd = cap["feedline (zero-copy)"], cap["webdataset + DataLoader"]
        out.append({"target": "JPEG + caption + JSON: feedline vs webdataset + DataLoader (a row, no target)",
                    "value": f"{fmt_ratio(ratio(fl, wd))} samples/s; main CPU "
                             f"{fl['main_cpu_pct']:.1f} % vs {wd['main_cpu_pct']:.1f} %", "met": None})
    sc = results.get("scaling")
    if sc:
        shares = _scaling(sc)
        upto = max(1, sc["cpus"] - 2)
        out.append({"target": f"JPEG decode scaling: >= 90 % of workers x the single-core rate up to cores - 2 "
                              f"workers ({upto} here)",
                    "value": "; ".join(f"{w}: {100 * m:.0f} %" for w, (m, _, _) in shares.items()),
                    "met": all(m >= 0.9 for w, (m, _, _) in shares.items() if w <= upto)})
    sb = results.get("sampler")
    if sb:
        f = sb["fill"]
        out.append({"target": f"sampler: fill >= 1 GB/s from loopback HTTP with {f['threads']} fetch threads, "
                              f"and >= curl",
                    "value": f"{f['sampler_gb_per_s']:.2f} GB/s ({f['sampler_gb_per_s'] / f['curl_gb_per_s']:.2f}x "
                             f"curl --parallel-max {f['threads']}: {f['curl_gb_per_s']:.2f} GB/s)",
                    "met": f["sampler_gb_per_s"] >= 1.0 and f["sampler_gb_per_s"] >= f["curl_gb_per_s"]})
        if "ratios" in f:  # the median of per-round ratios: a slow spell of the machine hits one round, one side
            to_urllib = tuple(f["ratios"]["urllib"])
            out.append({"target": f"sampler: fill >= the standard library's plain parallel download (urllib in "
                                  f"{f['threads']} threads), round by round",
                        "value": f"{fmt_ratio(to_urllib)} ({f['urllib_gb_per_s']:.2f} GB/s)",
                        "met": to_urllib[0] >= 1.0})
        if "s3" in sb:
            s3 = sb["s3"]
            out.append({"target": "sampler: fill from a local S3 server vs boto3's own parallel download (a row)",
                        "value": f"{s3['sampler_mb_per_s'] / s3['boto3_mb_per_s']:.2f}x ({s3['sampler_mb_per_s']:.0f} "
                                 f"vs {s3['boto3_mb_per_s']:.0f} MB/s)", "met": None})
        for name, store in (("gcs", "fake-gcs-server"), ("azure", "Azurite")):
            c = sb.get(name)
            if c:
                out.append({"target": f"sampler: fill from {store} (loopback) >= 1.5x {c['sdk']}'s own download, "
                                      f"same objects, as many threads",
                            "value": f"{c['ratio']:.2f}x ({c['sampler_mb_per_s']:.0f} vs {c['sdk_mb_per_s']:.0f} MB/s)",
                            "met": c["ratio"] >= 1.5})
        t = sb["training"]
        share = t.get("ratio", t["filling"]["samples_per_s"] / t["prefilled"]["samples_per_s"])
        spread = (f"; median of {t['rounds']} rounds: " + ", ".join(f"{100 * r:.0f}" for r in t["ratios"]) + " %"
                  if "ratios" in t else "")
        out.append({"target": "training while the sidecar fills: within 10 % of a pre-filled cache",
                    "value": f"{100 * share:.0f} % ({t['filling']['samples_per_s']:.0f} vs "
                             f"{t['prefilled']['samples_per_s']:.0f} samples/s{spread})", "met": share >= 0.9})
    dist = results.get("distributed")
    if dist:
        one, two = dist["1x4"], dist["2x2"]
        out.append({"target": "2 simulated nodes x 2 ranks vs 1 node x 4 ranks, same machine (a row)",
                    "value": f"{two['samples_per_s'] / one['samples_per_s']:.2f}x ({two['samples_per_s']:.0f} vs "
                             f"{one['samples_per_s']:.0f} samples/s)", "met": None})
    e2e = results.get("e2e", {}).get("rows")
    if e2e and results["e2e"]["model"] == "resnet50":
        r = ratio(e2e["feedline"], e2e[CEILING])
        out.append({"target": "e2e: ResNet-50 step fed by feedline within 5 % of synthetic data on the device",
                    "value": f"{fmt_share(r)} of the ceiling, starvation "
                             f"{e2e['feedline'].get('starvation', 0):.2f}", "met": r[0] >= 0.95})
    shuffled = {r["label"]: r for r in results.get("shuffle", {}).get("rows", [])}
    ours, stream = shuffled.get("feedline (default: the epoch, by blocks)"), shuffled.get('feedline shuffle="stream"')
    if ours:
        out.append({"target": "shuffle: a class-sorted dataset's batches >= 95 % of a uniform shuffle's distinct "
                              "classes and Spearman within ±0.05",
                    "value": f"{100 * ours['distinct'] / ours['uniform']:.0f} %, {ours['spearman']:+.2f}",
                    "met": ours["distinct"] >= 0.95 * ours["uniform"] and abs(ours["spearman"]) <= 0.05})
    if ours and stream:
        out.append({"target": "shuffle: the epoch order's samples/s vs the stream order's, 64-byte samples (a row)",
                    "value": f"{ours['samples_per_s'] / stream['samples_per_s']:.2f}x", "met": None})
    if results.get("launch"):
        from .launch_section import launch_targets

        out += launch_targets(results["launch"])
    if results.get("placement"):
        from .placement_section import placement_targets

        out += placement_targets(results["placement"])
    if results.get("remote"):
        from .remote_section import remote_targets

        out += remote_targets(results["remote"])
    cc = results.get("cuda_copy")
    if cc and raw:
        row = raw["feedline (copy)"]
        out.append({"target": "CUDA: H2D GB/s of the loader's copies vs torch's pinned copy bandwidth",
                    "value": f"{row.get('h2d_gb_per_s', 0):.1f} of {cc['pinned_gb_per_s']:.1f} GB/s while copying "
                             f"(delivering {row['mb_per_s'] / 1e3:.1f} GB/s end to end)", "met": None})
    return out


def per_cpu_share(row: dict[str, Any], single: dict[str, Any]) -> tuple[float, float, float]:
    """``row``'s samples per second of its workers' CPU over one core's rate, round by round (``ratio``): each
    round's rate with that round's CPU. Medians taken apart pair a rate of one round with the CPU of another."""
    def per_cpu(r: dict[str, Any]) -> dict[str, float]:
        return {"samples_per_s": r["samples_per_s"] / (r["workers_cpu_pct"] / 100)}

    rounds = row.get("rounds") or []
    rated: dict[str, Any] = per_cpu(row)
    if rounds and all(r.get("workers_cpu_pct") for r in rounds):
        rated["rounds"] = [per_cpu(r) for r in rounds]
    return ratio(rated, single)


def fmt_share(r: tuple[float, float, float]) -> str:
    """``96 % (91-100)``; without a range where there was one round."""
    med, lo, hi = (round(100 * x) for x in r)
    return f"{med} %" + (f" ({lo}-{hi})" if hi > lo else "")


def _share(row: dict[str, Any], single: dict[str, Any], workers: int) -> tuple[float, float, float]:
    """``row``'s samples/s over ``workers`` x one core's rate: the median of per-round ratios, min, max."""
    m, lo, hi = ratio(row, single)
    return m / workers, lo / workers, hi / workers


def _scaling(sc: dict[str, Any]) -> dict[int, tuple[float, float, float]]:
    """Per worker count, its share of workers x one core's rate."""
    single = sc["rows"].get("1 core, crop decoder") or sc["rows"]["1 core, draft"]  # runs before 2026-11-26
    return {w: _share(sc["rows"][f"{w} workers"], single, w) for w in sc["workers"]}
