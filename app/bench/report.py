"""The benchmark's report: the issues' performance targets checked against one run's ratios, and
``docs/benchmarks.md`` rendered from ``docs/benchmarks.json`` (every host's latest run)."""

from __future__ import annotations

from typing import Any

from .rounds import fmt_ratio, ratio


def _cores_busy(store: str, c: dict[str, Any]) -> str:
    """What the emulator and the whole machine used during each client's runs: on a machine of few cores the
    emulator shares them with the client, which bounds any client's rate."""
    if "server_cores" not in c:
        return ""
    server, machine = c["server_cores"], c["machine_cores"]
    return (f" Cores busy (of {c['cores']}), sidecar vs {c['sdk']}: {store} {server['sampler']:.2f} vs "
            f"{server['sdk']:.2f}, the whole machine {machine['sampler']:.2f} vs {machine['sdk']:.2f}.")


def _pct(row: dict[str, Any], metric: str = "main_cpu_pct") -> str:
    """``12.5 %`` with the rounds' range where there were several."""
    lo, hi = row.get("range", {}).get(metric, (row[metric], row[metric]))
    return f"{row[metric]:.1f} %" + (f" ({lo:.1f}-{hi:.1f})" if hi > lo else "")


CEILING = "synthetic, on the device (the ceiling)"  # the e2e row the others are compared with
SHARD_ORDER = "feedline (zero-copy, shard order: before the epoch shuffle)"  # issue 50's "today's" rows
STREAM_ORDER = 'feedline (zero-copy, shuffle="stream")'


PEER_NOTE_ROWS = ("Mosaic Streaming + DataLoader", "LitData StreamingDataLoader")
PEER_NOTE = ("Mosaic Streaming (mosaicml-streaming 0.13.0: `MDSWriter`, then its `StreamingDataset` in a torch "
             "`DataLoader`) and LitData (0.2.76: `optimize`, then its `StreamingDataset` in its `StreamingDataLoader`) "
             "read the same samples, written once in their own formats from the same tar shards and copied to "
             "/dev/shm beside them; they do the DataLoader rows' per-sample work (raw: the bytes into a tensor; JPEG: "
             "a full decode and the same random-resized-crop code, with pillow-simd) in their workers, and run "
             "from `.venv-peers` (`scripts/setup-peers`: their pins, numpy < 2.2 and torchvision, stay out of "
             "`.venv`).")

ORDER_NOTE = ("Every feedline row reads in the loader's default order, the epoch shuffle (issue 50: each worker draws "
              "its samples at random across blocks of 256 shards, read from their mappings); \"shard order\" is how "
              "they read before it (each worker's shards one after another, in written order), and "
              "`shuffle=\"stream\"` the older default (shards in turn through a 1000-sample buffer). The other "
              "loaders' rows read in their written order, as they did before.")
FILES_NOTE_ROWS = ("tf.data (TFRecord)", "HF datasets + DataLoader (Parquet)")
FILES_NOTE = ("TFRecord and Parquet (issue 36): the same samples, one file per tar shard, written by TensorFlow's "
              "own `TFRecordWriter` (tensorflow-cpu 2.21.0; Examples of the payload's bytes and the label) and by "
              "Hugging Face `datasets` 5.0.1 (`to_parquet`; JPEGs as an `Image` column). \"feedline (TFRecord)\" and "
              "\"feedline (Parquet)\" read those files as they are, with the zero-copy row's settings. tf.data: "
              "`TFRecordDataset` + `parse_single_example`, and for JPEG the pipeline its ImageNet guides write: a box "
              "from `sample_distorted_bounding_box` (RandomResizedCrop's area and aspect ranges), only that box "
              "decoded (`decode_and_crop_jpeg`, TensorFlow's fused crop decoder), resized with antialiasing; "
              "`map` and `prefetch` with `AUTOTUNE` on a private pool of as many threads as the other rows' "
              "workers, in the training process (tf.data has no worker processes, so its main CPU is all its "
              "work); batches handed to torch without a copy. HF datasets: `load_dataset(\"parquet\")` (its one-time "
              "conversion into its Arrow cache is not timed), `set_transform` with the DataLoader rows' per-sample "
              "work, in a torch `DataLoader`.")

