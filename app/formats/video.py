"""Video members: a container read from memory with PyAV, only the frames a clip needs decoded.

A video member (``mp4 webm mkv avi mov``) decodes to a ``VideoMember``: its bytes, unchanged (so it still travels
as bytes where nothing asks for a clip), which ``VideoClip`` (``video_clip.py``) reads. Reading a clip: the
container's header gives the stream's size, rate and duration before any frame is decoded, and every bound is
checked then (``max_member_bytes`` against the clip at its source size; a duration or frame count the member's
bytes cannot hold); the decoder seeks to the keyframe before the clip's first frame and decodes forward — frames
nothing refers to skipped until the clip starts — and stops at its last: never the whole video. Each frame the clip
takes is the one shown at its time (by timestamp, so a variable frame rate is sampled at the stream's average
rate), scaled and converted once by swscale (bilinear, filtered on a downscale) and cropped to the clip's box.

Chosen by measurement on this machine (issue 61): PyAV 18 (its wheels bundle FFmpeg 8 with libx264 and libvpx);
torchcodec 0.15-0.17, from PyPI, do not load beside the CPU build of torch (their libraries need CUDA's
``libnvrtc``).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from .bounds import DEFAULT_MAX_MEMBER_BYTES, DecodeError, MemberTooLarge
from .video_clock import FrameClock

VIDEO_EXTENSIONS = frozenset({"mp4", "webm", "mkv", "avi", "mov"})


class VideoMember(bytes):
    """A video member's bytes, as they are; ``VideoClip`` reads clips from it (within ``bound``)."""

    bound: int = DEFAULT_MAX_MEMBER_BYTES


def decode_video(data: memoryview, bound: int = DEFAULT_MAX_MEMBER_BYTES) -> VideoMember:
    member = VideoMember(data)
    member.bound = bound
    return member


class ShortVideo(Exception):
    """The video ends before the clip does (``short="skip"``)."""


@dataclass(frozen=True)
class VideoInfo:
    """What the container's header says of its first video stream (nothing decoded yet)."""

    width: int
    height: int
    fps: float  # the stream's average frame rate
    duration: float  # seconds
    frames: int  # as declared (0: not declared)
    has_audio: bool
    clock: FrameClock  # its timestamps <-> frame numbers, exactly

    @property
    def count(self) -> int:
        """Frames the stream holds: as declared, else its duration's worth at its rate."""
        return self.frames if self.frames > 0 else max(1, round(self.duration * self.clock.rate))


def _open(member: bytes) -> Any:
    import av

    try:
        return av.open(io.BytesIO(member), mode="r")
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise DecodeError(f"not a readable video container: {exc}") from None


def info_of(container: Any, size: int) -> VideoInfo:
    """The first video stream's header; a stream its ``size`` bytes cannot hold is refused."""
    if not container.streams.video:
        raise DecodeError("the container holds no video stream")
    vs = container.streams.video[0]
    cc = vs.codec_context
    width, height = int(cc.width or 0), int(cc.height or 0)
    if width <= 0 or height <= 0:
        raise DecodeError(f"the video stream declares no size ({width}x{height})")
    rate = vs.average_rate or vs.guessed_rate or vs.base_rate
    fps = float(rate) if rate else 0.0
    if not 0 < fps < 10_000:
        raise DecodeError(f"the video stream declares no usable frame rate ({rate})")
    if vs.time_base is None or vs.time_base <= 0:
        raise DecodeError(f"the video stream declares no usable time base ({vs.time_base})")
    if vs.duration is not None and vs.time_base is not None:
        duration = float(vs.duration * vs.time_base)
    elif container.duration is not None:
        duration = container.duration / 1_000_000
    else:
        duration = (vs.frames or 0) / fps
    frames = int(vs.frames or 0)
    if duration <= 0 and frames <= 0:
        raise DecodeError("the video stream declares neither a duration nor a frame count")
    if max(frames, duration * fps) > size:  # a frame takes a byte at the very least
        raise DecodeError(f"the video declares {max(frames, round(duration * fps))} frames ({duration:.1f} s at "
                          f"{fps:g} fps) but the member holds {size} bytes: its header does not describe it")
    if duration <= 0:
        duration = frames / fps
    clock = FrameClock(Fraction(vs.time_base), Fraction(rate), vs.start_time or 0)
    return VideoInfo(width, height, fps, duration, frames, bool(container.streams.audio), clock)


