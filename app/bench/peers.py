"""The loaders users pick instead of feedline, as benchmark contenders: Mosaic Streaming and LitData.

They run in ``.venv-peers`` (``scripts/setup-peers``), never in ``.venv``: Mosaic pins numpy < 2.2 and
both declare torchvision. Each reads the bench's samples in its own format, written once from the
same tar shards (``write``), and does the same per-sample work as the DataLoader rows (``Convert``),
in the way each one's documentation shows: Mosaic's ``StreamingDataset`` in a ``DataLoader``,
LitData's ``StreamingDataset`` in its ``StreamingDataLoader``.

``python -m feedline.bench.peers write mosaic litdata --workload W --shards GLOB --out DIR`` writes
``DIR/mosaic`` and ``DIR/litdata``.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import shutil
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

from .samples import Convert, tar_samples

PEERS = ("mosaic", "litdata")
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
    else:
        raise ValueError(f"unknown peer {peer!r}: one of {', '.join(PEERS)}")
    open(os.path.join(out, MARK), "w").close()


def mosaic_loader(path: str, workload: str, image_size: int, batch_size: int, workers: int) -> Iterable[Any]:
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

    ds = Converted(local=path, shuffle=False, batch_size=batch_size)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=True,
                                       pin_memory=torch.cuda.is_available(), prefetch_factor=4)


def litdata_loader(path: str, workload: str, image_size: int, batch_size: int, workers: int) -> Iterable[Any]:
    """LitData's ``StreamingDataset`` over its optimized chunks in its ``StreamingDataLoader``, the sample
    converted by the dataset's ``transform`` (in the worker)."""
    import litdata

    ds = litdata.StreamingDataset(input_dir=path, shuffle=False, transform=Convert(workload, image_size))
    return litdata.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=True,
                                       prefetch_factor=4)


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
