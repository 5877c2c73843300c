"""Small videos made here with PyAV's own encoders (H.264 through its libx264, VP9 through its libvpx): each frame
one flat colour that says its index (red: its index mod 16, green: its index div 16, levels far apart enough for
a lossy codec), so a test reads back which frames a clip took, whatever its crop."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

def colour(i: int) -> tuple[int, int, int]:
    """Frame ``i``'s colour (64 frames at most)."""
    return (i % 16) * 16 + 8, (i // 16) * 64 + 32, 128


def frame_index(image: np.ndarray) -> int:
    """The index a decoded frame's colour says."""
    r, g = (float(image[..., c].mean()) for c in (0, 1))
    return int(round((r - 8) / 16)) + 16 * int(round((g - 32) / 64))


def video_bytes(codec: str = "h264", frames: int = 50, fps: int = 25, size: tuple[int, int] = (64, 48),
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
            img = np.empty((h, w, 3), np.uint8)
            img[...] = colour(i)
            if pattern:  # the same in every frame: where a crop was cut shows in the blue channel
                img[..., 2] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
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
