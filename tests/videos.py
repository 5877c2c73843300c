"""Small videos made here, with PyAV's own encoders (H.264 through its libx264, VP9 through its libvpx) or with the
``ffmpeg`` command (Debian's FFmpeg 5.1), as a user makes them: each frame one flat colour that draws its number
(its three base-8 digits, one a channel, levels 32 apart: far enough for a lossy codec), so a test reads back
which frames a clip took, whatever its crop. With ``pattern`` the blue channel is a still gradient instead (where
a crop was cut) and the number is two digits (64 frames)."""

from __future__ import annotations

import io
import subprocess
from fractions import Fraction

import numpy as np

MAX_FRAMES = 512  # numbers three base-8 digits draw

def _level(digit: int) -> int:
    return 16 + 32 * digit


def _digit(mean: float) -> int:
    return min(7, max(0, int(round((mean - 16) / 32))))


def colour(i: int, pattern: bool = False) -> tuple[int, int, int]:
    """Frame ``i``'s colour: its number in base 8, a digit a channel (blue stays 128 with ``pattern``)."""
    assert 0 <= i < (64 if pattern else MAX_FRAMES), i
    return _level(i % 8), _level(i // 8 % 8), 128 if pattern else _level(i // 64)


def frame_index(image: np.ndarray, pattern: bool = False) -> int:
    """The number a decoded frame's colour draws."""
    r, g, b = (_digit(float(image[..., c].mean())) for c in (0, 1, 2))
    return r + 8 * g + (0 if pattern else 64 * b)


def frame_image(i: int, size: tuple[int, int], pattern: bool = False) -> np.ndarray:
    """Frame ``i`` as an RGB array of ``size`` (width, height)."""
    w, h = size
    img = np.empty((h, w, 3), np.uint8)
    img[...] = colour(i, pattern)
    if pattern:  # the same in every frame: where a crop was cut shows in the blue channel
        img[..., 2] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
    return img


def ffmpeg_video(path: str, codec: str = "h264", frames: int = 50, fps: int | Fraction = 25,
                 size: tuple[int, int] = (64, 48), gop: int = 12) -> str:
    """The same numbered frames encoded by the ``ffmpeg`` command into ``path`` (its extension picks the container),
    with ffmpeg's own defaults but for the codec, the keyframe interval and the quality."""
    w, h = size
    codec_args = (["-c:v", "libx264", "-crf", "18"] if codec == "h264" else
                  ["-c:v", "libvpx-vp9", "-crf", "20", "-b:v", "0", "-deadline", "realtime", "-cpu-used", "8"])
    raw = b"".join(frame_image(i, size).tobytes() for i in range(frames))
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{w}x{h}",
                    "-r", str(fps), "-i", "-", *codec_args, "-g", str(gop), "-pix_fmt", "yuv420p", path],
                   input=raw, check=True)
    return path


def video_bytes(codec: str = "h264", frames: int = 50, fps: int | Fraction = 25, size: tuple[int, int] = (64, 48),
                gop: int = 12, times: list[float] | None = None, audio: bool = False, container: str | None = None,
                pattern: bool = False) -> bytes:
    """A video of ``frames`` flat frames (``pattern``: a still gradient in blue, for crop tests); ``times`` gives
    each frame's time in seconds (a variable frame rate); ``audio`` adds a 440 Hz tone."""
    import av

    fmt = container or ("webm" if codec == "vp9" else "mp4")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        vs = out.add_stream("libx264" if codec == "h264" else "libvpx-vp9", rate=fps)
        vs.width, vs.height = size
        vs.pix_fmt = "yuv420p"
        vs.options = {"g": str(gop), "crf": "18"} if codec == "h264" else {"g": str(gop), "crf": "20", "b": "0",
                                                                           "deadline": "realtime", "cpu-used": "8"}
        if times is not None:
            vs.codec_context.time_base = Fraction(1, 1000)
        aus = None
        if audio:
            aus = out.add_stream("aac" if fmt == "mp4" else "libopus", rate=48000)
            aus.layout = "mono"
        w, h = size
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_image(i, size, pattern), format="rgb24")
            if times is not None:
                frame.pts, frame.time_base = round(times[i] * 1000), Fraction(1, 1000)
            for packet in vs.encode(frame):
                out.mux(packet)
        for packet in vs.encode():
            out.mux(packet)
        if aus is not None:
            seconds = (times[-1] if times else frames / fps) + 0.1
            t = np.arange(int(seconds * 48000)) / 48000
            tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
            chunk = 1024
            for k in range(0, len(tone) - chunk, chunk):
                af = av.AudioFrame.from_ndarray(tone[None, k : k + chunk], format="flt", layout="mono")
                af.sample_rate, af.pts = 48000, k
                for packet in aus.encode(af):
                    out.mux(packet)
            for packet in aus.encode():
                out.mux(packet)
    return buf.getvalue()
