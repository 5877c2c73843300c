"""The loaders users pick instead of feedline, as benchmark contenders: Mosaic Streaming, LitData, tf.data and
Hugging Face datasets.

They run in ``.venv-peers`` (``scripts/setup-peers``), never in ``.venv``: Mosaic pins numpy < 2.2 and
both it and LitData declare torchvision; tensorflow-cpu brings its own pins. Each reads the bench's samples in its
own format, written once from the same tar shards by its own writer (``write``), and does the same per-sample
work, in the way each one's documentation shows: Mosaic's ``StreamingDataset`` in a ``DataLoader``, LitData's
``StreamingDataset`` in its ``StreamingDataLoader`` (both with the DataLoader rows' ``Convert``); tf.data's
``TFRecordDataset`` + ``parse_single_example`` + TensorFlow's own fused crop decode and resize; a Hugging Face
``datasets`` Parquet dataset with ``set_transform`` (``Convert``) in a ``DataLoader``. The TFRecord and Parquet
files are what feedline's "feedline (TFRecord)" and "feedline (Parquet)" rows read too.

``python -m feedline.bench.peers write mosaic litdata tfdata hf --workload W --shards GLOB --out DIR`` writes
``DIR/mosaic``, ``DIR/litdata``, ``DIR/tfdata`` (``*.tfrecord``) and ``DIR/hf`` (``*.parquet``).
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib
import os
import shutil
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

from .samples import Convert, tar_samples

PEERS = ("mosaic", "litdata", "tfdata", "hf")
FILES = {"tfdata": "*.tfrecord", "hf": "*.parquet"}  # the peers whose files feedline reads as they are
MARK = "complete"  # written last: a format directory without it is a write that did not finish


def import_streaming() -> types.ModuleType:
    """Mosaic's ``streaming`` package: its ``__init__`` imports ``streaming.vision`` (ImageNet, COCO, ... on
    torchvision), which the peer venv lacks and the MDS reader and writer (``streaming.base``) never use; an
    empty ``streaming.vision`` in its place lets the package import."""
    if "streaming" not in sys.modules:
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def _field(workload: str) -> str:
    """The member that holds a sample's payload in the bench's shards."""
    return "bin" if workload == "raw" else "jpg"


def _samples(shards: list[str], workload: str) -> Iterator[dict[str, Any]]:
    """Every sample of the tar shards, as the other formats store it: the payload's bytes and the label."""
    field = _field(workload)
    for path in shards:
        for s in tar_samples(path):
            yield {field: s[field], "cls": int(s["cls"])}


def _litdata_items(path: str, workload: str) -> Iterator[dict[str, Any]]:
    """One input of LitData's ``optimize``: a tar shard, yielding its samples (module level: its workers
    unpickle the function)."""
    yield from _samples([path], workload)


def _stem(path: str) -> str:
    return os.path.basename(path)[: -len(".tar")]


