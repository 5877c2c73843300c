"""The bench's video workload: how the other rows decode the same clips (16 frames 2 apart, one random-resized-crop
box a clip, 112x112), and one core's clip rate.

- ``UserClip``: what a ``DataLoader`` dataset's ``__getitem__`` does with the same library (PyAV), written as its
  documentation shows: seek to the window, decode forward, each frame taken as a full RGB array
  (``frame.to_ndarray(format="rgb24")``), cut and resized with Pillow.
- ``SwscaleClip``: what a user who knows PyAV writes: seek, decode forward, and each frame the clip takes scaled
  and converted in one swscale pass (``frame.to_ndarray(width=, height=, format="rgb24")``, bilinear) at the size
  that puts the box at 112x112, then cut: the same work per frame as ``VideoClip``'s; frames picked by number
  (``round(frame.time * fps)``).
- ``whole_video``: webdataset's own video decoding, ``torchvision.io.read_video``: every frame of the video, RGB.
  torchvision does not import beside this project's CPU build of torch (its operators are built for another
  torch), so this is read_video's PyAV path written out — every frame decoded and converted — feeding the same
  clip's frames.
- ``single_core``: ``VideoClip`` as a worker runs it, in this process alone: the rate feedline's workers scale.
"""

from __future__ import annotations

import io
import random
import time
from typing import Any

import numpy as np

from ..formats.transforms import random_box

FRAMES, STRIDE, SIZE = 16, 2, 112  # the clip every row makes
SWSCALE_ROW = "DataLoader (PyAV, swscale in __getitem__)"  # the competent row (issue 68)
BATCH = 8  # clips a batch, as video training runs them (a clip is 600 kB; 96 videos make 12 batches an epoch)


def _window(fps: float, duration: float) -> list[float]:
    step = STRIDE / fps
    t0 = random.uniform(0.0, max(0.0, duration - 1.0 / fps - (FRAMES - 1) * step))
    return [t0 + i * step for i in range(FRAMES)]


def _resize(frames: list[np.ndarray], width: int, height: int) -> np.ndarray:
    from PIL import Image

    box = random_box(width, height, (0.08, 1.0), (3 / 4, 4 / 3), random)
    flip = random.random() < 0.5
    out = np.stack([np.asarray(Image.fromarray(f).resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=box))
                    for f in frames])
    return out[:, :, ::-1].copy() if flip else out


class UserClip:
    """The DataLoader row's per-sample work on a video member (picklable for spawn)."""

    def __call__(self, data: bytes) -> np.ndarray:
        import av

        with av.open(io.BytesIO(data)) as container:
            vs = container.streams.video[0]
            fps = float(vs.average_rate)
            duration = float(vs.duration * vs.time_base)
            times = _window(fps, duration)
            container.seek(int(times[0] / vs.time_base), stream=vs)
            frames: list[np.ndarray] = []
            last = None
            for frame in container.decode(vs):
                while len(frames) < FRAMES and frame.time > times[len(frames)] + 1e-3:
                    frames.append(last if last is not None else frame.to_ndarray(format="rgb24"))
                last = frame.to_ndarray(format="rgb24")
                if len(frames) == FRAMES:
                    break
            while len(frames) < FRAMES:
                frames.append(last)
            return _resize(frames, vs.codec_context.width, vs.codec_context.height)


class SwscaleClip:
    """The competent DataLoader row's per-sample work on a video member (picklable for spawn)."""

    def __call__(self, data: bytes) -> np.ndarray:
        import av

        with av.open(io.BytesIO(data)) as container:
            vs = container.streams.video[0]
            fps = float(vs.average_rate)
            count = vs.frames or round(float(vs.duration * vs.time_base) * fps)
            first = random.randint(0, max(0, count - 1 - (FRAMES - 1) * STRIDE))
            wanted = [first + i * STRIDE for i in range(FRAMES)]
            width, height = vs.codec_context.width, vs.codec_context.height
            x0, y0, x1, y1 = random_box(width, height, (0.08, 1.0), (3 / 4, 4 / 3), random)
            flip = random.random() < 0.5
            sx, sy = SIZE / (x1 - x0), SIZE / (y1 - y0)
            sw, sh = max(SIZE, round(width * sx)), max(SIZE, round(height * sy))
            left, top = min(max(0, round(x0 * sx)), sw - SIZE), min(max(0, round(y0 * sy)), sh - SIZE)
            container.seek(int(first / fps / vs.time_base), stream=vs)
            out = np.empty((FRAMES, SIZE, SIZE, 3), np.uint8)
            k = 0
            for frame in container.decode(vs):
                n = round(frame.time * fps)
                while k < FRAMES and wanted[k] <= n:  # this frame, or the one shown when a wanted one is missing
                    rgb = frame.to_ndarray(width=sw, height=sh, format="rgb24", interpolation="BILINEAR")
                    out[k] = rgb[top : top + SIZE, left : left + SIZE]
                    k += 1
                if k == FRAMES:
                    break
            while 0 < k < FRAMES:
                out[k] = out[k - 1]
                k += 1
            return out[:, :, ::-1].copy() if flip else out


def whole_video(data: bytes) -> np.ndarray:
    """``torchvision.io.read_video``'s PyAV path: every frame of the video as RGB, (T, H, W, 3)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_rgb().to_ndarray() for f in container.decode(video=0)])


def clip_of(video: np.ndarray, fps: float = 25.0) -> np.ndarray:
    """The clip's frames picked out of a whole decoded video, cut and resized (the webdataset row)."""
    times = _window(fps, len(video) / fps)
    idx = [min(len(video) - 1, int(t * fps + 1e-6)) for t in times]
    return _resize([video[i] for i in idx], video.shape[2], video.shape[1])


def single_core(shards: list[str], seconds: float) -> dict[str, Any]:
    """Clips/s of ``VideoClip`` in this process, the members read from the shards as a worker reads them."""
    import tarfile

    from ..formats.video import VideoMember
    from ..formats.video_clip import VideoClip

    clip = VideoClip(FRAMES, STRIDE, SIZE)
    members = []
    for path in shards:
        with tarfile.open(path) as tar:
            members += [VideoMember(tar.extractfile(m).read()) for m in tar if m.name.endswith(".mp4")]  # type: ignore
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        clip({"mp4": members[n % len(members)]})
        n += 1
    wall = time.perf_counter() - t0
    import PIL

    return {"samples": n, "seconds": wall, "samples_per_s": n / wall, "pil": PIL.__version__}
