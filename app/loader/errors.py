"""The loader's runtime error (misconfiguration is ``feedline.errors.SettingError``), and the budget of bad samples
an epoch may skip before it is one."""

from __future__ import annotations

from dataclasses import dataclass


class LoaderError(RuntimeError):
    """The pipeline cannot go on; raised in the training loop at the next ``next()``."""


@dataclass
class ErrorBudget:
    """``limit`` >= 1 is a count of bad samples per epoch; below 1 it is a fraction of samples seen."""

    limit: float

    def exceeded(self, errors: int, samples: int, final: bool) -> bool:
        if self.limit >= 1:
            return errors > self.limit
        seen = errors + samples
        return (final or seen >= 100) and seen > 0 and errors / seen > self.limit
