"""Test data written as real tar shards, and checks that nothing was left behind."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np


def jpeg_bytes(seed: int, size: tuple[int, int] = (96, 72)) -> bytes:
    """A small photo-like JPEG (smooth gradients plus noise), different for every seed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * rng.uniform(1, 3) + y) % 256, (y * rng.uniform(1, 3)) % 256,
                    (x + y * rng.uniform(0, 2)) % 256], axis=-1)
    img = np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_tar(path: str, samples: list[tuple[str, dict[str, bytes]]], fmt: int = tarfile.PAX_FORMAT) -> str:
    with tarfile.open(path, "w", format=fmt) as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def id_samples(start: int, count: int, payload: int = 64) -> list[tuple[str, dict[str, bytes]]]:
    """Samples whose .cls is a unique id and whose .bin repeats it, so mix-ups are visible."""
    return [(f"s{i:07d}", {"cls": str(i).encode(), "bin": np.full(payload, i % 251, np.uint8).tobytes()})
            for i in range(start, start + count)]


def id_shards(directory: str, shards: int, per_shard: int, payload: int = 64) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    return [write_tar(os.path.join(directory, f"ids-{k:04d}.tar"), id_samples(k * per_shard, per_shard, payload))
            for k in range(shards)]


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (zombies and multiprocessing's resource tracker excluded).

    The tracker is started once per interpreter by the spawn start method and exits with it.
    """
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None) if pid == os.getpid() else None
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and int(entry) != tracker:
            out.append(int(entry))
    return out


def shm_entries() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if "feedline" in e or e.startswith(("psm_", "wnsm_", "torch_"))}
