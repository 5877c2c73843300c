"""A worker's per-sample bookkeeping, in instructions (callgrind): what a worker spends on a sample beside decoding it.

Two loops over the same JPEG samples, in the same order, each box drawn from the same random state:

- ``worker``: a real ``Worker`` (the decode process's own class) filling ring slots in this process: the sample
  stream, the status table, the sample's seed and reseeding, ``load_sample``, the transform, the slot's fields and
  side record: everything ``_fill`` does;
- ``decode``: the decode alone, as the bench's one-core rate runs it: ``decode_image``, the random-resized crop
  (the crop decoder) and the pixels packed into a slot — as a worker packs them (past the caches, into rows
  aligned as a ring slot's), so that the pack's instructions cancel out.

(``decode`` gives each sample the worker's random state with ``setstate``; a third loop, ``restore``, counts that
alone, run with one and two ``setstate`` a sample, and it comes off the decode's count, so the worker's reseeding
counts whole as bookkeeping.) Each runs under ``valgrind --tool=callgrind`` twice, with N and 2N samples; the difference over N is the cost of a
sample with start-up and imports taken out. Instructions, not seconds: the figure is the same whatever else the
machine does (a per-sample cost of ~3 % is below what any timed run here can see). The bookkeeping's share is
``(worker - decode) / worker``.

``python -m feedline.bench.bookkeeping measure --shards 'dir/*.tar'`` prints the JSON result.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

IMAGE_SIZE = 224  # the bench's JPEG workload: RandomResizedCrop(224) into a (224, 224, 3) slot
BATCH = 32
SEED = 0


def _samples(shards: list[str], count: int) -> list[tuple[str, str, bytes]]:
    """(shard, key, JPEG bytes) of the first ``count`` samples, in shard order."""
    import tarfile

    out: list[tuple[str, str, bytes]] = []
    for path in shards:
        with tarfile.open(path) as tar:
            for info in tar:
                key, _, ext = info.name.partition(".")
                if info.isfile() and ext == "jpg":
                    out.append((path, key, tar.extractfile(info).read()))  # type: ignore[union-attr]
                    if len(out) == count:
                        return out
    raise SystemExit(f"the shards hold {len(out)} samples, fewer than {count}")


def _prepare(shards: list[str], count: int) -> tuple[list[tuple[str, str, bytes]], list[Any]]:
    """What both loops do before their first sample, so that it cancels out: the samples read, and the random
    state the worker gives each one (seeded from the sample)."""
    from ..loader.plan.seeding import sample_seed

    samples = _samples(shards, count)
    states = []
    for path, key, _ in samples:
        random.seed(sample_seed(SEED, 0, path, key))
        states.append(random.getstate())
    return samples, states


def restore_loop(shards: list[str], count: int, reps: int = 1) -> None:
    """What ``decode_loop`` spends giving each sample the worker's random state (``setstate``), ``reps`` times a
    sample: the difference of two ``reps`` is taken off the decode's count, so that the worker's reseeding counts
    whole as bookkeeping."""
    samples, states = _prepare(shards, count)
    for i in range(len(samples)):
        for _ in range(reps):
            random.setstate(states[i])


def decode_loop(shards: list[str], count: int) -> np.ndarray:
    """The decode alone over the first ``count`` samples, each with the random state the worker gives it; the
    first batch's pixels."""
    from ..formats import fastjpeg
    from ..formats.images import decode_image
    from ..formats.transforms import RandomResizedCrop

    samples, states = _prepare(shards, count)
    rrc = RandomResizedCrop(IMAGE_SIZE)
    row = IMAGE_SIZE * IMAGE_SIZE * 3
    raw = np.empty(BATCH * row + 64, np.uint8)
    at = -raw.ctypes.data % 64  # a ring slot's fields start 64-byte aligned
    slot = raw[at : at + BATCH * row].reshape(BATCH, IMAGE_SIZE, IMAGE_SIZE, 3)
    first = None
    for i, (_, _, data) in enumerate(samples):
        random.setstate(states[i])
        img = rrc({"jpg": decode_image(memoryview(data))})["jpg"]
        if not fastjpeg.pack_into(img, slot[i % BATCH], stream=True):
            np.copyto(slot[i % BATCH], np.asarray(img))
        if i == BATCH - 1:
            first = slot.copy()
    assert first is not None, f"{count} samples: give a multiple of {BATCH}"
    return first


