"""``--trace-keys``: the key of every sample a run trained, an audit that outlives the process.

A path with ``{epoch}`` in it gets one file per epoch (``keys/epoch-{epoch}.txt``), so an audit can check
each epoch on its own — every sample exactly once — across SIGTERMs and resumes (``feedline soak`` does);
a plain path gets every key in one file. Files are appended to line by line, and flushed with each
checkpoint, so a resumed run's trace goes on where the checkpoint left it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TextIO


class KeyTrace:
    """Appends keys to the trace file of their epoch; owns the one file open at a time (``close()``)."""

    def __init__(self, path: str):
        self.path = path
        self._file: TextIO | None = None
        self._epoch: int | None = None

    def file_of(self, epoch: int) -> str:
        """The trace file of ``epoch`` (the one file, for a path without ``{epoch}``)."""
        return self.path.replace("{epoch}", str(epoch))

    def write(self, epoch: int, keys: Iterable[str]) -> None:
        """Append a step's keys to the file of ``epoch``, opening it (and closing the last) when the epoch changes."""
        if self._file is None or (self._epoch != epoch and "{epoch}" in self.path):
            self.close()
            path = self.file_of(epoch)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._file = open(path, "a", buffering=1)  # line by line: an audit
            self._epoch = epoch
        self._file.write("".join(f"{k}\n" for k in keys))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "KeyTrace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
