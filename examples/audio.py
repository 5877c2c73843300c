"""Audio members, decoded by a decoder of yours: ``.flac`` clips through soundfile (libsndfile).

feedline hands audio and video members (flac mp3 wav ogg m4a mp4 webm avi mkv ...) over as bytes,
as webdataset does when torchaudio/torchvision are not asked for. ``decode={"flac": decode_flac}``
decodes them in the worker processes instead; a transform then makes every clip one length, so the
batch is one float32 tensor in the shared-memory ring.

    pip install soundfile                              # or: pip install 'feedline[audio]'
    python examples/audio.py "clips/shard-{000000..000009}.tar"   # shards with .flac and .cls members
    python examples/audio.py --demo /tmp/clips         # writes 3 shards of synthetic clips first

The decoder and the transform are module-level, so the worker processes import them from this
file; the loop runs under ``if __name__ == "__main__":`` so importing the file starts nothing.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import random
import tarfile

import numpy as np

from feedline import StagingLoader

RATE = 16_000  # samples per second of the clips, and of the demo's


def decode_flac(data: memoryview) -> np.ndarray:
    """A mono float32 waveform; soundfile reads FLAC, WAV, OGG/Vorbis and MP3 (libsndfile >= 1.1)."""
    import soundfile

    audio, _rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return audio.mean(axis=1)


class FixedLength:
    """Crops a clip at a random place (seeded per sample by feedline: the same crop on every rerun) or pads it."""

    def __init__(self, samples: int):
        self.samples = samples

    def __call__(self, sample: dict) -> dict:
        clip = sample["flac"]
        if len(clip) >= self.samples:
            start = random.randint(0, len(clip) - self.samples)
            sample["flac"] = clip[start : start + self.samples]
        else:
            sample["flac"] = np.pad(clip, (0, self.samples - len(clip)))
        return sample


def write_demo(directory: str, shards: int = 3, per_shard: int = 8) -> str:
    """Shards of sine tones (0.5 to 1.5 s, three pitches as three classes), written with tarfile: their brace list."""
    import soundfile

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    for s in range(shards):
        with tarfile.open(os.path.join(directory, f"clips-{s:06d}.tar"), "w") as tar:
            for i in range(per_shard):
                n = s * per_shard + i
                label = n % 3
                t = np.arange(int(RATE * rng.uniform(0.5, 1.5))) / RATE
                buf = io.BytesIO()
                soundfile.write(buf, (0.5 * np.sin(2 * np.pi * 220.0 * (label + 1) * t)).astype(np.float32), RATE,
                                format="FLAC")
                for ext, data in (("flac", buf.getvalue()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{n:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return os.path.join(directory, f"clips-{{000000..{shards - 1:06d}}}.tar")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shards", nargs="?", help="shard paths or a brace list (.flac and .cls members)")
    parser.add_argument("--demo", metavar="DIR", help="write synthetic clips into DIR and read those")
    parser.add_argument("--seconds", type=float, default=1.0, help="clip length in the batch")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    shards = write_demo(args.demo) if args.demo else args.shards
    if not shards:
        parser.error("give the shards, or --demo DIR")
    with StagingLoader(shards, batch_size=8, workers=2, fields=["flac", "cls"], decode={"flac": decode_flac},
                       transform=FixedLength(int(RATE * args.seconds)), seed=0) as loader:
        clips = 0
        for batch in loader:
            audio, label = batch["flac"], batch["cls"]
            clips += len(label)
        print(f"read {clips} clips in {len(loader)} batches: flac {str(audio.dtype).removeprefix('torch.')} "
              f"{tuple(audio.shape)}, cls {str(label.dtype).removeprefix('torch.')} {tuple(label.shape)}")


if __name__ == "__main__":
    main()
