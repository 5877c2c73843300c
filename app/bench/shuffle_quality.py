"""How well mixed a loader's batches are: the figures of the "shuffle quality" bench section (issue 50).

A dataset written in class order (a folder per class, packed in sorted order) is read one epoch; each batch's
labels and each sample's written position are kept. Three figures compare the order with a uniform permutation's:
the mean number of distinct classes in a batch (and what a uniform shuffle would give, exactly), the mean share of
a batch's largest class, and Spearman's rank correlation between delivery order and written order (0 for a
uniform permutation; a loader that streams shards in order keeps some of the written order).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Quality:
    """The figures of one loader's epoch."""

    batches: int
    distinct: float  # mean distinct classes a batch
    uniform_distinct: float  # the same, expected of a uniform permutation of the same labels
    largest_share: float  # mean share of a batch's most frequent class
    spearman: float  # delivery order vs written position

    @property
    def distinct_ratio(self) -> float:
        return self.distinct / self.uniform_distinct if self.uniform_distinct else 0.0


def expected_distinct(class_sizes: Sequence[int], batch: int) -> float:
    """Distinct classes expected in ``batch`` samples drawn without replacement from classes of these sizes.

    A class is missed when every draw avoids it: C(N - n, b) / C(N, b); the rest is linearity of expectation.
    """
    total = sum(class_sizes)
    out = 0.0
    for n in class_sizes:
        missed = 1.0
        for i in range(batch):  # C(N - n, b) / C(N, b) as a product, no huge integers
            missed *= max(0, total - n - i) / (total - i)
        out += 1.0 - missed
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (no ties in the uses here: positions are distinct)."""
    n = len(xs)
    if n < 2:
        return 0.0

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(n), key=v.__getitem__)
        r = [0.0] * n
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    rx, ry = ranks(xs), ranks(ys)
    mean = (n - 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    var = sum((a - mean) ** 2 for a in rx)
    return cov / var if var else 0.0


def measure(batches: Sequence[Sequence[int]], positions: Sequence[int], labels_of_dataset: Sequence[int],
            batch_size: int) -> Quality:
    """The figures of an epoch: ``batches`` of labels as delivered, ``positions`` the written position of every
    sample in delivery order, ``labels_of_dataset`` every label of the dataset (for the uniform expectation).
    Only full batches count (a last, partial one would lower the mean for every loader alike)."""
    full = [b for b in batches if len(b) == batch_size]
    distinct = sum(len(set(b)) for b in full) / len(full) if full else 0.0
    largest = sum(max(Counter(b).values()) / len(b) for b in full) / len(full) if full else 0.0
    uniform = expected_distinct(list(Counter(labels_of_dataset).values()), batch_size)
    rho = spearman(list(range(len(positions))), [float(p) for p in positions])
    return Quality(len(full), distinct, uniform, largest, 0.0 if math.isnan(rho) else rho)
