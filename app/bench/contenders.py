"""One benchmark contender, run in its own process: ``python -m feedline.bench.contenders NAME ...``.

Each contender reads the same shards, delivers batches to a loop that does
nothing else (an infinitely fast GPU step), and prints one JSON line:
samples/s, MB/s of batch payload, the main process's CPU use, and the
training process's CPU a batch that is the loader's: the loop's thread
inside ``next()`` plus every other thread of the process (the budget of
DESIGN.md, "The training process's share"). Running each in a fresh process
lets the DataLoader baseline use stock Pillow (``PYTHONPATH`` points at it)
and keeps the CPU accounting clean.
"""

from __future__ import annotations

import argparse
import faulthandler
import glob
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ..formats.transforms import RandomResizedCrop
from ..loader.settings import SHUFFLES
from . import children, peers
from .pyspy import TIMING
from .samples import Convert, collate_mixed, tar_samples

FAST = ("dali", "spdl")  # fast_peers.py's loaders, run from .venv-fast (imported there only: DALI, SPDL)


class TarShards(torch.utils.data.IterableDataset):
    """A fair hand-written tar dataset: shards split over workers, samples decoded in the worker."""

    def __init__(self, shards: list[str], convert: Callable[[dict[str, Any]], dict[str, Any]]):
        self.shards = shards
        self.convert = convert

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        mine = self.shards if info is None else self.shards[info.id :: info.num_workers]
        for path in mine:
            for s in tar_samples(path):
                yield self.convert(s)


def _kind(workload: str) -> str:
    """The per-sample work of a workload: "small" (3x64x64 samples) is raw bytes, as "raw" (1 MiB) is."""
    return "raw" if workload == "small" else workload


def _dataloader(args: argparse.Namespace, shards: list[str]) -> Iterable[dict[str, Any]]:
    ds = TarShards(shards, Convert(_kind(args.workload), args.image_size, swscale=args.video_swscale))
    return torch.utils.data.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers,
                                       collate_fn=collate_mixed if args.workload == "captioned" else None,
                                       pin_memory=torch.cuda.is_available(), persistent_workers=True,
                                       prefetch_factor=4, multiprocessing_context="spawn")


def _webdataset(args: argparse.Namespace, shards: list[str]) -> Iterable[dict[str, Any]]:
    import webdataset as wds

    convert = Convert(args.workload, args.image_size)
    shuffled = getattr(args, "shuffle", "default") in ("epoch", "stream")  # its documented use: shards, then a buffer
    ds = wds.WebDataset(shards, shardshuffle=100 if shuffled else False, nodesplitter=wds.split_by_node,
                        empty_check=False)
    if shuffled:
        ds = ds.shuffle(1000)
    if args.workload == "video":  # webdataset's own video decoding (torchvision.io.read_video's: every frame)
        from .video_bench import whole_video

        ds = ds.decode(wds.handle_extension("mp4", whole_video))
    elif _kind(args.workload) != "raw":
        ds = ds.decode("pil")
    ds = ds.map(convert).batched(args.batch_size, partial=True)

    return wds.WebLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=torch.cuda.is_available(),
                         persistent_workers=True, prefetch_factor=4, multiprocessing_context="spawn")


