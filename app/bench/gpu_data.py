"""``scripts/gpu-check``'s datasets: the raw workload's 1 MiB samples and the JPEG workload's photo crops,
made on the lent machine (nothing travels but the code and the wheels) and copied to ``/dev/shm``."""

from __future__ import annotations

import os
import shutil
import sys


def datasets(raw_samples: int, jpeg_samples: int, e2e_workers_x_batch: int, cache_dir: str) -> dict[str, str]:
    """The raw and JPEG shards on local disk, made once (the JPEG photos come from the carried scikit-image
    wheel: the machine reaches no registry); ``e2e_workers_x_batch``: the e2e section's workers x batch size."""
    from .contend import _dataset

    raw = _dataset("raw", raw_samples, 1 << 20, cache_dir)
    # DataLoader's e2e workers each batch their own shards and drop the partial batch: three batches a worker
    jpeg = _jpeg_dataset(max(jpeg_samples, 3 * e2e_workers_x_batch), cache_dir)
    return {"raw": os.path.join(raw, "*.tar"), "jpeg": os.path.join(jpeg, "*.tar")}


def _jpeg_dataset(count: int, cache_dir: str) -> str:
    """The JPEG workload's photo crops, encoded by every core at once (the lent machine's stock Pillow took 100 s
    for 9216 on one): a part a process, each its own shards and keys."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    outdir = os.path.join(cache_dir, "bench", f"jpeg-parts-{count}")
    if not os.path.exists(os.path.join(outdir, "complete")):
        print(f"making the jpeg dataset ({count} samples) in {outdir}", file=sys.stderr, flush=True)
        shutil.rmtree(outdir, ignore_errors=True)  # an earlier attempt's shards, of another part count maybe
        os.makedirs(outdir)
        parts = max(1, min(len(os.sched_getaffinity(0)), count // 256))
        sizes = [count // parts + (i < count % parts) for i in range(parts)]
        with ProcessPoolExecutor(parts, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_jpeg_part, [(outdir, cache_dir, i, n) for i, n in enumerate(sizes)]))
        open(os.path.join(outdir, "complete"), "w").close()
    return outdir


def _jpeg_part(job: tuple[str, str, int, int]) -> None:
    from ..demo.datasets import photo_crops
    from ..formats.shard_writer import ShardWriter

    outdir, cache_dir, part, count = job
    with ShardWriter(outdir, f"jpeg-p{part:02d}", 4 << 20) as writer:
        for key, fields in photo_crops(count, cache_dir, seed=part):
            writer.write(f"p{part:02d}-{key}", fields)


def to_shm(data: dict[str, str], root: str) -> dict[str, str]:
    """The datasets copied under ``root`` in /dev/shm: the run reads memory, not the machine's disk."""
    from .contend import _PEER_DIRS

    out = {}
    for name, pattern in data.items():
        dst = os.path.join(root, name)
        shutil.copytree(os.path.dirname(pattern), dst, ignore=_PEER_DIRS)
        out[name] = os.path.join(dst, "*.tar")
    return out