def _write_tfrecords(shards: list[str], out: str, workload: str) -> None:
    """A TFRecord file per tar shard, written by TensorFlow's own ``TFRecordWriter``: Examples of the payload's
    bytes and the label."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    field = _field(workload)
    for path in shards:
        with tf.io.TFRecordWriter(os.path.join(out, _stem(path) + ".tfrecord")) as w:
            for s in _samples([path], workload):
                feature = {field: tf.train.Feature(bytes_list=tf.train.BytesList(value=[s[field]])),
                           "cls": tf.train.Feature(int64_list=tf.train.Int64List(value=[s["cls"]]))}
                w.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())


def _write_parquet(shards: list[str], out: str, workload: str) -> None:
    """A Parquet file per tar shard, written by Hugging Face ``datasets`` (``to_parquet``): JPEGs as an ``Image``
    column (the Hub's ``{bytes, path}`` struct), raw payloads as ``binary``."""
    import datasets

    datasets.disable_progress_bars()
    field = _field(workload)
    kind = datasets.Image() if workload == "jpeg" else datasets.Value("binary")
    features = datasets.Features({field: kind, "cls": datasets.Value("int64")})
    for path in shards:
        rows = list(_samples([path], workload))
        columns = {field: [{"bytes": r[field], "path": None} if workload == "jpeg" else r[field] for r in rows],
                   "cls": [r["cls"] for r in rows]}
        datasets.Dataset.from_dict(columns, features=features).to_parquet(os.path.join(out, _stem(path) + ".parquet"))


def write(peer: str, shards: list[str], out: str, workload: str) -> None:
    """The samples of ``shards`` in ``peer``'s format under ``out`` (replaced), marked complete at the end."""
    shutil.rmtree(out, ignore_errors=True)
    if peer == "mosaic":
        writer_cls = import_streaming().MDSWriter
        with writer_cls(out=out, columns={_field(workload): "bytes", "cls": "int"}) as w:
            for s in _samples(shards, workload):
                w.write(s)
    elif peer == "litdata":
        import litdata

        litdata.optimize(fn=functools.partial(_litdata_items, workload=workload), inputs=shards, output_dir=out,
                         chunk_bytes="64MB", num_workers=1, start_method="fork", verbose=False)
    elif peer in FILES:
        os.makedirs(out)
        (_write_tfrecords if peer == "tfdata" else _write_parquet)(shards, out, workload)
    else:
        raise ValueError(f"unknown peer {peer!r}: one of {', '.join(PEERS)}")
    open(os.path.join(out, MARK), "w").close()


def mosaic_loader(path: str, workload: str, image_size: int, batch_size: int, workers: int,
                  shuffle: bool = False) -> Iterable[Any]:
    """Mosaic's ``StreamingDataset`` over local MDS shards in a torch ``DataLoader`` (its documented use), the
    sample converted in the worker as the DataLoader row does."""
    import torch

    streaming = import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    convert = Convert(workload, image_size)

    class Converted(streaming.StreamingDataset):  # type: ignore[misc, name-defined]
        def __getitem__(self, i: int) -> dict[str, Any]:
            return convert(super().__getitem__(i))

    ds = Converted(local=path, shuffle=shuffle, batch_size=batch_size)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=True,
                                       pin_memory=torch.cuda.is_available(), prefetch_factor=4)


def litdata_loader(path: str, workload: str, image_size: int, batch_size: int, workers: int,
                   shuffle: bool = False) -> Iterable[Any]:
    """LitData's ``StreamingDataset`` over its optimized chunks in its ``StreamingDataLoader``, the sample
    converted by the dataset's ``transform`` (in the worker)."""
    import litdata

    ds = litdata.StreamingDataset(input_dir=path, shuffle=shuffle, transform=Convert(workload, image_size))
    return litdata.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=True,
                                       prefetch_factor=4)


class _TorchBatches:
    """tf.data's batches as the training loop gets them: dicts of torch tensors (numpy's memory, no copy)."""

    def __init__(self, ds: Any):
        self.ds = ds

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import numpy as np
        import torch

        for batch in self.ds.as_numpy_iterator():
            yield {k: torch.from_numpy(np.require(v, requirements="W")) for k, v in batch.items()}


