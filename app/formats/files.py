"""Writing files so that a reader never sees half of one (DESIGN.md, Cache directory).

Write to a temporary name beside the target, fsync, rename over the target,
fsync the directory. A crash leaves either the old file or the new one, plus at
worst a temporary file that ``sweep_temporaries`` recognises by its suffix.
"""

from __future__ import annotations

import glob
import os
from typing import BinaryIO

TMP_MARK = ".tmp."  # <target>.tmp.<pid>: the only temporary names this project writes
FILE_MODE = 0o600  # what feedline creates gives other users no write and no read (docs/security.md)
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def create_new(path: str, mode: int = FILE_MODE) -> BinaryIO:
    """A new file at ``path``, opened for writing: never one that was there, never through a symbolic link.

    A name that exists (a file a killed writer of this pid left, or a link planted there) is removed first —
    the name, never what a link points to — and created again exclusively, so nothing outside is written.
    """
    try:
        fd = os.open(path, _NEW, mode)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, _NEW, mode)
    return os.fdopen(fd, "wb")


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: str | bytes, durable: bool = True, mode: int = FILE_MODE) -> None:
    """Replace ``path`` with ``data`` in one step; ``durable`` also fsyncs the file and its directory."""
    tmp = f"{path}{TMP_MARK}{os.getpid()}"
    try:
        with create_new(tmp, mode) as f:
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