SINGLE_CORE_NOTE = ("The two \"1 core\" rows, draft and crop decoder, are one process a round: decode + "
                    "RandomResizedCrop + the write into a batch slot, in this process, the two paths taking turns "
                    "of 0.25 s over the same photos and boxes (the crop decoder's target is the median of the "
                    "rounds' ratios). Pillow's draft path can run at one of two speeds in a process, its rounds then "
                    "in two clusters (see docs/benchmarking.md); the crop decoder's do not.")


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
    value = f"{100 * r[0]:.0f} % ({100 * r[1]:.0f}-{100 * r[2]:.0f})"
    if stream:
        s = ratio(ours, stream, metric)
        value += f"; vs the stream order {100 * s[0]:.0f} % ({100 * s[1]:.0f}-{100 * s[2]:.0f})"
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
                    "value": f"{100 * r[0]:.0f} % ({100 * r[1]:.0f}-{100 * r[2]:.0f})", "met": r[0] >= 0.8})
        out.append({"target": "raw 1 MiB: copy mode main-process CPU <= 15 % of a core", "value": _pct(cp),
                    "met": cp["main_cpu_pct"] <= 15})
        out += _peer_targets(raw, "raw 1 MiB", "mb_per_s", {"Mosaic Streaming + DataLoader": 3.0,
                                                             "LitData StreamingDataLoader": 3.0})
        out += _file_targets(raw, "raw 1 MiB", "mb_per_s", 3.0)
        out += _order_targets(raw, "raw 1 MiB", "mb_per_s")
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
                                                             "LitData StreamingDataLoader": 1.4})
        out += _file_targets(jpeg, "JPEG", "samples_per_s", 1.5)
        out += _order_targets(jpeg, "JPEG", "samples_per_s")
        mix = jpeg.get("feedline (two-source mix)")
        if mix:
            r = ratio(mix, fl)
            out.append({"target": "JPEG: a two-source mixture >= 95 % of one source's samples/s (the same data)",
                        "value": f"{100 * r[0]:.0f} % ({100 * r[1]:.0f}-{100 * r[2]:.0f})", "met": r[0] >= 0.95})
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
        if "urllib_gb_per_s" in f:
            out.append({"target": "sampler: fill vs the standard library's plain parallel download (urllib, a row)",
                        "value": f"{f['sampler_gb_per_s'] / f['urllib_gb_per_s']:.2f}x "
                                 f"({f['urllib_gb_per_s']:.2f} GB/s)", "met": None})
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
                    "value": f"{100 * r[0]:.0f} % ({100 * r[1]:.0f}-{100 * r[2]:.0f}) of the ceiling, starvation "
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
    cc = results.get("cuda_copy")
    if cc and raw:
        row = raw["feedline (copy)"]
        out.append({"target": "CUDA: H2D GB/s of the loader's copies vs torch's pinned copy bandwidth",
                    "value": f"{row.get('h2d_gb_per_s', 0):.1f} of {cc['pinned_gb_per_s']:.1f} GB/s while copying "
                             f"(delivering {row['mb_per_s'] / 1e3:.1f} GB/s end to end)", "met": None})
    return out


def _share(row: dict[str, Any], single: dict[str, Any], workers: int) -> tuple[float, float, float]:
    """``row``'s samples/s over ``workers`` x one core's rate: the median of per-round ratios, min, max."""
    m, lo, hi = ratio(row, single)
    return m / workers, lo / workers, hi / workers


