"""``VideoClip``: a sample's video members become clips, in the worker, straight into the batch.

``VideoClip(frames=16, stride=2, size=224)`` takes ``frames`` frames ``stride`` frames apart from a window of the
video: a random window (``mode="random"``, training) or the middle one (``mode="center"``; with ``clips=K``, K
windows spread evenly: evaluation). Windows and frames are counted in frame numbers, never in float seconds: a
window starts at frame ``n`` (any of the video's, as long as the clip fits) and takes frames ``n, n + stride,
...``, each matched to the stream's timestamps exactly (``video_clock.py``), at any rate and time base. One box is drawn for the clip —
Inception's random-resized crop (``scale``, ``ratio``) and a random flip, or the largest centred box of the
output's aspect — and every frame of the clip is cut from it. The window, the box and the flip come from
``random``, which the worker seeds from (seed, epoch, shard, key) before each sample: the same sample gets the
same clip on every run, after a resume and after a worker is replaced.

Each video field ``<name>`` becomes ``<name>``: uint8 ``(frames, h, w, 3)`` (``(clips, frames, h, w, 3)`` with
``clips > 1``), ``<name>_time``: float32 seconds of each frame taken (from the stream's start), ``<name>_fps``: float32, the stream's
rate, and with ``audio=True`` ``<name>_audio``: float32 mono samples at ``audio_rate`` over the clip's span
(zeros where the video has no sound). A video shorter than the clip is padded with its last frame
(``short="pad"``) or skipped and counted as ``too_short`` (``short="skip"``). ``threads`` decode threads a
worker (``workers="auto"`` counts them: workers x threads fit the rank's CPUs).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from .bounds import SampleRejected
from .transforms import random_box
from .video import VIDEO_EXTENSIONS, ShortVideo, VideoMember, check_bound, open_clips

MODES = ("random", "center")
SHORT = ("pad", "skip")


class VideoClip:
    """The clip transform (see the module's docstring); picklable, as every transform is."""

    generators = ("random",)  # the windows, the box and the flip (transforms.generators_of)

    def __init__(self, frames: int = 16, stride: int = 2, size: int | tuple[int, int] = 224, *,
                 mode: str = "random", clips: int = 1, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True, short: str = "pad",
                 audio: bool = False, audio_rate: int = 16000, threads: int = 1,
                 fields: Sequence[str] | None = None):
        for name, value, least in (("frames", frames, 1), ("stride", stride, 1), ("clips", clips, 1),
                                   ("threads", threads, 1), ("audio_rate", audio_rate, 1000)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"VideoClip {name} must be an integer >= {least}, got {value!r}")
        if mode not in MODES:
            raise ValueError(f"VideoClip mode must be one of {', '.join(MODES)}, got {mode!r}")
        if short not in SHORT:
            raise ValueError(f"VideoClip short must be 'pad' (repeat the last frame) or 'skip', got {short!r}")
        size = (size, size) if isinstance(size, int) else tuple(size)
        if len(size) != 2 or not all(isinstance(d, int) and d >= 1 for d in size):
            raise ValueError(f"VideoClip size must be an int or (height, width) >= 1, got {size!r}")
        if not 0 < scale[0] <= scale[1] <= 1 or not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"VideoClip scale must lie in (0, 1] and ratio be positive, low to high; got "
                             f"scale={scale}, ratio={ratio}")
        try:
            import av  # noqa: F401  (decoded in the workers: refused here, in the training script, if missing)
        except ImportError:
            raise ImportError("VideoClip decodes video with PyAV: pip install av (./scripts/setup installs it)") from None
        self.frames, self.stride, self.size, self.mode, self.clips = frames, stride, size, mode, clips
        self.scale, self.ratio, self.flip, self.short = scale, ratio, flip, short
        self.audio, self.audio_rate, self.threads = audio, audio_rate, threads
        self.fields = list(fields) if fields is not None else None

    @property
    def threads_per_worker(self) -> int:
        """Decode threads each worker runs (``workers="auto"`` sizes the pool by it)."""
        return self.threads

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        names = self.fields if self.fields is not None else [
            k for k, v in sample.items()
            if isinstance(v, VideoMember) or (isinstance(v, (bytes, memoryview)) and _extension(k) in VIDEO_EXTENSIONS)]
        for name in names:
            if name not in sample:
                raise SampleRejected("missing_field", f"has no video field {name!r}")
            sample.update(self.read(name, sample[name]))
        return sample

    def read(self, name: str, member: bytes | memoryview) -> dict[str, Any]:
        """The clip fields of one video member."""
        data = member if isinstance(member, bytes) else bytes(member)
        bound = getattr(member, "bound", None)
        container, info, reader = open_clips(data, self.threads)
        try:
            if bound is not None:
                check_bound(info, self.frames * self.clips, bound)
            span = (self.frames - 1) * self.stride  # frames from the clip's first to its last
            room = info.count - 1 - span  # the last frame a window may start at
            if room < 0 and self.short == "skip":
                raise SampleRejected("too_short", f"video {name!r} is shorter than its clip: {info.count} frames "
                                                  f"({info.duration:.2f} s at {info.fps:g} fps), where a clip of "
                                                  f"{self.frames} frames {self.stride} apart spans {span + 1}; "
                                                  f"short='pad' repeats its last frame instead")
            room = max(0, room)
            if self.mode == "random":
                starts = sorted(random.randint(0, room) for _ in range(self.clips))
            else:
                starts = [(2 * k + 1) * room // (2 * self.clips) for k in range(self.clips)]
            h, w = self.size
            images = np.empty((self.clips, self.frames, h, w, 3), np.uint8)
            times = np.empty((self.clips, self.frames), np.float32)
            sounds = []
            for k, first in enumerate(starts):
                box, flip = self._box(info.width, info.height)
                try:
                    images[k], times[k] = reader.frames([first + i * self.stride for i in range(self.frames)], box,
                                                        self.size, flip, pad=self.short == "pad")
                except ShortVideo as exc:
                    raise SampleRejected("too_short", f"video {name!r}: {exc}; short='pad' repeats its last frame "
                                                      f"instead") from None
                if self.audio:
                    t0 = float(info.clock.origin * info.clock.time_base) + first / info.fps  # the stream's own time
                    sounds.append(reader.audio(t0, self.frames * self.stride / info.fps, self.audio_rate))
        finally:
            container.close()
        one = self.clips == 1
        out: dict[str, Any] = {name: images[0] if one else images, f"{name}_time": times[0] if one else times,
                               f"{name}_fps": np.float32(info.fps)}
        if self.audio:
            out[f"{name}_audio"] = sounds[0] if one else np.stack(sounds)
        return out

    def _box(self, width: int, height: int) -> tuple[tuple[float, float, float, float], bool]:
        if self.mode == "random":
            return random_box(width, height, self.scale, self.ratio, random), self.flip and random.random() < 0.5
        oh, ow = self.size
        if width * oh > height * ow:  # wider than the output: full height
            cw, ch = height * ow / oh, float(height)
        else:
            cw, ch = float(width), width * oh / ow
        x0, y0 = (width - cw) / 2, (height - ch) / 2
        return (x0, y0, x0 + cw, y0 + ch), False


def _extension(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()
