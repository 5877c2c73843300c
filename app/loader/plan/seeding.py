"""Random draws that follow the sample, not the history: every sample reseeds the worker's generators.

A transform draws from ``random``, ``np.random`` and torch's default generator.
Seeded once per epoch, what it draws for a sample would depend on every sample the
worker drew for before it: a resume, a replaced worker or a different split would give
other pixels. Seeded from the sample itself — (seed, epoch, shard name, key) — a
sample gets the same draws in an uninterrupted run, after an exact or an elastic
resume, after a worker is replaced, on any rank and in any worker.

A transform's class may say which of the three it draws from (``generators``, e.g.
``("random",)``): the others are left alone. Reseeding ``np.random`` and torch costs
about 9 µs a sample in a decode worker, where the decode between samples leaves their
code cold; feedline's own transforms draw from ``random`` only.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

import numpy as np

from ...formats.transforms import GENERATORS


def sample_seed(seed: int, epoch: int, shard: str, key: str, repeat: int = 0) -> int:
    """A 64-bit seed of one sample of one epoch; the shard is named by its file name, so a cache's copy of a
    shard seeds as the store's does. ``repeat``: the pass of a mixture's source read more than once in the
    epoch, so each repeat of a sample gets its own draws."""
    return key_seed(seed_prefix(seed, epoch, shard), key, repeat)


def seed_prefix(seed: int, epoch: int, shard: str) -> str:
    """What the seeds of one shard's samples in one epoch share: a worker makes it once a shard."""
    return f"feedline-sample:{seed}:{epoch}:{os.path.basename(shard)}:"


def key_seed(prefix: str, key: str, repeat: int = 0) -> int:
    """``sample_seed`` of the sample ``key`` of the shard and epoch of ``prefix`` (``seed_prefix``)."""
    text = f"{prefix}{key}:{repeat}" if repeat else prefix + key
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def reseed(value: int, generators: frozenset[str] = GENERATORS) -> None:
    """Seed ``random``, ``np.random`` and (when loaded) torch's CPU generator from ``value``, those of
    ``generators`` (all three: about 10 µs; ``random`` alone: a fifth of it)."""
    if "random" in generators:
        random.seed(value)
    if "numpy" in generators:
        np.random.seed(value & 0xFFFFFFFF)
    torch = sys.modules.get("torch") if "torch" in generators else None
    if torch is not None:  # the default generator only: torch.manual_seed would also seed CUDA (~0.3 ms)
        torch.default_generator.manual_seed(value)
