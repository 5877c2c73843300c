"""The loader's runtime error (misconfiguration is ``app.errors.SettingError``)."""

from __future__ import annotations


class LoaderError(RuntimeError):
    """The pipeline cannot go on; raised in the training loop at the next ``next()``."""
