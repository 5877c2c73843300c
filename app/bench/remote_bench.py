"""One row of the ``remote`` section (issue 70), in its own process on the "GPU node"'s CPU set:
``python -m feedline.bench.remote_bench ROW --shards GLOB --address HOST:PORT --seconds T``.

Rows: ``local`` (feedline, one worker here), ``remote`` (feedline, that worker plus one place decoded by an actor
on the Ray node), ``auto`` (feedline, ``workers="auto"`` with the cluster: the local place first, the cluster's
as the loop's wait asks; timed once the tuning is done), ``raydata`` (Ray Data's own ingest of the same tar shards: read_webdataset, map_batches decode
and crop, iter_torch_batches; run from ``.venv-raydata``, whose cluster it joins). Each delivers batches to a
loop that does nothing else, after a warm-up (the actors' start, the first batches), and prints one JSON line:
samples/s reaching the loop, and the training process's CPU a batch (every thread of this process: what the
loader costs the process that launches the kernels).
"""

from __future__ import annotations

import argparse
import glob
import json
import time
from collections.abc import Iterator
from typing import Any


def _feedline(args: argparse.Namespace, remote: str | None, workers: int | str) -> tuple[Iterator[Any], Any]:
    from ..api.staging_loader import StagingLoader
    from ..formats.transforms import RandomResizedCrop

    loader = StagingLoader(sorted(glob.glob(args.shards)), batch_size=args.batch_size,
                           workers=workers, spec={"jpg": ("uint8", (args.image_size,) * 2 + (3,)),
                                                             "cls": "int64"},
                           transform=RandomResizedCrop(args.image_size, fields=["jpg"]), cpu_placement="off",
                           remote=remote)

    def endless() -> Iterator[Any]:
        while True:
            yield from loader

    return endless(), loader


def _raydata(args: argparse.Namespace) -> tuple[Iterator[Any], Any]:
    """Ray Data as its docs write an image ingest: the shards read by its WebDataset reader, each batch decoded
    and cropped in map_batches (Pillow, the crop the DataLoader baseline uses), handed over as torch batches."""
    import numpy as np
    import ray

    from .samples import Convert

    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    convert = Convert("jpeg", args.image_size)

    def decode(batch: dict[str, Any]) -> dict[str, Any]:
        out = [convert({"jpg": bytes(j), "cls": bytes(c)}) for j, c in zip(batch["jpg"], batch["cls"])]
        return {"jpg": np.stack([o["jpg"].numpy() for o in out]), "cls": np.array([o["cls"] for o in out], np.int64)}

    paths = sorted(glob.glob(args.shards))
    ds = ray.data.read_webdataset(paths, decoder=None).map_batches(decode, batch_size=args.batch_size)

    def endless() -> Iterator[Any]:
        while True:
            yield from ds.iter_torch_batches(batch_size=args.batch_size, drop_last=False)

    return endless(), None


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.row == "raydata":
        batches, loader = _raydata(args)
    else:
        remote = {"local": None, "remote": f"{args.address},places=1", "auto": args.address}[args.row]
        batches, loader = _feedline(args, remote, {"local": 1, "remote": 2, "auto": "auto"}[args.row])
    try:
        for _ in range(args.warmup_batches):
            next(batches)
        if args.row == "auto":  # the first epoch's tuning, until it reached the most and the actor of a place it
            deadline = time.perf_counter() + 60  # grew decodes (a place decodes here until its actor is up)
            while loader.workers < loader.most_workers and time.perf_counter() < deadline:
                next(batches)
            remote = loader.stats().batches_decoded_total["remote"]
            while loader.stats().batches_decoded_total["remote"] < remote + 4 and time.perf_counter() < deadline:
                next(batches)
        samples = n = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            b = next(batches)
            samples += len(b["cls"])
            n += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        out: dict[str, Any] = {"row": args.row, "samples_per_s": samples / wall, "batches": n,
                               "cpu_ms_per_batch": cpu * 1e3 / max(1, n), "main_cpu_pct": 100 * cpu / wall}
        if loader is not None:
            out["workers"] = loader.workers
            st = loader.stats()
            out["batches_by_place"] = dict(st.batches_decoded_total)
            sent, received = st.remote_bytes_total["sent"], st.remote_bytes_total["received"]
            remote_samples = max(1, st.batches_decoded_total["remote"] * args.batch_size)
            if st.batches_decoded_total["remote"]:
                out["bytes_per_sample"] = {"sent": sent / remote_samples, "received": received / remote_samples}
        return out
    finally:
        if loader is not None:
            loader.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m feedline.bench.remote_bench")
    p.add_argument("row", choices=("local", "remote", "auto", "raydata"))
    p.add_argument("--shards", required=True)
    p.add_argument("--address", default="")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--warmup-batches", type=int, default=8)
    print(json.dumps(run(p.parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