def _feedline(args: argparse.Namespace, shards: list[str]) -> Iterable[dict[str, Any]]:
    from ..api.staging_loader import StagingLoader

    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    decode: dict[str, Any] = {}
    if _kind(args.workload) == "raw":
        spec: dict[str, Any] | None = {"bin": ("uint8", (args.sample_bytes,)), "cls": "int64"}
        transform = None
    elif args.workload == "jpeg" and args.device_decode:  # compressed bytes in the ring, decoded on the device
        spec, transform = None, None
        decode = {"device_decode": {"fields": ["jpg"], "size": args.image_size}, "fields": ["jpg", "cls"]}
    elif args.workload == "jpeg":
        spec = {"jpg": ("uint8", (args.image_size, args.image_size, 3)), "cls": "int64"}
        transform = RandomResizedCrop(args.image_size, fields=["jpg"])
    elif args.workload == "video":  # clips decoded in the workers, straight into the ring
        from ..formats.video_clip import VideoClip
        from .video_bench import FRAMES, SIZE, STRIDE

        spec, transform = None, VideoClip(FRAMES, STRIDE, SIZE)
        decode = {"fields": ["mp4", "cls"]}
    else:  # captioned: no spec, as a user would start; txt and json are inferred and travel beside the slot
        spec = None
        transform = RandomResizedCrop(args.image_size, fields=["jpg"])
    source: dict[str, Any] = {"cache": args.cache, "min_shards": args.workers} if args.cache else {"shards": shards}
    if args.mix:  # the same shards as two sources, weighted by their sizes: the mixture's cost, nothing else
        from ..loader.plan.mixture import Source

        halves = [sorted(shards)[0::2], sorted(shards)[1::2]]
        sizes = [sum(os.path.getsize(p) for p in h) for h in halves]
        source = {"sources": [Source(f"half{k}", shards=h, weight=n) for k, (h, n) in enumerate(zip(halves, sizes))]}
    threads = {} if args.transfer_threads is None else {"transfer_threads": args.transfer_threads}
    return StagingLoader(**source, batch_size=args.batch_size, workers=args.workers, h2d=args.h2d,
                         **threads, spec=spec, transform=transform, device=device,
                         zero_copy=args.zero_copy, cpu_placement=args.cpu_placement, **decode,
                         shuffle=SHUFFLES.get(getattr(args, "shuffle", "default"), True))  # default: the epoch


def _peer(name: str) -> Callable[[argparse.Namespace, list[str]], Iterable[dict[str, Any]]]:
    """A peer loader (``peers.py``, run by ``.venv-peers``'s Python): ``--shards`` is its format's directory."""
    def make(args: argparse.Namespace, shards: list[str]) -> Iterable[dict[str, Any]]:
        shuffle = {"shuffle": True} if getattr(args, "shuffle", "default") in ("epoch", "stream") else {}
        return peers.LOADERS[name](args.shards, args.workload, args.image_size, args.batch_size, args.workers,
                                   **shuffle)

    return make


def _fast(args: argparse.Namespace, shards: list[str]) -> Iterable[dict[str, Any]]:
    """DALI's CPU pipeline or SPDL (``fast_peers.py``, run by ``.venv-fast``'s Python), on the tar shards."""
    from . import fast_peers

    return fast_peers.loader(args.loader, shards, args.workload, args.image_size, args.batch_size, args.workers)


def _batch_payload(batch: Any) -> tuple[int, int, list[torch.Tensor]]:
    """(samples, bytes, tensors) of a batch, whatever shape the contender returns."""
    if isinstance(batch, dict):
        tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    elif isinstance(batch, list) and batch and isinstance(batch[0], dict):  # webdataset, batched dicts
        tensors = [torch.stack([s[k] for s in batch]) for k in batch[0] if isinstance(batch[0][k], torch.Tensor)]
        tensors.append(torch.tensor([s["cls"] for s in batch]))
    else:
        raise TypeError(f"unexpected batch type {type(batch).__name__}")
    return int(tensors[0].shape[0]), sum(t.nbytes for t in tensors), tensors


