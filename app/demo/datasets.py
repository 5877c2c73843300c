"""Demo and benchmark datasets, written as real tar shards (``feedline make-dataset``).

- ``jpeg``: ImageNet-like photos (about 500x375, JPEG) cut at random from the
  sample photographs shipped inside scikit-image's wheel (downloaded once with
  pip, never installed), labelled by the photo they came from.
- ``raw``: incompressible random samples of a fixed size (1 MiB by default),
  the raw-scientific-data workload.
- ``captioned``: the ``jpeg`` photos with a ``.txt`` caption and ``.json``
  metadata, as image-text datasets (LAION, CC3M) are written.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator

import numpy as np

from ..formats.shard_writer import ShardWriter

log = logging.getLogger("feedline.datasets")

SKIMAGE_VERSION = "0.26.0"
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg", "ihc.png",
          "motorcycle_left.png", "motorcycle_right.png", "retina.jpg", "rocket.jpg")
IMAGE_SIZE = (500, 375)


def _skimage_wheel(cache_dir: str) -> str:
    found = glob.glob(os.path.join(cache_dir, f"scikit_image-{SKIMAGE_VERSION}-*.whl"))
    if found:
        return found[0]
    os.makedirs(cache_dir, exist_ok=True)
    log.info("downloading scikit-image %s's wheel for its sample photos (not installed)", SKIMAGE_VERSION)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           f"scikit-image=={SKIMAGE_VERSION}", "-d", cache_dir]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = glob.glob(os.path.join(cache_dir, f"scikit_image-{SKIMAGE_VERSION}-*.whl"))
    if result.returncode != 0 or not found:
        raise RuntimeError(f"cannot download scikit-image's wheel for the sample photos: {result.stderr.strip()}")
    return found[0]


def sample_photos(cache_dir: str) -> list[object]:
    """The colour sample photos as RGB PIL images."""
    from PIL import Image

    with zipfile.ZipFile(_skimage_wheel(cache_dir)) as z:
        return [Image.open(io.BytesIO(z.read(f"skimage/data/{name}"))).convert("RGB") for name in PHOTOS]


def photo_crops(count: int, cache_dir: str, seed: int = 0, quality: tuple[int, int] = (85, 95)
                ) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Random crops (scaled, flipped, landscape or portrait) of the photos, JPEG-encoded."""
    from PIL import Image

    photos = sample_photos(cache_dir)
    rng = np.random.default_rng(seed)
    for i in range(count):
        label = int(rng.integers(len(photos)))
        img = photos[label]
        w, h = IMAGE_SIZE if rng.random() < 0.75 else IMAGE_SIZE[::-1]
        scale = max(w / img.width, h / img.height) * float(rng.uniform(1.0, 1.6))
        scaled = img.resize((max(w, round(img.width * scale)), max(h, round(img.height * scale))),
                            Image.Resampling.BILINEAR)
        x = int(rng.integers(scaled.width - w + 1))
        y = int(rng.integers(scaled.height - h + 1))
        crop = scaled.crop((x, y, x + w, y + h))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        crop.save(buf, format="JPEG", quality=int(rng.integers(*quality, endpoint=True)))
        yield f"{i:08d}", {"jpg": buf.getvalue(), "cls": str(label).encode()}


def captioned_photos(count: int, cache_dir: str, seed: int = 0) -> Iterator[tuple[str, dict[str, bytes]]]:
    """The photo crops with a caption of varying length and JSON metadata."""
    rng = np.random.default_rng(seed + 1)
    for key, fields in photo_crops(count, cache_dir, seed):
        label = int(fields["cls"])
        name = PHOTOS[label].rsplit(".", 1)[0].replace("_", " ")
        words = " ".join(rng.choice(_WORDS, size=int(rng.integers(4, 40))))
        meta = {"label": name, "width": IMAGE_SIZE[0], "height": IMAGE_SIZE[1], "source": "scikit-image",
                "similarity": round(float(rng.uniform(0.2, 0.4)), 4), "tags": list(rng.choice(_WORDS, size=3))}
        yield key, {**fields, "txt": f"a photo of {name}, {words}".encode(), "json": json.dumps(meta).encode()}


_WORDS = ("bright", "dark", "close", "wide", "detailed", "blurry", "colourful", "old", "new", "small", "large",
          "outdoor", "indoor", "scientific", "vintage", "sharp", "soft", "high", "low", "contrast")


VIDEO_SIZE = (426, 240)  # 240p, 16:9: the size of many action-recognition sets' clips (Kinetics is ~340p short side)
VIDEO_SECONDS, VIDEO_FPS, VIDEO_GOP = 4, 25, 50  # a keyframe every 2 s, as phone and web video have


