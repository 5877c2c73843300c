"""``--trace-keys``: the key of every sample a run trained, an audit that outlives the process.

A path with ``{epoch}`` in it gets one file per epoch (``keys/epoch-{epoch}.txt``), so an audit can check
each epoch on its own — every sample exactly once — across SIGTERMs and resumes (``feedline soak`` does);
a plain path gets every key in one file. Files are appended to line by line and flushed with each
checkpoint, whose meta records where the trace stood (``position()``); a resumed run cuts the trace back
there (``rewind()``), so the steps a crash lost (trained after the last checkpoint, then trained again
from it) are in the trace once, as they are in the model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TextIO


def trace_line(key: str) -> str:
    """A key as one line of the trace: a backslash and every character that is not printable (a newline, a
    carriage return, an escape sequence, a Unicode line separator) written as its Python escape, so a sample's key
    (shard content, not trusted) can never forge or hide a line of the audit. A plain key is written as it is."""
    if key.isprintable() and "\\" not in key:
        return key
    return "".join(c if c.isprintable() and c != "\\" else _escape(c) for c in key)


def _escape(c: str) -> str:
    n = ord(c)
    return "\\\\" if c == "\\" else f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


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
        self._file.write("".join(f"{trace_line(k)}\n" for k in keys))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def position(self) -> dict[str, int] | None:
        """Where the trace stands (the open file's epoch and size), for a checkpoint's meta; None before any key."""
        if self._file is None or self._epoch is None:
            return None
        self._file.flush()
        return {"epoch": self._epoch, "bytes": self._file.tell()}

    def rewind(self, position: dict[str, int] | None) -> None:
        """Cut the trace back to a checkpoint's ``position()``: later epochs' files go, the epoch's file is truncated.

        A checkpoint saved before the first key (None) leaves the trace as it is: there is nothing it could
        know was written after it.
        """
        if position is None:
            return
        self.close()
        epoch, size = int(position["epoch"]), int(position["bytes"])
        path = self.file_of(epoch)
        if "{epoch}" in self.path:
            later = epoch + 1
            while os.path.exists(self.file_of(later)):
                os.remove(self.file_of(later))
                later += 1
        if os.path.exists(path) and os.path.getsize(path) > size:
            with open(path, "r+b") as f:
                f.truncate(size)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "KeyTrace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
