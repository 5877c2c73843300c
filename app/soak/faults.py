"""The faults of a soak run and when they happen, as fractions of the run so a 3-minute run has them all."""

from __future__ import annotations

from dataclasses import dataclass

WORKER_KILL = "worker_kill"  # SIGKILL one decode worker: the loader replaces it, nothing lost or repeated
SIDECAR_KILL = "sidecar_kill"  # SIGKILL the sampler sidecar, start it again: it recovers the cache
STORE_DOWN = "store_down"  # stop the store for a while, then start it again on the same port
TRAINER_STOP = "trainer_stop"  # SIGTERM the trainer (it saves a checkpoint), start it again with --resume
KINDS = (WORKER_KILL, SIDECAR_KILL, STORE_DOWN, TRAINER_STOP)


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule."""

    at: float  # seconds after the run started
    kind: str
    seconds: float = 0.0  # how long it lasts (the store's downtime)


def schedule(duration: float, worker_every: float = 300.0, store_down: float = 30.0) -> list[Fault]:
    """Every kind of fault at least once, spread over the run: a worker killed every ``worker_every`` seconds
    (at most a twelfth of the run), the trainer stopped at 20 and 85 %, the sidecar killed at 30 and 70 %,
    the store down at 45 % for ``store_down`` seconds (at most a tenth of the run). The trainer's middle life is
    the run's longest: what it grows by is judged after a warm-up as long as the first life's."""
    every = min(worker_every, duration / 12)
    faults = [Fault(every * k, WORKER_KILL) for k in range(1, int(duration / every)) if every * k < duration * 0.97]
    faults += [Fault(duration * f, TRAINER_STOP) for f in (0.2, 0.85)]
    faults += [Fault(duration * f, SIDECAR_KILL) for f in (0.3, 0.7)]
    faults.append(Fault(duration * 0.45, STORE_DOWN, min(store_down, duration / 10)))
    return sorted(faults, key=lambda f: f.at)
