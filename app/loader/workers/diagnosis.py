"""What a worker is doing, and the errors that say so when the loader's hand-off stops moving (the dispatcher's).

Read from the ring's status table alone (no file is read: the worker may hang on one), with each worker's
Python stack logged from its faulthandler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import LoaderError
from ..plan.epoch_plan import EpochPlan
from ..ring.batch_ring import OPENING, SKIPPING
from ..watchdog import STALL_HINT, Heartbeat
from .supervisor import Supervisor

log = logging.getLogger("feedline.loader")


def doing(supervisor: Supervisor, plan: EpochPlan | None, epoch: int, w: int) -> str:
    """What worker ``w`` is doing in ``epoch``, or ""."""
    hand = supervisor.in_hand(w)
    if (plan is None or hand.epoch != epoch or w >= plan.workers
            or not 0 <= hand.shard < len(plan.assignment[w])):
        return ""
    path = plan.path_of(plan.assignment[w][hand.shard])
    if hand.pos >= 0:
        return f"decoding {path} sample {supervisor.key_in_hand(w)!r} (stream position {hand.pos})"
    if hand.pos == OPENING:
        return f"opening {path}"
    if hand.pos == SKIPPING:
        return f"skipping to its resume position in {path} ({hand.index} samples skipped)"
    return ""


def late_start(supervisor: Supervisor, beat: Heartbeat, w: int, bound: float) -> LoaderError:
    """A worker that has not finished starting: its stack logged, the error that names it."""
    beat.beat(f"reading the stack of worker {w}, late to start")
    stack = supervisor.stack_of(w)
    log.error("worker %d has not finished starting; its stack:\n%s", w, stack or "(none written)")
    return LoaderError(
        f"worker {w} has not finished starting for {bound:.0f} s (stall_timeout={bound:g}): a new worker imports "
        f"feedline and torch, then the training script if the transform is defined there, then unpickles the "
        f"transform; its stack in the log shows where it waits. {STALL_HINT}")


def no_progress(supervisor: Supervisor, beat: Heartbeat, bound: float, doing_of: Callable[[int], str],
                busy: Callable[[int], bool]) -> LoaderError:
    """The loop waited ``bound`` seconds and no worker moved: what each does, their stacks logged."""
    doing_now = []
    for w in range(supervisor.workers):
        beat.beat(f"reading the stack of worker {w}")
        stack = supervisor.stack_of(w)
        what = doing_of(w) or ("idle" if not busy(w) else "holding a batch")
        doing_now.append(f"worker {w}: {what}")
        log.error("worker %d (%s); its stack:\n%s", w, what, stack or "(none written)")
    return LoaderError(
        f"the training loop has waited {bound:g} s (stall_timeout) for a batch and no worker made progress "
        f"({'; '.join(doing_now)}); their stacks are in the log. Set worker_timeout to replace a worker that hangs "
        f"on a sample. {STALL_HINT}")
