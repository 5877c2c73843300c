"""Feedline starts and replaces workers while something else in the process forks (issue 20).

Run as a script by tests/test_fork_safety.py, under a deadline: a worker start that blocks shows as a
timeout there, and faulthandler (armed below) writes every thread's stack to stderr before the kill.

    python tests/fork_race.py dataloader ROUNDS SHARD...   fork-start DataLoaders with persistent workers
    python tests/fork_race.py forker ROUNDS SHARD...       a thread that forks in a tight loop

Each round builds a StagingLoader (its dispatcher starts 2 workers) while the other side forks, reads a
whole epoch with one feedline worker SIGKILLed after the first batch (so it is replaced, again while
the other side forks) and checks that every sample came exactly once.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

from feedline import StagingLoader

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks before it kills


class RawSamples(Dataset):
    """1 MiB raw samples, as in the report."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1 << 20,), i % 251, dtype=torch.uint8)


MAX_CHILDREN = 300


class Forker:
    """A thread that forks children that live on (as persistent DataLoader workers do) until ``close``."""

    def __init__(self) -> None:
        self.children: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if len(self.children) >= MAX_CHILDREN:  # enough inherited copies live on; keep the machine usable
                time.sleep(0.05)
                continue
            pid = os.fork()
            if pid == 0:
                time.sleep(300)  # holds every descriptor it inherited, like a worker that never execs
                os._exit(0)
            self.children.append(pid)
            time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for pid in self.children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def read_epoch(loader: StagingLoader, expected: int) -> None:
    ids = []
    killed = False
    for batch in loader:
        ids += batch["cls"].tolist()
        if not killed:  # the dispatcher replaces it: another worker start while the other side forks
            pid = next(p for p in loader._pipeline.pool.worker_pids() if p is not None)
            os.kill(pid, signal.SIGKILL)
            killed = True
    assert sorted(ids) == list(range(expected)), f"{len(ids)} samples, {len(set(ids))} distinct, {expected} wanted"


def dataloader_round(shards: list[str], expected: int) -> None:
    kept = []  # their persistent workers stay alive to the end of the round, holding what they inherited
    for _ in range(2):
        dl = DataLoader(RawSamples(), batch_size=4, num_workers=2, persistent_workers=True)
        kept.append(dl)
    with StagingLoader(shards, batch_size=8, workers=2, zero_copy=True) as loader:
        it = iter(kept[0])  # forks its workers while feedline's dispatcher starts its own
        side = threading.Thread(target=lambda: next(iter(kept[1])))  # forks while a worker is replaced
        side.start()
        read_epoch(loader, expected)
        side.join()
        assert next(it).shape == (4, 1 << 20)
    del it
    kept.clear()  # the DataLoaders go, and their workers with them


def forker_round(shards: list[str], expected: int) -> None:
    forker = Forker()
    try:
        with StagingLoader(shards, batch_size=8, workers=2, zero_copy=True) as loader:
            read_epoch(loader, expected)
    finally:
        forker.close()


def main() -> None:
    mode, rounds, shards = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    expected = int(os.environ.get("FORK_RACE_SAMPLES", "0"))
    run = dataloader_round if mode == "dataloader" else forker_round
    started = time.monotonic()
    for r in range(rounds):
        run(shards, expected)
        print(f"round {r + 1}/{rounds} ok ({time.monotonic() - started:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
