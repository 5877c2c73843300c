"""Writing files so that a reader never sees half of one (DESIGN.md, Cache directory).

Write to a temporary name beside the target, fsync, rename over the target,
fsync the directory. A crash leaves either the old file or the new one, plus at
worst a temporary file that ``sweep_temporaries`` recognises by its suffix.
"""

from __future__ import annotations

import glob
import os

TMP_MARK = ".tmp."  # <target>.tmp.<pid>: the only temporary names this project writes


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: str | bytes, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` in one step; ``durable`` also fsyncs the file and its directory."""
    tmp = f"{path}{TMP_MARK}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def sweep_temporaries(directory: str) -> int:
    """Remove the temporary files a killed writer left in ``directory``; returns how many."""
    n = 0
    for p in glob.glob(os.path.join(glob.escape(directory), f"*{TMP_MARK}*")):
        try:
            os.unlink(p)
            n += 1
        except (FileNotFoundError, IsADirectoryError):
            pass
    return n
