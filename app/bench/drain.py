"""A loader run at full tilt beside a step that does not use its batches: a thread takes every batch and drops it.

What it isolates is contention alone — the loader's processes, threads and copies competing with the step for
the host's CPUs — apart from the step waiting for data (``e2e.py``'s ``synthetic-beside`` on a GPU,
``placement_bench.py``'s ``beside`` on the CPU stand-in).
"""

from __future__ import annotations

import threading
from typing import Any


class Drain:
    """Owns the draining thread; ``close()`` stops it, then closes the loader."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.drained = 0  # batches taken: the loader beside did run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-drain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in self.loader:
                self.drained += 1
                if self._stop.is_set():
                    return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.loader.close()

    def __enter__(self) -> "Drain":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
