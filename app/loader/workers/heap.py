"""A worker's malloc settings: large sample buffers reused, not handed back to the kernel at every free.

glibc's malloc serves a request above its mmap threshold (128 KiB at start) with a fresh mapping that it
unmaps on free, and trims the heap's top whenever more than its trim threshold lies free there. A worker
that copies 1 MiB values (a TFRecord feature, a Parquet cell) then faults in and zeroes every page of every
copy: about 60 % of its time on raw 1 MiB TFRecords here, which read 4x faster once the buffers are reused.
So a worker raises both thresholds: such buffers come from the heap and are reused. The trim threshold
keeps up to ``TRIM`` bytes free at the heap's top; free memory below live blocks stays resident as it always
did, and a fixed mmap threshold of 32 MiB is where glibc's own adaptation ends anyway. A worker's private
memory is therefore a little higher and steadier; ``worker_memory`` still bounds it, and the soak checks
that it stays flat over a run. Where malloc is not glibc's (musl), nothing changes.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("feedline.loader")

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP = 32 << 20  # glibc's own ceiling for its adaptive mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM = 64 << 20  # twice that, as glibc's adaptation sets it


def reuse_large_buffers() -> bool:
    """Raise this process's mmap and trim thresholds; False where malloc takes no such settings."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM) == 1
    if not done:
        log.debug("malloc took no mmap/trim thresholds: large buffers are mapped per use")
    return done
