"""``feedline bench``'s options: apart from the runner, so that building the CLI's parser imports nothing else."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", nargs="?", choices=("loaders", "scale"), default="loaders",
                   help="loaders: this loader against its peers (the default); scale: the scale simulation, a billion "
                        "samples, 100,000 shards, 4,096 ranks on made-up inputs (docs/scale.md)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seconds", type=float, default=4.0, help="measured time per contender and round")
    p.add_argument("--rounds", type=int, default=5, help="rounds; contenders interleaved in a rotating order")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of each contender's discarded warm-up run")
    p.add_argument("--quick", action="store_true",
                   help="one round, no warm-up run, at most 1 s each, two contenders at a time, each forked from one "
                        "process that imported torch: checks that everything runs (not a measurement)")
    p.add_argument("--raw-samples", type=int, default=1024, help="1 MiB samples in the raw workload")
    p.add_argument("--jpeg-samples", type=int, default=4000)
    p.add_argument("--sample-size", default="1MiB")
    p.add_argument("--small-samples", type=int, default=20000, help="3x64x64 samples in the small workload")
    p.add_argument("--video-samples", type=int, default=96, help="4 s H.264 videos in the video workload")
    p.add_argument("--workloads",
                   default="raw,small,jpeg,captioned,video,scaling,sampler,distributed,e2e,shuffle,launch,placement,remote")
    p.add_argument("--e2e-model", choices=("resnet50", "tiny"), default="resnet50",
                   help="e2e: the training step's model (tiny: a CPU check of the path, not a measurement)")
    p.add_argument("--e2e-steps", type=int, default=50, help="e2e: timed steps per run")
    p.add_argument("--e2e-batch-size", type=int, default=256)
    p.add_argument("--shm", default="/dev/shm", help="where the shards live during the run")
    p.add_argument("--cache-dir", default=".cache")
    p.add_argument("--json", default="docs/benchmarks.json")
    p.add_argument("--markdown", default="docs/benchmarks.md")
    p.add_argument("--scale-json", default="docs/scale.json", help="scale: where its results go")
    p.add_argument("--scale-markdown", default="docs/scale.md", help="scale: where its report goes")
    p.add_argument("--host", default="", help="label of this machine in the report (default: detected)")
    p.add_argument("--peers", choices=("auto", "on", "off"), default="auto",
                   help="raw and JPEG rows for Mosaic Streaming, LitData, tf.data and HF datasets, run from .venv-peers "
                        "(scripts/setup-peers); auto: when it is installed")
    p.add_argument("--fast-peers", choices=("auto", "on", "off"), default="auto",
                   help="raw and JPEG rows for NVIDIA DALI's CPU pipeline and SPDL, run from .venv-fast "
                        "(scripts/setup-fast-peers); auto: when it is installed")