def run(args: argparse.Namespace) -> dict[str, Any]:
    shards = sorted(glob.glob(args.shards))
    makers = {"feedline": _feedline, "dataloader": _dataloader, "webdataset": _webdataset}
    make = makers[args.loader] if args.loader in makers else _fast if args.loader in FAST else _peer(args.loader)
    loader = make(args, shards)
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    samples = nbytes = batches = batches_start = 0
    standin_start = 0.0
    t_start = cpu_start = None
    workers_start: dict[str, float] = {}
    deadline = None
    epochs = 0
    first: dict[str, Any] = {"labels": [], "shapes": set()}  # --report-epoch: what the first epoch delivered
    order: list[list[int]] = []  # --report-order: the first epoch's labels, batch by batch, as delivered
    feed_ns = 0  # the loop thread's CPU getting batches: next(), and the copy to the GPU a baseline makes itself
    thread_start: float | None = None
    paced = 0.0  # --steps-per-s: when the current step ends
    try:
        while True:
            it = iter(loader)
            while True:
                c0 = time.thread_time_ns()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                c1 = time.thread_time_ns()
                n, b, tensors = _batch_payload(batch)
                if args.report_order:
                    order.append([int(x) for x in batch["cls"].tolist()] if isinstance(batch, dict)
                                 else [int(s["cls"]) for s in batch])
                if args.report_epoch and epochs == 0 and isinstance(batch, dict):
                    first["labels"] += batch["cls"].tolist()
                    first["shapes"] |= {(*v.shape[1:], str(v.dtype)) for k, v in batch.items()
                                        if k != "cls" and isinstance(v, torch.Tensor)}
                c2 = time.thread_time_ns()
                if cuda is not None and tensors[0].device.type != "cuda":
                    tensors = [t.to(cuda, non_blocking=True) for t in tensors]
                if t_start is not None:
                    feed_ns += (c1 - c0) + (time.thread_time_ns() - c2)
                if args.steps_per_s:  # a step the loop waits on (a GPU's), paced to the rate: no CPU of its own
                    paced = paced + 1 / args.steps_per_s if paced else time.perf_counter()
                    time.sleep(max(0.0, paced - time.perf_counter()))
                batches += 1
                if batches == args.warmup_batches:  # start the clock once the pipeline is warm
                    if cuda is not None:
                        torch.cuda.synchronize()
                    t_start, cpu_start, thread_start = time.perf_counter(), time.process_time(), time.thread_time()
                    workers_start = children.cpu_seconds()
                    batches_start = batches
                    standin_start = loader.cost().standin_seconds if hasattr(loader, "cost") else 0.0
                    deadline = t_start + args.seconds
                    print(TIMING, file=sys.stderr, flush=True)  # gpu-check's py-spy profile starts here
                elif t_start is not None:
                    samples += n
                    nbytes += b
                    if time.perf_counter() >= deadline and not args.report_order:  # type: ignore[operator]
                        raise StopIteration
            epochs += 1
            if args.report_order:  # one epoch, whole: its order is the result
                raise StopIteration
    except StopIteration:
        pass
    others = (time.process_time() - cpu_start) - (time.thread_time() - thread_start) if thread_start else 0.0
    # the stand-in device's copies (device="standin"): a GPU's copy engine's work, not the training process's
    standin = loader.cost().standin_seconds - standin_start if hasattr(loader, "cost") and thread_start else 0.0
    timed = batches - batches_start if t_start is not None else 0
    if cuda is not None:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t_start if t_start else float("nan")
    cpu = time.process_time() - cpu_start if cpu_start is not None else float("nan")
    extra: dict[str, Any] = {}
    if t_start is not None:  # the workers' CPU over the timed part (those alive at its start and end)
        workers_end = children.cpu_seconds()
        used = sum(workers_end[p] - workers_start[p] for p in workers_end if p in workers_start)
        if used > 0:
            extra["workers_cpu_pct"] = 100.0 * used / wall
    rss = children.rss_mb()
    if rss:  # the largest worker process's resident memory at the end of the timed part
        extra["worker_rss_mb"] = max(rss)
    if hasattr(loader, "stats"):
        st = loader.stats()
        if st.h2d_seconds.sum > 0 and cuda is not None:
            extra["h2d_gb_per_s"] = st.bytes_total["transferred"] / st.h2d_seconds.sum / 1e9
    if hasattr(loader, "close"):
        loader.close()
    if args.loader in peers.PEERS:
        del loader  # its workers end here (persistent_workers), before what they share is cleaned
        peers.close(args.loader)
    import PIL

    if args.report_order:
        extra["order"] = order
    if args.report_epoch:
        extra["first_epoch"] = {"complete": epochs > 0, "labels": sorted(first["labels"]),
                                "shapes": sorted(first["shapes"])}
    extra["versions"] = {"numpy": np.__version__, "torch": torch.__version__}
    if timed:  # the training process's CPU a batch, the loader's: next() (and a baseline's own copy) + other threads
        extra["trainer_ms_per_batch"] = (feed_ns / 1e6 + others * 1e3 - standin * 1e3) / timed
        extra["trainer_next_ms"] = feed_ns / 1e6 / timed
        if standin:
            extra["standin_copy_ms"] = standin * 1e3 / timed
        extra["trainer_threads_ms"] = others * 1e3 / timed
    if args.loader in peers.PEERS:
        extra["versions"][args.loader] = peers.version(args.loader)
    if args.loader in FAST:
        from . import fast_peers

        extra["versions"][args.loader] = fast_peers.version(args.loader)
    return {"loader": args.loader, "workload": args.workload, "samples": samples, "seconds": wall,
            "samples_per_s": samples / wall, "mb_per_s": nbytes / 1e6 / wall, "main_cpu_pct": 100.0 * cpu / wall,
            "epochs": epochs, "pil": PIL.__version__, "zero_copy": bool(args.zero_copy), **extra}


