"""The benchmark's report: the issues' performance targets checked against one run's ratios, and
``docs/benchmarks.md`` rendered from ``docs/benchmarks.json`` (every host's latest run)."""

from __future__ import annotations

from typing import Any

from .rounds import fmt_ratio, ratio
from .targets import CEILING, SHARD_ORDER, STREAM_ORDER, _pct, _scaling, targets

__all__ = ["CEILING", "SHARD_ORDER", "STREAM_ORDER", "render_markdown", "targets"]


def _cores_busy(store: str, c: dict[str, Any]) -> str:
    """What the emulator and the whole machine used during each client's runs: on a machine of few cores the
    emulator shares them with the client, which bounds any client's rate."""
    if "server_cores" not in c:
        return ""
    server, machine = c["server_cores"], c["machine_cores"]
    return (f" Cores busy (of {c['cores']}), sidecar vs {c['sdk']}: {store} {server['sampler']:.2f} vs "
            f"{server['sdk']:.2f}, the whole machine {machine['sampler']:.2f} vs {machine['sdk']:.2f}.")


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

FAST_NOTE_ROWS = ("DALI CPU pipeline", "SPDL pipeline")
FAST_NOTE = ("DALI and SPDL (issue 63) read the same tar shards with as many threads as the feedline rows have "
             "workers, from `.venv-fast` (`scripts/setup-fast-peers`: nvidia-dali-cuda130 2.4.0, spdl 0.8.0; "
             "`app/bench/fast_peers.py`). DALI: a CPU-only pipeline (`device_id=None`): `fn.readers.webdataset` with "
             "its shuffle buffer, and for JPEG its fused crop decode `fn.decoders.image_random_crop` (the same area "
             "and aspect ranges; only the box decoded) then `fn.resize` with antialiasing, out through "
             "`DALIGenericIterator` as torch tensors (the `.cls` text padded in the pipeline, read as a number in the "
             "iterator: DALI has no operator that parses text). SPDL: its `PipelineBuilder` in threads: shards split "
             "into samples by `spdl.io.iter_tarfile`, each sample converted in its thread pool (JPEG: FFmpeg decodes "
             "the image and a crop-and-scale filter cuts the same random box to 224x224), `aggregate` into batches, "
             "stacked.")

SMALL_NOTE = ("The last column is the training process's CPU a batch that is the loader's: the loop's thread inside "
              "`next()` (and, for a baseline on a GPU host, its own copy to the device) plus every other thread of "
              "the process, over the timed part (DESIGN.md, \"The training process's share\"). The stand-in rows run "
              "the CUDA path's code on this CPU against a stand-in device (`device=\"standin\"`): its calls are counted "
              "as CUDA's are, and its copies, host memcpys a GPU's copy engine would do, are timed apart and left "
              "out of the figure (`standin_copy_ms` in docs/benchmarks.json).")
VIDEO_NOTE = ("Every row makes the same clips with the same library (PyAV): feedline's workers with `VideoClip` (seek "
              "to the keyframe before the window, frames nothing refers to skipped before it and, stride 2, inside it "
              "unless the clip takes them, each frame taken scaled and converted in one swscale pass, written into the "
              "ring); the DataLoader row's `__getitem__` as PyAV's documentation writes it (seek, decode forward, each "
              "frame a full RGB array, cut and resized with Pillow); the swscale DataLoader row's as a user who knows "
              "PyAV writes it (seek, decode forward, each frame the clip takes scaled and converted in one swscale "
              "pass, `to_ndarray(width=, height=, format=\"rgb24\")`, then cut: the per-frame work of `VideoClip`); the "
              "webdataset row with webdataset's own video decoding, `torchvision.io.read_video` (every "
              "frame of the video, RGB), written out as its PyAV path because torchvision does not import beside this "
              "CPU build of torch. \"1 core\" is `VideoClip` alone in one process.")