def worker_loop(shards: list[str], count: int) -> np.ndarray:
    """A ``Worker`` in this process filling slots with the first ``count`` samples (the bench's JPEG spec and
    transform), as its process does; the first batch's pixels."""
    import logging
    import multiprocessing

    from ..formats.decoders import Decoder
    from ..formats.transforms import RandomResizedCrop
    from ..loader.layout.sample import FieldSelection
    from ..loader.layout.spec import Spec
    from ..loader.plan.epoch_plan import WorkerPlan
    from ..loader.ring.batch_ring import BatchRing, RingHandle, RingLayout
    from ..loader.workers.messages import DONE
    from ..loader.workers.worker import Worker, WorkerArgs, WorkerCode, WorkerSetup, _Epoch

    spec = Spec.parse({"jpg": ("uint8", (IMAGE_SIZE, IMAGE_SIZE, 3)), "cls": "int64"})
    ring = BatchRing(RingLayout(spec, BATCH), slots=2, workers=1)
    ours, theirs = multiprocessing.Pipe()
    try:
        setup = WorkerSetup(RingHandle.of(ring), 0, False, logging.WARNING)
        code = WorkerCode(Decoder(), FieldSelection(None), RandomResizedCrop(IMAGE_SIZE))
        worker = Worker(WorkerArgs(0, theirs, os.open(os.devnull, os.O_WRONLY), setup, code))
        samples, _ = _prepare(shards, count)
        mine = tuple(dict.fromkeys(path for path, _, _ in samples))
        worker.epoch = _Epoch(WorkerPlan(0, SEED, 0, 0, mine), 0, worker.status)
        done = batch = 0
        first = None
        while done < count:
            result = worker._fill(batch % 2, batch)
            assert result.kind == DONE and not any(result.errors), result
            if batch == 0:
                first = ring.slot(0)["jpg"].copy()
            done += result.samples
            batch += 1
        assert done == count and first is not None, f"{done} samples filled for {count}: give a multiple of {BATCH}"
        worker.epoch.close()
        return first
    finally:
        ours.close()
        theirs.close()
        ring.close()


_TOTAL = re.compile(r"^(?:summary|totals):\s*(\d+)", re.M)


def instructions(loop: str, shards: str, count: int, reps: int = 1) -> int:
    """Instructions of ``python -m feedline.bench.bookkeeping LOOP`` over ``count`` samples, under callgrind."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        # one thread each: OpenBLAS's idle threads spin, a count that differs run to run
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        subprocess.run([valgrind, "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
                        "--compress-strings=no", sys.executable, "-m", "feedline.bench.bookkeeping", loop,
                        "--shards", shards, "--samples", str(count), "--reps", str(reps)],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        m = _TOTAL.search(open(out).read())
        if m is None:
            raise SystemExit(f"callgrind wrote no total to {out}")
        return int(m.group(1))


def measure(shards: str, count: int = 96) -> dict[str, Any]:
    """Instructions a sample of each loop, and the bookkeeping's share of the worker's."""
    per: dict[str, float] = {}
    for loop in ("worker", "decode"):
        one, two = instructions(loop, shards, count), instructions(loop, shards, 2 * count)
        per[loop] = (two - one) / count
    restore = (instructions("restore", shards, count, 2) - instructions("restore", shards, count, 1)) / count
    decode = per["decode"] - restore
    extra = per["worker"] - decode
    return {"samples": count, "worker_instructions_a_sample": round(per["worker"]),
            "decode_instructions_a_sample": round(decode), "bookkeeping_instructions_a_sample": round(extra),
            "bookkeeping_share": extra / per["worker"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m feedline.bench.bookkeeping", description=__doc__.split("\n")[0])
    p.add_argument("loop", choices=("worker", "decode", "restore", "measure"))
    p.add_argument("--shards", required=True, help="the bench's JPEG shards (a glob)")
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--reps", type=int, default=1, help="restore: setstate calls a sample")
    args = p.parse_args(argv)
    shards = sorted(glob.glob(args.shards))
    if args.loop == "measure":
        print(json.dumps(measure(args.shards, args.samples)))
    else:
        if args.loop == "restore":
            restore_loop(shards, args.samples, args.reps)
        else:
            (worker_loop if args.loop == "worker" else decode_loop)(shards, args.samples)


if __name__ == "__main__":
    main()