def _scaling(sc: dict[str, Any]) -> dict[int, tuple[float, float, float]]:
    """Per worker count, its share of workers x one core's rate."""
    single = sc["rows"].get("1 core, crop decoder") or sc["rows"]["1 core, draft"]  # runs before 2026-11-26
    return {w: _share(sc["rows"][f"{w} workers"], single, w) for w in sc["workers"]}


def _e2e_lines(e2e: dict[str, Any] | None, gpu: bool) -> list[str]:
    if not e2e:
        return []
    if "rows" not in e2e:
        return [f"End to end (a ResNet-50 training step): skipped here, {e2e['skipped']}.", ""]
    rows, how = e2e["rows"], ("bf16, channels-last" if gpu else "float32 on the CPU: a check of the path, not a "
                                                                 "measurement")
    lines = [f"### End to end: a {e2e['model']} training step, batch {e2e['batch_size']} ({how})", "",
             "| fed by | images/s (range) | of the ceiling (range) | starvation | main CPU % |",
             "|---|---:|---:|---:|---:|"]
    for name, row in rows.items():
        lo, hi = row.get("range", {}).get("samples_per_s", (row["samples_per_s"],) * 2)
        share = ratio(row, rows[CEILING])
        lines.append(f"| {name} | {row['samples_per_s']:.0f} ({lo:.0f}-{hi:.0f}) | {100 * share[0]:.0f} % "
                     f"({100 * share[1]:.0f}-{100 * share[2]:.0f}) | {row.get('starvation', 0):.2f} | "
                     f"{row['main_cpu_pct']:.1f} |")
    return lines + ["", "Starvation: the share of the wall time the loop waited in `next()` for its batch.", ""]