def tfdata_loader(path: str, workload: str, image_size: int, batch_size: int, workers: int) -> Iterable[Any]:
    """tf.data as its guides write an ImageNet input pipeline: ``TFRecordDataset`` with parallel reads,
    ``parse_single_example``, then (JPEG) a random-resized-crop box drawn by ``sample_distorted_bounding_box``
    (the same area and aspect ranges), only that box decoded (``decode_and_crop_jpeg``, TensorFlow's fused crop
    decoder) and resized with antialiasing as Pillow's resize does; (raw) the bytes as a uint8 tensor. Parallel
    ``map`` and ``prefetch`` with ``AUTOTUNE``, in this process's threads: tf.data has no worker processes.
    ``workers``: the threads tf.data's private pool may use, as many as the other rows' workers."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    files = sorted(glob.glob(os.path.join(path, FILES["tfdata"])))
    field = _field(workload)
    features = {field: tf.io.FixedLenFeature([], tf.string), "cls": tf.io.FixedLenFeature([], tf.int64)}
    whole = tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, [1, 1, 4])

    def parse(record: Any) -> dict[str, Any]:
        ex = tf.io.parse_single_example(record, features)
        if workload == "raw":
            return {field: tf.io.decode_raw(ex[field], tf.uint8), "cls": ex["cls"]}
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            tf.image.extract_jpeg_shape(ex[field]), whole, min_object_covered=0.0, aspect_ratio_range=(3 / 4, 4 / 3),
            area_range=(0.08, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
        window = tf.stack([begin[0], begin[1], size[0], size[1]])
        image = tf.io.decode_and_crop_jpeg(ex[field], window, channels=3)
        image = tf.image.resize(image, [image_size, image_size], antialias=True)
        return {field: tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8), "cls": ex["cls"]}

    options = tf.data.Options()
    options.threading.private_threadpool_size = workers
    ds = tf.data.TFRecordDataset(files, num_parallel_reads=tf.data.AUTOTUNE)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size).prefetch(tf.data.AUTOTUNE)
    return _TorchBatches(ds.with_options(options))


class _RowsConverted:
    """``set_transform``'s function: a batch of rows (columns of values; an ``Image`` column's as PIL images) through
    the bench's per-sample work (picklable for the DataLoader's workers)."""

    def __init__(self, workload: str, image_size: int):
        self.convert = Convert(workload, image_size)
        self.field = _field(workload)

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out = [self.convert({self.field: v, "cls": c}) for v, c in zip(batch[self.field], batch["cls"])]
        return {k: [o[k] for o in out] for k in out[0]}


def hf_loader(path: str, workload: str, image_size: int, batch_size: int, workers: int) -> Iterable[Any]:
    """Hugging Face ``datasets`` as its PyTorch guide shows: the Parquet files loaded (``load_dataset("parquet")``,
    which converts them once into its Arrow cache, kept beside them and not timed), ``set_transform`` for the
    per-sample work, in a torch ``DataLoader``."""
    import datasets
    import torch

    datasets.disable_progress_bars()
    files = sorted(glob.glob(os.path.join(path, FILES["hf"])))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=os.path.join(path, ".hf-cache"))
    ds.set_transform(_RowsConverted(workload, image_size))
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=True,
                                       pin_memory=torch.cuda.is_available(), prefetch_factor=4)


LOADERS = {"mosaic": mosaic_loader, "litdata": litdata_loader, "tfdata": tfdata_loader, "hf": hf_loader}


def version(peer: str) -> str:
    """The version of the package a peer's row runs."""
    if peer == "mosaic":
        return str(import_streaming().__version__)
    module = {"litdata": "litdata", "tfdata": "tensorflow", "hf": "datasets"}[peer]
    return str(importlib.import_module(module).__version__)


def close(peer: str) -> None:
    """What a peer leaves behind once its loader is done: Mosaic's shared memory in /dev/shm."""
    if peer == "mosaic":
        import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m feedline.bench.peers")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the tar shards' samples in a peer's format")
    w.add_argument("peers", nargs="+", choices=PEERS)
    w.add_argument("--workload", choices=("raw", "jpeg"), required=True)
    w.add_argument("--shards", required=True, help="a glob of tar shards")
    w.add_argument("--out", required=True, help="each peer's format goes to OUT/PEER")
    args = p.parse_args(argv)
    shards = sorted(glob.glob(args.shards))
    if not shards:
        raise SystemExit(f"no shards match {args.shards}")
    for peer in args.peers:
        write(peer, shards, os.path.join(args.out, peer), args.workload)


if __name__ == "__main__":
    main(sys.argv[1:])
