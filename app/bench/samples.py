"""What every contender does with a sample, whichever loader delivers it: the tar shards read as a hand-written
dataset reads them, and the per-sample work of the DataLoader rows (``Convert``), which the peers' rows
(``peers.py``) do too."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from ..formats.transforms import RandomResizedCrop

T = TypeVar("T")


def by_key(members: Iterable[tuple[str, T]]) -> Iterator[dict[str, T]]:
    """Consecutive members grouped into samples by key, the name up to its first dot (what a hand-written Dataset
    does; the fast peers group their own tar readers' members the same way)."""
    current: dict[str, T] = {}
    key = None
    for name, value in members:
        k, _, ext = name.partition(".")
        if k != key and current:
            yield current
            current = {}
        key = k
        current[ext] = value
    if current:
        yield current


def tar_samples(path: str) -> Iterator[dict[str, bytes]]:
    """Stream a shard with tarfile, grouping members by key (what a hand-written Dataset does)."""
    with tarfile.open(path, mode="r|") as tar:
        yield from by_key((info.name, _read(tar, info)) for info in tar if info.isfile())


def _read(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(info)
    assert f is not None
    return f.read()


class Convert:
    """Bytes of a sample to tensors, as a typical hand-written dataset does (picklable for spawn)."""

    def __init__(self, workload: str, image_size: int, swscale: bool = False):
        self.workload = workload
        self.rrc = RandomResizedCrop(image_size, draft=False)  # torchvision-style: full-size decode
        self.swscale = swscale  # video: the competent row (SwscaleClip), else PyAV's documented way (UserClip)

    def __call__(self, s: dict[str, Any]) -> dict[str, Any]:
        if self.workload == "video":  # the same library (PyAV), the same clip, as a dataset's __getitem__ writes it
            from .video_bench import SwscaleClip, UserClip, clip_of

            clip = (clip_of(s["mp4"]) if isinstance(s["mp4"], np.ndarray) else
                    SwscaleClip()(s["mp4"]) if self.swscale else UserClip()(s["mp4"]))
            return {"mp4": torch.from_numpy(clip), "cls": int(s["cls"])}
        if self.workload == "raw":
            arr = np.frombuffer(s["bin"], dtype=np.uint8).copy()
            return {"bin": torch.from_numpy(arr), "cls": int(s["cls"])}
        from PIL import Image

        jpg = s["jpg"]  # bytes; LitData's reader hands out a memoryview; webdataset's decoder, an image
        img = Image.open(io.BytesIO(jpg)) if isinstance(jpg, (bytes, bytearray, memoryview)) else jpg
        img = self.rrc.crop(img.convert("RGB"))
        out = {"jpg": torch.from_numpy(np.asarray(img).copy()), "cls": int(s["cls"])}
        if self.workload == "captioned":  # webdataset decoded them already; a hand-written dataset decodes here
            out["txt"] = s["txt"] if isinstance(s["txt"], str) else s["txt"].decode("utf-8")
            out["json"] = s["json"] if isinstance(s["json"], dict) else json.loads(s["json"])
        return out


def collate_mixed(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors and ints; keep strings and JSON values as lists (what users write for captions)."""
    out: dict[str, Any] = {}
    for k in samples[0]:
        values = [s[k] for s in samples]
        if isinstance(values[0], torch.Tensor):
            out[k] = torch.stack(values)
        elif isinstance(values[0], int):
            out[k] = torch.tensor(values)
        else:
            out[k] = values
    return out
