"""The loaders built for speed, as benchmark contenders: NVIDIA DALI's CPU pipeline and SPDL.

They run in ``.venv-fast`` (``scripts/setup-fast-peers``), never in ``.venv``: DALI's wheel and the CUDA libraries
it brings are gigabytes, SPDL loads FFmpeg's libraries. Both read the bench's own tar shards, with as many threads
as the other rows have workers, and hand the training loop dicts of torch tensors, as their documentation shows:

- DALI: ``fn.readers.webdataset`` (its shuffle buffer on, as for training) then, for JPEG, the fused crop decode
  ``fn.decoders.image_random_crop`` (the Inception box's area and aspect ranges: only the box is decoded) and
  ``fn.resize`` with antialiasing, in a CPU-only pipeline (``device_id=None``), out through its PyTorch iterator
  (``DALIGenericIterator``). A ``.cls`` member is text; DALI has no operator that parses it, so its bytes are padded
  in the pipeline and read as a number in the iterator, a few integer operations a batch.
- SPDL: its thread-based pipeline (``PipelineBuilder``): shards read and split into samples
  (``spdl.io.iter_tarfile``), samples converted ``concurrency`` at a time in its thread pool (JPEG: demuxed and
  decoded by FFmpeg with a crop-and-scale filter for the same random box), batched by ``aggregate`` and stacked.
"""

from __future__ import annotations

import importlib.metadata
import mmap
import random
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ..formats.transforms import random_box
from .samples import by_key

CLS_BYTES = 8  # a label's text, padded: up to eight digits
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # the Inception box every JPEG row draws


def _field(workload: str) -> str:
    return "bin" if workload == "raw" else "jpg"


def _ascii_ints(padded: torch.Tensor) -> torch.Tensor:
    """``[b"42\\0\\0...", ...]`` as ``[42, ...]``: the digits before the padding, as int64."""
    digits = padded.to(torch.int64) - ord("0")
    valid = (padded >= ord("0")) & (padded <= ord("9"))
    out = torch.zeros(padded.shape[0], dtype=torch.int64)
    for k in range(padded.shape[1]):
        out = torch.where(valid[:, k], out * 10 + digits[:, k], out)
    return out


class DaliBatches:
    """DALI's CPU pipeline over tar shards: one pass of its reader an epoch."""

    def __init__(self, shards: list[str], workload: str, image_size: int, batch_size: int, threads: int,
                 shuffle: bool = True):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self.field = _field(workload)

        @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=0)
        def pipeline() -> tuple[Any, Any]:
            data, cls = fn.readers.webdataset(paths=shards, ext=[self.field, "cls"], name="reader",
                                              random_shuffle=shuffle, missing_component_behavior="error")
            if workload == "jpeg":
                data = fn.decoders.image_random_crop(data, device="cpu", output_type=types.RGB,
                                                     random_area=list(SCALE), random_aspect_ratio=list(RATIO))
                data = fn.resize(data, resize_x=image_size, resize_y=image_size, antialias=True)
            return data, fn.pad(cls, fill_value=0, shape=[CLS_BYTES])

        self.pipe = pipeline()
        self.pipe.build()
        self.iterator = DALIGenericIterator(self.pipe, [self.field, "cls"], reader_name="reader",
                                            last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for out in self.iterator:
            batch = out[0]
            yield {self.field: batch[self.field], "cls": _ascii_ints(batch["cls"])}


class _Convert:
    """A sample's members to tensors, in SPDL's threads: the payload's bytes copied (raw), or the random box
    decoded and scaled by FFmpeg (JPEG)."""

    def __init__(self, workload: str, image_size: int, seed: int = 0):
        self.workload, self.size = workload, image_size
        self.rng = random.Random(seed)  # one generator for the threads: uniform() is atomic under the GIL

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        import spdl.io

        cls = int(bytes(sample["cls"]))
        if self.workload == "raw":
            return {"bin": torch.from_numpy(np.frombuffer(sample["bin"], np.uint8).copy()), "cls": cls}
        packets = spdl.io.demux_image(np.frombuffer(sample["jpg"], np.uint8))
        x0, y0, x1, y1 = random_box(packets.width, packets.height, SCALE, RATIO, self.rng)
        w, h = max(1, round(x1 - x0)), max(1, round(y1 - y0))
        crop = (f"crop={w}:{h}:{round(x0)}:{round(y0)},scale={self.size}:{self.size}:flags=bilinear,"
                f"format=rgb24")
        frames = spdl.io.decode_packets(packets, filter_desc=crop)
        return {"jpg": spdl.io.to_torch(spdl.io.convert_frames(frames)), "cls": cls}


def _tar_samples(path: str) -> Iterator[dict[str, Any]]:
    """The samples of a tar shard, members grouped by key (webdataset's naming), views of its mapping."""
    import spdl.io

    with open(path, "rb") as f:
        data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    yield from by_key(spdl.io.iter_tarfile(data))


def _collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) if isinstance(samples[0][k], torch.Tensor)
            else torch.tensor([s[k] for s in samples]) for k in samples[0]}


class SpdlBatches:
    """SPDL's pipeline over tar shards: built and run an epoch at a time (its source ends with the shards)."""

    def __init__(self, shards: list[str], workload: str, image_size: int, batch_size: int, threads: int,
                 shuffle: bool = True):
        self.shards, self.batch_size, self.threads, self.shuffle = shards, batch_size, threads, shuffle
        self.convert = _Convert(workload, image_size)
        self.epoch = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        from spdl.pipeline import PipelineBuilder

        order = list(self.shards)
        if self.shuffle:
            random.Random(self.epoch).shuffle(order)
        self.epoch += 1
        pipeline = (PipelineBuilder()
                    .add_source(order)
                    .pipe(_tar_samples)  # a shard in, its samples out
                    .pipe(self.convert, concurrency=self.threads)
                    .aggregate(self.batch_size)
                    .pipe(_collate)
                    .add_sink(4)
                    .build(num_threads=self.threads))
        with pipeline.auto_stop():
            yield from pipeline.get_iterator(timeout=120)


def loader(name: str, shards: list[str], workload: str, image_size: int, batch_size: int, workers: int,
           shuffle: bool = True) -> Iterable[dict[str, torch.Tensor]]:
    """The ``name`` contender over ``shards``, with ``workers`` threads."""
    cls = {"dali": DaliBatches, "spdl": SpdlBatches}[name]
    return cls(shards, workload, image_size, batch_size, workers, shuffle)


def version(name: str) -> str:
    """The version of the package a row runs."""
    return importlib.metadata.version({"dali": "nvidia-dali-cuda130", "spdl": "spdl"}[name])