def render_markdown(doc: dict[str, Any]) -> str:
    lines = ["# Benchmarks", "",
             "Written by `./scripts/bench` (`feedline bench`): every contender reads the same tar shards from",
             "`/dev/shm` in one run, each in its own process, and hands batches to a loop that does nothing",
             "else (an infinitely fast training step). Samples/s and MB/s count batch payload delivered to",
             "that loop after a short warm-up; *main CPU* is the main process's CPU time (all its threads) per",
             "wall second. Each contender runs once to warm up (discarded), then in R rounds; within a round",
             "every contender runs once, in an order rotated each round. A figure is the median of the rounds",
             "with their range in brackets; a ratio is the median of the per-round ratios (both sides measured",
             "in the same round) with their range. Machines here are noisy: compare ratios within a run.", ""]
    for host, r in sorted(doc.items()):
        m = r["machine"]
        lines += [f"## {host}", "",
                  f"{r['when']}; {m['cpus']} CPUs, Python {m['python']}, torch {m['torch']}, PIL {m['pil']}"
                  + (f", GPU {m['gpu']}" if "gpu" in m else "")
                  + f"; {r['settings']['workers']} workers, batch {r['settings']['batch_size']}, "
                    f"{r['settings']['seconds']:g} s per contender"
                  + (f" and round, {r['settings']['rounds']} rounds" if "rounds" in r["settings"] else "")
                  + (" (--quick: a check that everything runs, not a measurement)" if r["settings"].get("quick")
                     else "") + ".", ""]
        earlier = {name: when for name, when in r.get("ran", {}).items() if when != r["when"]}
        if earlier:
            lines += ["Kept from earlier runs with the same settings (a later run measured only some workloads): "
                      + ", ".join(f"{name} ({when})" for name, when in earlier.items()) + ".", ""]
        if not m["pil"].endswith(".post0"):
            lines += [f"pillow-simd was not installed on this machine: every row ran with stock Pillow {m['pil']} "
                      f"(see the PIL column), so rows named after pillow-simd are stock too, and the JPEG rows "
                      f"compare the pipeline and draft mode, not the SIMD decoder.", ""]
        if "gpu" in m:
            lines += ["With CUDA the loader's batches are device tensors (zero-copy only changes CPU hosts), and "
                      "the baselines' batches are moved with `.to('cuda', non_blocking=True)` from pinned memory.",
                      ""]
        for workload, rows in r["workloads"].items():
            title = {"raw": "Raw 1 MiB incompressible samples",
                     "jpeg": "JPEG ~500x375 photos, decode + random-resized-crop to 224x224",
                     "captioned": "JPEG + .txt caption + .json metadata (an image-text dataset), pillow-simd "
                                  "everywhere; captions and metadata arrive as lists"}[workload]
            base_key = {"raw": "DataLoader", "jpeg": "DataLoader + stock Pillow",
                        "captioned": "webdataset + DataLoader"}[workload]
            lines += [f"### {title}", "", f"| contender | PIL | samples/s (range) | MB/s | main CPU % (range) | "
                                          f"ratio to {base_key} (range) |",
                      "|---|---|---:|---:|---:|---:|"]
            for name, row in rows.items():
                lo, hi = row.get("range", {}).get("samples_per_s", (row["samples_per_s"],) * 2)
                rate = f"{row['samples_per_s']:.0f}" + (f" ({lo:.0f}-{hi:.0f})" if hi > lo else "")
                mb = f"{row['mb_per_s']:.0f}" if "mb_per_s" in row else "—"
                cpu = _pct(row).replace(" %", "") if "main_cpu_pct" in row else "—"
                rel = fmt_ratio(ratio(row, rows[base_key])) if "mb_per_s" in row else "—"
                lines.append(f"| {name} | {row['pil']} | {rate} | {mb} | {cpu} | {rel} |")
            lines.append("")
            if any(name in rows for name in PEER_NOTE_ROWS):
                lines += [PEER_NOTE, ""]
            if SHARD_ORDER in rows:
                lines += [ORDER_NOTE, ""]
            if any(name in rows for name in FILES_NOTE_ROWS):
                lines += [FILES_NOTE, ""]
            if rows.get("1 core, crop decoder", {}).get("turns"):
                lines += [SINGLE_CORE_NOTE, ""]
        if r.get("scaling"):
            sc = r["scaling"]
            lines += [f"### JPEG decode scaling ({sc['cpus']} CPUs)", "",
                      "| workers | samples/s (range) | % of workers x one core's rate (range) |", "|---:|---:|---:|"]
            for w, (m, lo, hi) in _scaling(sc).items():
                row = sc["rows"][f"{w} workers"]
                a, b = row.get("range", {}).get("samples_per_s", (row["samples_per_s"],) * 2)
                lines.append(f"| {w} | {row['samples_per_s']:.0f} ({a:.0f}-{b:.0f}) | {100 * m:.0f} % "
                             f"({100 * lo:.0f}-{100 * hi:.0f}) |")
            decoder = "1 core, crop decoder" in sc["rows"]
            one = sc["rows"]["1 core, crop decoder" if decoder else "1 core, draft"]
            how = "the transform's crop decoder, as the workers run it" if decoder else "pillow-simd, draft mode"
            lines += ["", f"One core's decode+crop rate ({how}): {one['samples_per_s']:.0f} samples/s "
                          f"(median of the rounds). Counts: 1, 2, 4, 8 and cores - 2, as far as this machine has CPUs.",
                      ""]
        if r.get("sampler"):
            f, t = r["sampler"]["fill"], r["sampler"]["training"]
            lines += ["### Sampler sidecar", "",
                      f"Fill: {f['shards']} raw shards ({f['bytes'] / 1e9:.2f} GB) from `feedline serve` on 127.0.0.1 "
                      f"(serving from /dev/shm) into an empty cache in /dev/shm with {f['threads']} fetch threads: "
                      f"**{f['sampler_gb_per_s']:.2f} GB/s**; `curl --parallel --parallel-max {f['threads']}` of "
                      f"the same files into /dev/shm: {f['curl_gb_per_s']:.2f} GB/s"
                      + (f"; urllib in {f['threads']} threads: {f['urllib_gb_per_s']:.2f} GB/s (medians of "
                         f"{f['reps']} interleaved runs)" if "urllib_gb_per_s" in f else "") + ".", ""]
            if "s3" in r["sampler"]:
                s3 = r["sampler"]["s3"]
                lines += [f"S3: {s3['shards']} raw shards ({s3['bytes'] / 1e6:.0f} MB) from a local S3 server (moto "
                          f"in server mode) with {s3['threads']} fetch threads: **{s3['sampler_mb_per_s']:.0f} MB/s**; "
                          f"boto3's `download_file` of the same keys in {s3['threads']} threads: "
                          f"{s3['boto3_mb_per_s']:.0f} MB/s (medians of {s3['reps']}; the server, one Python "
                          f"process, is the bottleneck of both).", ""]
            for name, store in (("gcs", "fake-gcs-server"), ("azure", "Azurite")):
                c = r["sampler"].get(name)
                if c:
                    lines += [f"{store}: {c['shards']} raw shards ({c['bytes'] / 1e6:.0f} MB) on 127.0.0.1 with "
                              f"{c['threads']} fetch threads: **{c['sampler_mb_per_s']:.0f} MB/s**; {c['sdk']} "
                              f"downloading the same objects with its defaults in {c['threads']} threads: "
                              f"{c['sdk_mb_per_s']:.0f} MB/s (medians of {c['reps']} interleaved runs after a "
                              f"warm-up).{_cores_busy(store, c)}", ""]
            lines += [
                      f"Training (JPEG workload, zero-copy) from a pre-filled cache: "
                      f"{t['prefilled']['samples_per_s']:.0f} samples/s; from an empty cache the sidecar fills "
                      f"during the run at {t['fill_mb_per_s']:.0f} MB/s ({t['shards_cached_at_end']} of "
                      f"{t['shards']} shards cached at the end): {t['filling']['samples_per_s']:.0f} samples/s"
                      + (f" (the median of {t['rounds']} interleaved pairs)." if "rounds" in t else "."), ""]
        if r.get("distributed"):
            lines += ["### Distributed (torchrun, DDP over gloo, `scripts/two-nodes`)", "",
                      "| shape | samples/s | steps per rank | parameters identical |", "|---|---:|---|---|"]
            for row in r["distributed"].values():
                lines.append(f"| {row['nodes']} node(s) x {row['ranks_per_node']} ranks | {row['samples_per_s']:.0f} | "
                             f"{row['steps_per_rank']} | {'yes' if row['identical_parameters'] else '**no**'} |")
            lines += ["", "The demo model on the JPEG workload, 1 decode worker a rank, epochs after the first; "
                          "two nodes each run their own sampler over their own partition of the store.", ""]
        lines += _e2e_lines(r.get("e2e"), "gpu" in r["machine"])
        if r.get("shuffle"):
            from .shuffle_section import markdown_lines

            lines += markdown_lines(r["shuffle"])
        if r.get("cuda_copy"):
            cc = r["cuda_copy"]
            lines += [f"torch's own host-to-device copy here: pinned {cc['pinned_gb_per_s']:.1f} GB/s, "
                      f"pageable {cc['pageable_gb_per_s']:.1f} GB/s.", ""]
        lines += ["### Targets", "", "| target | this run | met |", "|---|---|---|"]
        for t in r["targets"]:
            met = "—" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {t['value']} | {met} |")
        lines.append("")
        if r.get("gpu_check"):  # scripts/gpu-check's record on this host, kept beside the bench's own run
            from .gpu_results import markdown as gpu_check_markdown

            g = r["gpu_check"]
            lines += [f"### The CUDA path's check (`scripts/gpu-check`), {g['when']}", "",
                      *[x for note in g.get("notes", []) for x in (note, "")],
                      gpu_check_markdown(g).split("\n", 2)[2]]
    return "\n".join(lines)