def check_bound(info: VideoInfo, frames: int, bound: int) -> None:
    """``frames`` frames at the source size (RGB) within ``bound``, before any frame is allocated."""
    need = info.width * info.height * 3 * frames
    if need > bound:
        raise MemberTooLarge(f"a clip of {frames} frames of {info.width}x{info.height} takes {need} bytes decoded,",
                             bound)


class _Redo(Exception):
    """This pass cannot give the exact clip (a seek past its first frame, a skipped frame it needed): decode again."""


class ClipReader:
    """Reads clips from one open container: frames by number, cropped to a box, at ``size``."""

    def __init__(self, container: Any, info: VideoInfo, threads: int = 1):
        from av.video.reformatter import VideoReformatter

        self.container = container
        self.info = info
        self.stream = container.streams.video[0]
        cc = self.stream.codec_context
        cc.thread_count = max(1, threads)
        if threads != 1:
            cc.thread_type = "AUTO"
        self._reformat = VideoReformatter()  # one swscale context, reused frame after frame

    def frames(self, numbers: list[int], box: tuple[float, float, float, float], size: tuple[int, int],
               flip: bool, pad: bool) -> tuple[np.ndarray, np.ndarray]:
        """(len(numbers), h, w, 3) uint8: frame ``n`` for each ascending ``n`` of ``numbers`` (see ``FrameClock``:
        the frame whose timestamp is nearest ``n`` frames of the average rate; where a variable rate left none
        there, the last one before), cut to ``box`` (x0, y0, x1, y1 in source pixels) and resized to ``size`` (h,
        w); and each frame's time in seconds from the stream's start. Past the last frame: the last one again
        when ``pad``, else ``ShortVideo``.

        Frames nothing refers to are not decoded unless the clip takes them (before its window and, stride > 1,
        inside it); where that might have changed the answer (a variable rate's gap), the clip is decoded again
        without skipping, so the frames taken never depend on it."""
        import av

        clock = self.info.clock
        plans = [(clock.pts(numbers[0]), True), (clock.pts(numbers[0] - 2 * int(clock.rate) - 1), True),
                 (clock.origin, False)]
        for attempt, (target, skip) in enumerate(plans):
            try:
                self.container.seek(max(clock.origin, target), stream=self.stream, backward=True, any_frame=False)
            except av.FFmpegError as exc:
                raise DecodeError(f"cannot seek to frame {numbers[0]}: {exc}") from None
            try:
                return self._pass(numbers, box, size, flip, pad, skip, final=attempt == len(plans) - 1)
            except _Redo:
                continue
        raise AssertionError("the last pass decodes from the start and never asks for another")

    def _pass(self, numbers: list[int], box: tuple[float, float, float, float], size: tuple[int, int], flip: bool,
              pad: bool, skip: bool, final: bool) -> tuple[np.ndarray, np.ndarray]:
        import av

        clock = self.info.clock
        cc = self.stream.codec_context
        want, last = set(numbers), numbers[-1]
        out = np.empty((len(numbers), *size, 3), np.uint8)
        stamps = np.zeros(len(numbers), np.float32)
        skipped: list[int] = []  # numbers of packets left undecoded
        k = 0
        prev: Any = None  # the last frame decoded and its number: shown until the next one's
        prev_n = -1
        shown: list[Any] = [None, None]  # (frame, its image): a frame taken twice is converted once

        def take(frame: Any) -> None:
            nonlocal k
            if shown[0] is not frame:
                shown[0], shown[1] = frame, self._convert(frame, box, size, flip)
            out[k], stamps[k] = shown[1], clock.seconds(frame.pts) if frame.pts is not None else 0.0
            k += 1

        try:
            for packet in self.container.demux(self.stream):
                m = clock.number(packet.pts) if packet.pts is not None else None
                if skip and m is not None and m < last and m not in want:
                    cc.skip_frame = "NONREF"  # decoded only if later frames refer to it
                    skipped.append(m)
                else:
                    cc.skip_frame = "DEFAULT"
                for frame in packet.decode():
                    n = clock.number(frame.pts) if frame.pts is not None else prev_n + 1
                    if n < prev_n:
                        continue  # stamped before a frame already shown: out of order, never shown
                    if prev is None and n > numbers[0] and not final:
                        raise _Redo  # the seek landed past the clip's first frame: from earlier
                    if k < len(numbers) and numbers[k] < n:  # numbers no frame has: the last one before stands
                        if any(prev_n < s < n for s in skipped):
                            raise _Redo  # ... unless the one before was left undecoded
                        while k < len(numbers) and numbers[k] < n:
                            take(prev if prev is not None else frame)
                    while k < len(numbers) and numbers[k] == n:
                        take(frame)
                    prev, prev_n = frame, n
                    if k == len(numbers):
                        return out, stamps
        except av.FFmpegError as exc:
            if prev is None:
                raise DecodeError(f"the video does not decode: {exc}") from None
            # a truncated or damaged tail: what was decoded stands, the rest is short
        finally:
            cc.skip_frame = "DEFAULT"
        if prev is None:
            if not final:
                raise _Redo
            raise DecodeError("the video stream has no frame")
        if any(s > prev_n for s in skipped):
            raise _Redo  # the video ended before the clip, and its last frame may be one left undecoded
        if not pad and numbers[-1] > prev_n + 1:  # (one frame of slack: a count estimated from a duration)
            raise ShortVideo(f"the video ends at frame {prev_n} ({clock.seconds(prev.pts or 0):.2f} s), before its "
                             f"clip ends at frame {numbers[-1]}")
        while k < len(numbers):  # the last frame stands for the rest (past the end: short="pad")
            take(prev)
        return out, stamps

    def _convert(self, frame: Any, box: tuple[float, float, float, float], size: tuple[int, int],
                 flip: bool) -> np.ndarray:
        """One frame's ``box`` at ``size``: the whole frame scaled so the box lands on ``size`` (one swscale pass,
        at the smaller size where the box is shrunk), then cut; a box that must grow is cut first, then grown."""
        oh, ow = size
        x0, y0, x1, y1 = box
        sx, sy = ow / (x1 - x0), oh / (y1 - y0)
        width, height = frame.width, frame.height
        if sx <= 1.0 and sy <= 1.0:
            sw, sh = max(ow, round(width * sx)), max(oh, round(height * sy))
            rgb = self._reformat.reformat(frame, width=sw, height=sh, format="rgb24",
                                          interpolation="BILINEAR").to_ndarray()
            left = min(max(0, round(x0 * sx)), sw - ow)
            top = min(max(0, round(y0 * sy)), sh - oh)
            img = rgb[top : top + oh, left : left + ow]
        else:
            from PIL import Image

            rgb = self._reformat.reformat(frame, format="rgb24").to_ndarray()
            img = np.asarray(Image.fromarray(rgb).resize((ow, oh), Image.Resampling.BILINEAR, box=box))
        return img[:, ::-1] if flip else img

    def audio(self, start: float, seconds: float, rate: int) -> np.ndarray:
        """Mono float32 samples at ``rate`` from ``start`` for ``seconds`` (zeros where the video has none)."""
        import av

        n = max(1, round(seconds * rate))
        out = np.zeros(n, np.float32)
        if not self.container.streams.audio:
            return out
        stream = self.container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        try:
            self.container.seek(int(max(0.0, start) / float(stream.time_base)), stream=stream, backward=True)
            for frame in self.container.decode(stream):
                t = frame.time or 0.0
                for r in resampler.resample(frame):
                    samples = r.to_ndarray().reshape(-1)
                    at = round((t - start) * rate)
                    lo, hi = max(0, at), min(n, at + len(samples))
                    if hi > lo:
                        out[lo:hi] = samples[lo - at : hi - at]
                    t += len(samples) / rate
                if t >= start + seconds:
                    break
        except av.FFmpegError:
            pass  # a damaged audio track: silence where it fails
        return out


def open_clips(member: bytes, threads: int = 1) -> tuple[Any, VideoInfo, ClipReader]:
    """(the open container — close it —, its header, a reader of clips from it)."""
    container = _open(member)
    try:
        info = info_of(container, len(member))
        return container, info, ClipReader(container, info, threads)
    except BaseException:
        container.close()
        raise