def single_core_rate(args: argparse.Namespace) -> dict[str, Any]:
    """Decode + random-resized-crop rate of one core, in this process, with the PIL on the path: Pillow's
    (``crop``, draft or not) or, with ``--crop-decoder``, the transform as the workers run it (the box's part
    decoded by ``_jpegcrop``). The same seed: every variant crops the same boxes.

    ``--against-draft``: the crop decoder and Pillow's draft decode take turns in short slices, each for
    ``--seconds`` in all, so a slow stretch of a shared machine slows both alike; their ratio is the per-core
    target's (rounds in separate processes ranged 1.16-1.55x around a 1.3-1.45x median here).
    """
    import random

    import PIL
    from PIL import Image

    from ..formats import fastjpeg
    from ..formats.images import decode_image

    blobs = []  # every image of the dataset, as the loaders see them
    for path in sorted(glob.glob(args.shards)):
        blobs.extend(s["jpg"] for s in tar_samples(path))
    rrc = RandomResizedCrop(args.image_size, draft=not args.no_draft, fields=["jpg"])
    if (args.crop_decoder or args.against_draft) and not fastjpeg.available():
        raise SystemExit(f"--crop-decoder: {fastjpeg.status()[1]}")
    # As a worker ends, the pixels go into a batch slot: the crop decoder's row as the worker writes now (one pass,
    # fastjpeg.pack_into), the Pillow rows as it wrote before the crop decoder (np.asarray, then a copy), the
    # per-core rate the crop decoder's target compares with
    slot = np.empty((args.image_size, args.image_size, 3), np.uint8)

    def crop_decoder(b: bytes) -> None:
        img = rrc({"jpg": decode_image(memoryview(b))})["jpg"]
        if not fastjpeg.pack_into(img, slot):
            np.copyto(slot, np.asarray(img))

    def pillow(b: bytes) -> None:
        np.copyto(slot, np.asarray(rrc.crop(Image.open(io.BytesIO(b)))))

    random.seed(0)
    fresh = random.getstate()
    variants = [crop_decoder, pillow] if args.against_draft else [crop_decoder if args.crop_decoder else pillow]
    # each variant's place in the images and its generator: every one crops the same boxes in the same order
    state = {v: (0, fresh) for v in variants}
    done = {v: 0 for v in variants}
    spent = {v: 0.0 for v in variants}
    turn = 0.25 if args.against_draft else args.seconds
    k = 0
    while min(spent.values()) < args.seconds:
        v = variants[k % len(variants)] if (k // len(variants)) % 2 == 0 else variants[::-1][k % len(variants)]
        k += 1
        i, rng = state[v]
        random.setstate(rng)
        n, t0 = 0, time.perf_counter()
        while True:
            v(blobs[i])
            i, n = (i + 1) % len(blobs), n + 1
            if n % 16 == 0 and time.perf_counter() - t0 >= turn:
                break
        spent[v] += time.perf_counter() - t0
        done[v] += n
        state[v] = (i, random.getstate())
    rate = {v: done[v] / spent[v] for v in variants}
    out = {"loader": "single-core", "workload": "jpeg", "samples_per_s": rate[variants[0]], "pil": PIL.__version__,
           "draft": not args.no_draft, "crop_decoder": bool(args.crop_decoder or args.against_draft)}
    if args.against_draft:
        out["draft_samples_per_s"] = rate[pillow]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("loader", choices=("feedline", "dataloader", "webdataset", *peers.PEERS, *FAST, "single-core"))
    p.add_argument("--workload", choices=("raw", "small", "jpeg", "captioned", "video"), required=True)
    p.add_argument("--shards", required=True, help="a glob of shards (tar, TFRecord or Parquet files; a peer: its format's directory)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--transfer-threads", type=int, default=None, help="feedline: (default: the loader's)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "standin"), default="auto",
                   help="feedline: auto is cuda where there is one; standin runs the device path on the CPU")
    p.add_argument("--h2d", choices=("slot", "fields"), default="slot", help="feedline: how batches go to the device")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--sample-bytes", type=int, default=1 << 20)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup-batches", type=int, default=4)
    p.add_argument("--steps-per-s", type=float, default=0.0,
                   help="pace the loop to this many steps a second, each step a sleep (a GPU step's wait: no CPU); "
                        "0: no step")
    p.add_argument("--zero-copy", action="store_true")
    p.add_argument("--no-draft", action="store_true")
    p.add_argument("--crop-decoder", action="store_true", help="single-core: the transform's crop decoder")
    p.add_argument("--against-draft", action="store_true",
                   help="single-core: the crop decoder and Pillow's draft decode in turns, both rates")
    p.add_argument("--device-decode", action="store_true", help="feedline, jpeg: decode where the batch lands")
    p.add_argument("--cpu-placement", default="auto",
                   help="feedline: auto (the default: a loader whose batches stay on the CPU is not placed; the "
                        "stand-in and CUDA device paths are), off, or trainer=...;workers=...")
    p.add_argument("--video-swscale", action="store_true",
                   help="dataloader, video: each frame scaled and converted in one swscale pass (SwscaleClip)")
    p.add_argument("--cache", default="", help="feedline: read a sampler's cache instead of --shards")
    p.add_argument("--mix", action="store_true", help="feedline: the shards as a two-source mixture")
    p.add_argument("--shuffle", choices=("default", "none", "epoch", "stream"), default="default",
                   help="feedline: the sample order (default: the loader's, the epoch shuffle; none: shard by shard); "
                        "webdataset, Mosaic, LitData: epoch or stream turns their own shuffle on (default: off)")
    p.add_argument("--report-order", action="store_true",
                   help="read one whole epoch and add its labels, batch by batch as delivered (shuffle quality)")
    p.add_argument("--report-epoch", action="store_true",
                   help="add the first epoch's labels and sample shapes to the result (a check that it is whole)")
    args = p.parse_args(argv)
    faulthandler.enable()  # a row that dies by a signal names where, in the stderr the bench reports
    torch.set_num_threads(1)
    if args.loader == "single-core" and args.workload == "video":
        from .video_bench import single_core

        result: dict[str, Any] = single_core(sorted(glob.glob(args.shards)), args.seconds)
    else:
        result = single_core_rate(args) if args.loader == "single-core" else run(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