def video_clips(count: int, cache_dir: str, seed: int = 0) -> Iterator[tuple[str, dict[str, bytes]]]:
    """H.264 videos (PyAV's libx264) of the sample photos panned, with a camera's grain, so they have real texture,
    motion and bitrate (about 1 Mbit/s): ``VIDEO_SECONDS`` s at ``VIDEO_FPS`` fps, ``VIDEO_SIZE``."""
    import av
    from PIL import Image

    photos = sample_photos(cache_dir)
    rng = np.random.default_rng(seed)
    w, h = VIDEO_SIZE
    frames = VIDEO_SECONDS * VIDEO_FPS
    for i in range(count):
        label = int(rng.integers(len(photos)))
        img = photos[label]
        scale = max(w / img.width, h / img.height) * float(rng.uniform(1.3, 1.8))
        big = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.BILINEAR)
        x0, y0 = (int(rng.integers(big.width - w + 1)), int(rng.integers(big.height - h + 1)))
        x1, y1 = (int(rng.integers(big.width - w + 1)), int(rng.integers(big.height - h + 1)))
        buf = io.BytesIO()
        with av.open(buf, mode="w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=VIDEO_FPS)
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            stream.options = {"g": str(VIDEO_GOP), "crf": "23", "preset": "veryfast"}
            for f in range(frames):
                a = f / (frames - 1)
                x, y = round(x0 + (x1 - x0) * a), round(y0 + (y1 - y0) * a)
                pixels = np.asarray(big.crop((x, y, x + w, y + h)), dtype=np.int16)
                grain = rng.integers(-6, 7, size=pixels.shape[:2], dtype=np.int16)[..., None]  # a camera's noise
                frame = av.VideoFrame.from_ndarray(np.clip(pixels + grain, 0, 255).astype(np.uint8), format="rgb24")
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        yield f"{i:08d}", {"mp4": buf.getvalue(), "cls": str(label).encode()}


def raw_samples(count: int, sample_bytes: int = 1 << 20, seed: int = 0) -> Iterator[tuple[str, dict[str, bytes]]]:
    rng = np.random.default_rng(seed)
    for i in range(count):
        yield f"{i:08d}", {"bin": rng.bytes(sample_bytes), "cls": str(i % 1000).encode()}


def make_dataset(kind: str, outdir: str, count: int, shard_bytes: int, cache_dir: str = ".cache",
                 sample_bytes: int = 1 << 20, seed: int = 0,
                 progress: Callable[[int], None] | None = None) -> list[str]:
    """Write ``count`` samples of ``kind`` as shards under ``outdir``; returns the shard paths."""
    if kind == "jpeg":
        samples = photo_crops(count, cache_dir, seed)
    elif kind == "raw":
        samples = raw_samples(count, sample_bytes, seed)
    elif kind == "captioned":
        samples = captioned_photos(count, cache_dir, seed)
    elif kind == "video":
        samples = video_clips(count, cache_dir, seed)
    else:
        raise ValueError(f"dataset kind must be 'jpeg', 'raw', 'captioned' or 'video', got {kind!r}")
    for old in glob.glob(os.path.join(outdir, "*.tar")) + glob.glob(os.path.join(outdir, "*.idx")):
        os.unlink(old)
    with ShardWriter(outdir, kind, shard_bytes) as writer:
        for n, (key, fields) in enumerate(samples, 1):
            writer.write(key, fields)
            if progress is not None:
                progress(n)
    return writer.shards

# compose.yaml's default FEEDLINE_SOURCE points here: the demo profile's store
DEMO_STORE = "http://demo-store:8080/"
NO_DEMO_STORE = ("FEEDLINE_SOURCE is unset, so compose points the sampler at the demo profile's store: start it "
                 "with `docker compose --profile demo up`, or set FEEDLINE_SOURCE in .env to your shards")


def make_demo_store(root: str, count: int, shard_bytes: int, cache_dir: str) -> str:
    """The demo JPEG dataset in ``root`` (written unless there already) and ``root/index.txt`` listing its
    shards: what compose's demo profile serves, so the sampler's source is one URL whatever the count."""
    os.makedirs(root, exist_ok=True)
    shards = sorted(glob.glob(os.path.join(root, "*.tar")))
    if not shards:
        log.info("writing the demo dataset: %d JPEG samples into %s", count, root)
        shards = make_dataset("jpeg", root, count, shard_bytes, cache_dir)
    index = os.path.join(root, "index.txt")
    tmp = f"{index}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(f"{os.path.basename(s)}\n" for s in shards)
    os.replace(tmp, index)
    return index
