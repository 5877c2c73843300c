"""The supervisor: the worker processes' lifetimes — start, notice a death or a stall, replace, stop.

A worker that dies (killed, a segfaulting decoder) or makes no progress for ``worker_timeout`` seconds
while it holds a slot (a deadlocked decoder, a hung network filesystem) is replaced; the replacement
resumes its stream after the last batch the worker delivered (the epoch's shards inherited: ``held.py``),
so nothing is lost or repeated. A sample in hand at two deaths or stalls of the same worker is skipped
next time and counted; one killed above ``worker_memory`` (``memory.py``) counts as a death. A worker that
keeps dying without delivering is a ``LoaderError``, and so is one not started within ``stall_timeout``.

Only the pool's dispatcher thread starts, replaces and stops processes and selects on their
sentinels; ``send()``, ``drain()`` and ``wake()`` serve any thread under the pool's lock (the
consumers read their batches' results from the pipes themselves, so the dispatcher is woken only
for what it must do: a start, a death, a pipe that is full, its tick). The memory watcher's thread
reads the processes under the lock ``_forget()`` drops them under. Messages to a worker never block
the sender: each worker has an outbox, flushed as its pipe takes bytes, so a stalled worker cannot
stall the dispatcher that would notice.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import LoaderError
from ..ring.batch_ring import BatchRing
from ..watchdog import Heartbeat
from .launch import Launcher, WorkerProcess
from .held import HeldShards
from .memory import MemoryWatcher, over_ceiling
from .messages import STOP
from .place import InHand, Place
from .stacks import read_stack

log = logging.getLogger("feedline.loader")

MAX_RESTARTS_WITHOUT_PROGRESS = 3
STOP_WAIT = 2.0  # seconds the workers get, together, to exit after STOP before they are killed
class Supervisor:
    """Owns W worker processes and their pipes."""

    def __init__(self, ring: BatchRing, launcher: Launcher, setup: dict[str, Any], workers: int,
                 worker_timeout: float, on_restart: Callable[[str], None], beat: Heartbeat | None = None,
                 worker_memory: int = 0, cpus_of: Callable[[int], tuple[int, ...]] | None = None):
        self._ring = ring
        self._cpus_of = cpus_of  # worker k's CPUs (CPU placement), or None: where the kernel puts it
        self._beat = beat or Heartbeat("the supervisor")  # says what the dispatcher does when it may block
        self.last_progress = time.monotonic()  # a message from a worker, or a change in the status table
        self._launcher = launcher
        self._setup = setup
        indexes = setup.get("indexes")  # the trainer's descriptors a worker inherits: the ring's, the shared indexes'
        self._shared_fds = [ring.memory.fd, *([int(indexes["fd"])] if indexes else [])]
        self.worker_timeout = worker_timeout
        self._on_restart = on_restart
        self._procs = [Place(i) for i in range(workers)]
        self._selector = selectors.DefaultSelector()
        self._fd_lock = threading.Lock()  # wake() against close(): never write into a reused fd number
        self._out_lock = threading.Lock()  # outboxes, pipes, processes: send(), the memory watcher vs _forget()
        self._memory = MemoryWatcher(worker_memory, self._live, self._out_lock) if worker_memory > 0 else None
        self.held = HeldShards()  # the epoch's shards, for a replacement to inherit (held.py)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))

    def start_all(self) -> None:
        """Start every worker (from the dispatcher thread: a worker dies with the thread that started it)."""
        for p in self._procs:
            self._spawn(p)
        if self._memory is not None:
            self._memory.start()

    @property
    def workers(self) -> int:
        return len(self._procs)

    def add(self, workers: int) -> None:
        """Places for workers up to ``workers`` (any thread, under the pool's lock); ``start_new`` starts them."""
        if workers > self._ring.workers:
            raise LoaderError(f"the ring has status rows for {self._ring.workers} workers, not {workers}")
        self._procs += [Place(i) for i in range(len(self._procs), workers)]

    def start_new(self) -> list[int]:
        """Start the added workers (the dispatcher thread); their indexes."""
        new = [p for p in self._procs if p.process is None and not p.ever_started]
        for p in new:
            self._spawn(p)
        return [p.index for p in new]

    def started(self, worker: int) -> bool:
        """A process runs in this worker place (an added place may not have one yet)."""
        return self._procs[worker].commands >= 0

    def ready(self) -> bool:
        """Every worker finished starting (imports done): a pool that grew may hand them work without a wait."""
        return all(p.started for p in self._procs)

    # -- events -------------------------------------------------------------------------------------

    def wake(self) -> None:
        """Make a ``wait`` in progress return now (any thread may call this)."""
        with self._fd_lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass

    def wait(self, timeout: float) -> tuple[list[tuple[int, bytes]], list[int]]:
        """(messages from workers still starting, workers that died), after at most ``timeout`` seconds.

        The dispatcher's: it watches the sentinels, the pipes of workers that have not said READY and
        those with bytes waiting to be sent; a started worker's results wait in its pipe for ``drain``.
        """
        messages: list[tuple[int, bytes]] = []
        dead: list[int] = []
        self._watch()
        for key, events in self._selector.select(timeout):
            kind, p = key.data
            if kind == "wake":
                os.read(self._wake_r, 4096)
                continue
            if kind == "dead":
                dead.append(p.index)
                continue
            if events & selectors.EVENT_WRITE:
                with self._out_lock:
                    p.flush()
            if events & selectors.EVENT_READ and not self._receive(p, messages):
                dead.append(p.index)
        return messages, list(dict.fromkeys(dead))

    def drain(self, workers: Iterable[int] | None = None) -> list[tuple[int, bytes]]:
        """The whole messages waiting in these workers' pipes (every worker's by default), without blocking.

        Any thread, under the pool's lock: a consumer reads the results it waits for itself.
        """
        messages: list[tuple[int, bytes]] = []
        procs = self._procs
        for w in (range(len(procs)) if workers is None else workers):
            p = procs[w]
            if p.results >= 0 and not p.ended:
                self._receive(p, messages)
        return messages

    def retire(self, worker: int) -> None:
        """Read nothing more from this worker (under the pool's lock): it stalled and is replaced once its stack is
        read, and a result it might still send meanwhile is not its stream's any more."""
        self._procs[worker].ended = True

    def pipe_of(self, worker: int) -> int:
        """The fd a consumer may select on for this worker's results, or -1 (none now: being replaced)."""
        p = self._procs[worker]
        return p.results if not p.ended else -1

    def _receive(self, p: Place, messages: list[tuple[int, bytes]]) -> bool:
        """Read what ``p``'s pipe holds into ``messages``; False at its end."""
        got = p.receive(messages)
        if got:
            self.last_progress = time.monotonic()
        return got is not False

    def send(self, worker: int, *msgs: bytes) -> bool:
        """Queue messages (framed as ``Connection.send_bytes`` frames them) and send what the pipe takes now.

        Any thread may send (the pool serializes them); True when bytes wait for the pipe: the dispatcher's
        next ``wait`` sends them, so a sender other than the dispatcher then calls ``wake()``.
        """
        p = self._procs[worker]
        with self._out_lock:
            return p.send(*msgs)

    def _watch(self) -> None:
        """Select (the dispatcher, before it selects) on exactly the pipes of workers still starting and
        those with bytes waiting to be sent."""
        for p in self._procs:
            if p.results < 0:
                continue
            events = (0 if p.started or p.ended else selectors.EVENT_READ) | (
                selectors.EVENT_WRITE if p.outbox else 0)
            changed = events ^ p.watched
            for event, fd in ((selectors.EVENT_READ, p.results), (selectors.EVENT_WRITE, p.commands)):
                if changed & event:
                    if events & event:
                        self._selector.register(fd, event, ("conn", p))
                    else:
                        self._selector.unregister(fd)
            p.watched = events

    def progressed(self, worker: int) -> None:
        """The worker delivered a batch: its restarts so far were not in vain."""
        p = self._procs[worker]
        p.restarts_without_progress = 0
        p.progress_at = time.monotonic()

    def in_hand(self, worker: int) -> InHand:
        return InHand(*self._ring.status[worker].tolist())

    def key_in_hand(self, worker: int) -> str:
        return self._ring.key_in_hand(worker)

    def stalled(self, busy: Callable[[int], bool]) -> list[int]:
        """Workers that hold a slot and changed nothing in the status table for ``worker_timeout`` seconds
        (one still starting is ``late_starts``'s); any change counts as progress (``last_progress``)."""
        now = time.monotonic()
        out = []
        for p in self._procs:
            if p.process is None or not busy(p.index):
                p.seen, p.progress_at = None, now
                continue
            seen = self.in_hand(p.index)
            if seen != p.seen:
                if p.seen is not None:
                    self.last_progress = now
                p.seen, p.progress_at = seen, now
            elif self.worker_timeout > 0 and p.started and now - p.progress_at > self.worker_timeout:
                out.append(p.index)
        return out

    def shift_clocks(self, gap: float) -> None:
        """Move every deadline ``gap`` seconds later: the process was stopped that long (Ctrl-Z, a debugger)."""
        self.last_progress += gap
        for p in self._procs:
            p.spawned_at += gap
            p.progress_at += gap

    def late_starts(self, bound: float, needed: int) -> list[int]:
        """Workers among the first ``needed`` started over ``bound`` seconds ago that have not said READY."""
        now = time.monotonic()
        return [p.index for p in self._procs[:needed]
                if p.process is not None and not p.started and now - p.spawned_at > bound]

    def stack_of(self, worker: int) -> str:
        """Every thread's Python stack of a (stalled, or late to start) worker, written by its faulthandler."""
        p = self._procs[worker]
        return read_stack(p.process, p.stack_r) if p.process is not None else ""

    # -- epochs and restarts --------------------------------------------------------------------------

    def new_epoch(self) -> None:
        for p in self._procs:
            p.poison = set()
            p.last_crash_pos = -1

    def poison(self, worker: int) -> tuple[int, ...]:
        return tuple(sorted(self._procs[worker].poison))

    def replace(self, worker: int, reason: str, epoch: int, where: str = "", doing: str = "") -> None:
        """Start another process in place of ``worker`` (dead, or stalled: killed here).

        One the memory watcher killed is replaced for the reason "memory", whatever the caller saw.
        """
        p = self._procs[worker]
        hand = self.in_hand(worker)
        proc = p.process
        code = self._forget(p)
        held = self._memory.killed(proc) if self._memory is not None and proc is not None else None
        if hand.epoch == epoch and hand.pos >= 0:
            if hand.pos == p.last_crash_pos:
                p.poison.add(hand.pos)  # the same sample took it down twice: skip it next time
            p.last_crash_pos = hand.pos
        p.restarts_without_progress += 1
        if held is not None and self._memory is not None:
            reason, (what, where, hint) = "memory", over_ceiling(self._memory.ceiling, held, doing)
        else:
            what, where = ("died" if reason == "crashed" else "stalled"), f" (exit code {code})" + where
            hint = "see the worker log above"
        self._on_restart(reason)
        log.warning("worker %d %s%s; replacing it", worker, what, where)
        if p.restarts_without_progress > MAX_RESTARTS_WITHOUT_PROGRESS:
            raise LoaderError(
                f"worker {worker} {what} {p.restarts_without_progress} times without delivering a batch "
                f"(last exit code {code}); {hint}"
            )
        self._spawn(p)

    # -- processes ------------------------------------------------------------------------------------

    def _spawn(self, p: Place) -> None:
        self._ring.status[p.index] = (-1, -1, -1, -1)
        self._beat.beat(f"starting worker {p.index}")
        proc, ends, stack_r = self._launcher.start(p.index, self._setup, self._shared_fds, self.held.fds,
                                                   self._cpus_of(p.index) if self._cpus_of is not None else ())
        self._beat.beat()
        p.process, p.stack_r = proc, stack_r
        p.results, p.commands = ends
        p.outbox.clear()
        p.inbox.clear()
        p.started, p.seen, p.progress_at, p.ever_started = False, None, time.monotonic(), True
        p.spawned_at, p.ended = p.progress_at, False
        self._selector.register(p.results, selectors.EVENT_READ, ("conn", p))
        p.watched = selectors.EVENT_READ
        if proc.sentinel is not None:
            self._selector.register(proc.sentinel, selectors.EVENT_READ, ("dead", p))

    def _forget(self, p: Place) -> int | None:
        """Kill a worker if it still runs, drop its pipes and handle; its exit code."""
        watched = (p.results if p.watched & selectors.EVENT_READ else None,
                   p.commands if p.watched & selectors.EVENT_WRITE else None,
                   p.process.sentinel if p.process is not None else None)
        for obj in watched:
            if obj is not None:
                try:
                    self._selector.unregister(obj)
                except (KeyError, ValueError):
                    pass
        p.watched = 0
        with self._out_lock:
            fds, proc = (p.results, p.commands, p.stack_r), p.process
            p.results, p.commands, p.stack_r, p.process = -1, -1, -1, None  # before closing: no second close
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        if proc is None:
            return None
        self._beat.beat(f"stopping worker {p.index}")
        proc.kill()
        proc.join(timeout=2.0)
        proc.close()
        self._beat.beat()
        return proc.exitcode

    def _live(self) -> list[tuple[int, WorkerProcess]]:
        """(index, process) of every worker process not yet dropped (the memory watcher's, under ``_out_lock``)."""
        return [(p.index, p.process) for p in self._procs if p.process is not None]

    def kill_all(self) -> None:
        """Kill and reap every worker from another thread, when the dispatcher is stuck (it closes the rest
        if it ever comes back)."""
        if self._memory is not None:
            self._memory.stop(wait=False)
        for p in list(self._procs):
            proc = p.process
            if proc is not None:
                proc.kill()
                proc.join(timeout=1.0)

    def pids(self) -> list[int | None]:
        return [p.process.pid if p.process is not None else None for p in self._procs]

    def close(self, graceful: bool = True) -> None:
        """Ask every worker to stop, give them ``STOP_WAIT`` together, kill what is left, close every pipe."""
        if self._memory is not None:
            self._memory.stop()
        self.held.close()
        if graceful:
            for p in self._procs:
                self.send(p.index, STOP)
            deadline = time.monotonic() + STOP_WAIT
            for p in self._procs:
                if p.process is not None:
                    p.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            self._forget(p)
        self._selector.close()
        with self._fd_lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