SINGLE_CORE_NOTE = ("The two \"1 core\" rows, draft and crop decoder, are one process a round: decode + "
                    "RandomResizedCrop + the write into a batch slot, in this process, the two paths taking turns "
                    "of 0.25 s over the same photos and boxes (the crop decoder's target is the median of the "
                    "rounds' ratios). Pillow's draft path can run at one of two speeds in a process, its rounds then "
                    "in two clusters (see docs/benchmarking.md); the crop decoder's do not.")


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
                     "small": "Small 3x64x64 samples (12 KiB): the training process's CPU a batch",
                     "video": "Video: 4 s H.264 240p clips, 16 frames 2 apart, one random-resized crop a clip, 112x112 "
                              "(samples are clips)",
                     "jpeg": "JPEG ~500x375 photos, decode + random-resized-crop to 224x224",
                     "captioned": "JPEG + .txt caption + .json metadata (an image-text dataset), pillow-simd "
                                  "everywhere; captions and metadata arrive as lists"}[workload]
            base_key = {"raw": "DataLoader", "small": "DataLoader", "video": "DataLoader (PyAV in __getitem__)",
                        "jpeg": "DataLoader + stock Pillow",
                        "captioned": "webdataset + DataLoader"}[workload]
            lines += [f"### {title}", "", f"| contender | PIL | samples/s (range) | MB/s | main CPU % (range) | "
                                          f"ratio to {base_key} (range) | training process CPU a batch |",
                      "|---|---|---:|---:|---:|---:|---:|"]
            for name, row in rows.items():
                lo, hi = row.get("range", {}).get("samples_per_s", (row["samples_per_s"],) * 2)
                rate = f"{row['samples_per_s']:.0f}" + (f" ({lo:.0f}-{hi:.0f})" if hi > lo else "")
                mb = f"{row['mb_per_s']:.0f}" if "mb_per_s" in row else "—"
                cpu = _pct(row).replace(" %", "") if "main_cpu_pct" in row else "—"
                rel = fmt_ratio(ratio(row, rows[base_key])) if "mb_per_s" in row else "—"
                share = f"{row['trainer_ms_per_batch']:.3f} ms" if "trainer_ms_per_batch" in row else "—"
                lines.append(f"| {name} | {row['pil']} | {rate} | {mb} | {cpu} | {rel} | {share} |")
            lines.append("")
            if any(name in rows for name in PEER_NOTE_ROWS):
                lines += [PEER_NOTE, ""]
            if SHARD_ORDER in rows:
                lines += [ORDER_NOTE, ""]
            if any(name in rows for name in FILES_NOTE_ROWS):
                lines += [FILES_NOTE, ""]
            if any(name in rows for name in FAST_NOTE_ROWS):
                lines += [FAST_NOTE, ""]
            if rows.get("1 core, crop decoder", {}).get("turns"):
                lines += [SINGLE_CORE_NOTE, ""]
            if workload == "small":
                lines += [SMALL_NOTE, ""]
            if workload == "video":
                rss = ", ".join(f"{name} {row['worker_rss_mb']:.0f} MB" for name, row in rows.items()
                                if "worker_rss_mb" in row)
                lines += [VIDEO_NOTE + (f" The largest worker's resident memory at the end of the timed part: {rss}."
                                        if rss else ""), ""]
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
                         f"{f['reps']} interleaved runs)" if "urllib_gb_per_s" in f else "") + "."
                      + (f" Round by round, the sidecar against curl: {fmt_ratio(tuple(f['ratios']['curl']))}; "
                         f"against urllib: {fmt_ratio(tuple(f['ratios']['urllib']))}." if "ratios" in f else ""), ""]
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
        if r.get("launch"):
            from .launch_section import markdown_lines as launch_lines

            lines += launch_lines(r["launch"])
        if r.get("placement"):
            from .placement_section import markdown_lines as placement_lines

            lines += placement_lines(r["placement"])
        if r.get("remote"):
            from .remote_section import markdown_lines as remote_lines

            lines += remote_lines(r["remote"])
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


