"""The worker process: read members, decode, transform, write straight into a ring slot.

A worker serves one command at a time from its pipe. It keeps the sample it is
decoding (stream position, shard, index) in the ring's status table, so that
when it dies or stalls the trainer knows which sample was in hand, and a
replacement can resume exactly after the last batch it delivered. On SIGUSR1
it writes every thread's Python stack to the stack pipe (``faulthandler``),
which is how the trainer shows where a stalled worker hangs.
"""

from __future__ import annotations

import faulthandler
import hashlib
import importlib
import logging
import os
import random
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ...formats.decoders import Decoder
from ...formats.images import own_pillow
from ..layout.sample import FieldSelection
from ..plan.epoch_plan import WorkerPlan
from ..plan.seeding import key_seed, reseed, seed_prefix
from ..plan.stream import SampleRef, ShardProblem, open_ahead, sample_stream
from ..ring.batch_ring import IDLE, OPENING, SKIPPING, STATUS_KEY_BYTES, BatchRing, RingHandle
from .index_share import IndexShare
from .messages import (
    DONE,
    END,
    EPOCH,
    ERROR_REASONS,
    STACK_SIGNAL,
    FILL,
    READY,
    STOP,
    BatchResult,
    decode_epoch,
    decode_fill,
    encode_fatal,
)
from .pipes import Duplex
from .sample_writer import SampleWriter, rejection

log = logging.getLogger("feedline.worker")
_REASON = {r: i for i, r in enumerate(ERROR_REASONS)}
_LOG_FIRST = 5  # per reason and epoch; the counters carry the rest
REMOTE_PROXY = "feedline.loader.remote.proxy"  # the worker of a place decoded on a Ray cluster


@dataclass(frozen=True)
class WorkerCode:
    """The user's code a worker runs — decoders, field selection, transform — pickled once by the launcher."""

    decoder: Decoder
    selection: FieldSelection
    transform: Callable[[dict[str, Any]], dict[str, Any]] | None


@dataclass(frozen=True)
class WorkerSetup:
    """A worker's plain settings: the ring it maps and how it reads (JSON on its command line)."""

    ring: RingHandle
    shuffle_buffer: int
    drop_last: bool
    log_level: int
    shuffle_block: int = 0  # > 0: the epoch shuffle, this many shards permuted at once (stream.block_order)
    remote: dict[str, Any] | None = None  # a RemoteDecode's JSON (address resolved): remote/proxy.py
    remote_places: tuple[int, ...] = ()  # the worker places decoded by it
    indexes: dict[str, Any] | None = None  # the loader's shared shard indexes (index_share.py), or None

    def to_json(self) -> dict[str, Any]:
        return {"ring": self.ring.to_json(), "shuffle_buffer": self.shuffle_buffer, "drop_last": self.drop_last,
                "log_level": self.log_level, "shuffle_block": self.shuffle_block, "remote": self.remote,
                "remote_places": list(self.remote_places), "indexes": self.indexes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WorkerSetup":
        return cls(RingHandle.from_json(d["ring"]), d["shuffle_buffer"], d["drop_last"], d["log_level"],
                   int(d.get("shuffle_block", 0)), d.get("remote"), tuple(d.get("remote_places", ())),
                   d.get("indexes"))


@dataclass
class WorkerArgs:
    """One worker: its number, its pipe to the trainer, where its stack goes on STACK_SIGNAL, what it runs."""

    worker_id: int
    conn: Duplex | Connection  # its pipes to the trainer (pipes.py); a Connection where a test drives it alone
    stack_fd: int
    setup: WorkerSetup
    code: WorkerCode
    shard_fds: dict[str, int] = field(default_factory=dict)  # the trainer's, of the epoch it started in (held.py)


class _Epoch:
    """One epoch's stream and the counters of the batch being filled."""

    def __init__(self, plan: WorkerPlan, shuffle_buffer: int, status: np.ndarray,
                 inherited: dict[str, int] | None = None, block: int = 0, indexes: IndexShare | None = None):
        self.epoch = plan.run  # the token fills and results carry: a restarted epoch has a new one
        self.seed, self.number = plan.seed, plan.epoch  # with the sample: what its random draws are seeded from
        self.poison = set(plan.poison)
        self.labels = plan.labels  # per shard ordinal, its source's name (a mixture)
        self.repeats = plan.repeats  # per shard ordinal, its pass over its source (a mixture)
        self.status = status
        seed = plan.stream_seed
        self.fds = open_ahead(plan.shards, self._opening, inherited)
        self.stream: Iterator[SampleRef | ShardProblem] = sample_stream(plan.shards, shuffle_buffer, seed, self.fds,
                                                                         self._opening, plan.skip, plan.parts, block,
                                                                         indexes)
        self.pos = 0  # samples consumed
        self.done = False
        self.logged: dict[str, int] = {}
        self.prefixes: dict[int, str] = {}  # per shard ordinal, what its samples' seeds share (seeding.seed_prefix)
        # a base for draws outside a sample's transform; each sample reseeds from itself (seeding.py)
        random.seed(seed)
        np.random.seed(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "little"))
        self._skip_to(plan.resume)

    def _opening(self, ordinal: int) -> None:
        self.status[:] = (self.epoch, OPENING, ordinal, -1)

    def _skip_to(self, resume: int) -> None:
        while self.pos < resume:
            item = next(self.stream, None)
            if item is None:
                self.done = True
                break
            if isinstance(item, SampleRef):
                item.shard.release()
                self.pos += 1
                self.status[:] = (self.epoch, SKIPPING, item.shard.ordinal, self.pos)  # progress, for the trainer
        self.status[1] = IDLE

    def close(self) -> None:
        """Close the descriptors this epoch opened ahead and never reached (it was abandoned)."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def note(self, reason: str, message: str) -> None:
        n = self.logged.get(reason, 0)
        if n < _LOG_FIRST:
            log.warning("%s%s", message, " (further ones are counted, not logged)" if n == _LOG_FIRST - 1 else "")
        self.logged[reason] = n + 1


_IN_HAND = struct.Struct("=4q")  # the status row's first words: epoch, stream position, shard, sample
_STATE = struct.Struct("=q")  # its second word alone: IDLE once a sample is done


class Worker:
    """Serves fill commands for one epoch at a time; owns its mapping of the ring."""

    def __init__(self, args: WorkerArgs):
        own_pillow()  # Pillow's bomb limit from max_member_bytes, in this process only (formats/images.py)
        self.args = args
        self.setup, self.code = args.setup, args.code
        self.ring: BatchRing = args.setup.ring.attach()
        self.indexes = IndexShare.attach(args.setup.indexes) if args.setup.indexes else None
        self.status = self.ring.status[args.worker_id]
        self.status_key = self.ring.status_keys[args.worker_id]
        # the same two rows as bytes, for _in_hand's write of every sample (struct and a memoryview: a fraction
        # of numpy's calls)
        self._status_bytes = memoryview(self.status).cast("B")
        self._key_bytes = memoryview(self.status_key).cast("B")
        self.writer = SampleWriter(self.ring.layout, args.code)
        self.epoch: _Epoch | None = None
        self.inherited = dict(args.shard_fds)  # a replacement's: the dead worker's epoch's shards (held.py)

    def close(self) -> None:
        """What the process holds beside its ring (a remote place's actor)."""

    def _drop_inherited(self) -> None:
        for fd in self.inherited.values():
            os.close(fd)
        self.inherited = {}

    def serve(self) -> None:
        conn = self.args.conn
        conn.send_bytes(READY)
        while (command := self._command(conn)) is not None:
            kind, msg, fill = command
            if fill is not None:
                conn.send_bytes(self._fill(*fill).encode())
            elif kind == EPOCH:
                self._new_epoch(msg)
            elif kind == STOP:
                return

    def _command(self, conn: Any, settle: Callable[[], None] = lambda: None
                 ) -> tuple[bytes, bytes, tuple[int, int] | None] | None:
        """The trainer's next command: (its kind, the message, (slot, batch) of a FILL of this epoch); None once the
        trainer is gone. A FILL of another epoch is answered END here, its slot unused (after ``settle()``: the
        answers owed before it)."""
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return None
        kind = msg[:1]
        if kind != FILL:
            return kind, msg, None
        epoch, slot, batch = decode_fill(msg)
        if self.epoch is not None and epoch == self.epoch.epoch:
            return kind, msg, (slot, batch)
        settle()
        conn.send_bytes(self._result(END, epoch, slot, batch, 0, [0] * len(ERROR_REASONS)).encode())
        return kind, msg, None

    def _new_epoch(self, msg: bytes) -> None:
        """An EPOCH command: the plan's stream from its resume position; an earlier epoch is abandoned."""
        if self.epoch is not None:
            self.epoch.close()
        self.epoch = _Epoch(decode_epoch(msg), self.setup.shuffle_buffer, self.status, self.inherited,
                            self.setup.shuffle_block, self.indexes)
        self._drop_inherited()  # what they were for is open now (dups), or another epoch's

    def _result(self, kind: bytes, epoch: int, slot: int, batch: int, n: int, errors: list[int],
                decode_ns: int = 0, read_bytes: int = 0, decoded_bytes: int = 0,
                remote: tuple[int, int, int, int] = (0, 0, 0, 0), pos: int | None = None) -> BatchResult:
        if pos is None:
            pos = self.epoch.pos if self.epoch is not None else 0
        return BatchResult(kind, epoch, slot, batch, n, pos, decode_ns, read_bytes, decoded_bytes, tuple(errors),
                           *remote)

    def _take(self, errors: list[int]) -> SampleRef | None:
        """The stream's next sample to decode, or None at its end; shard problems and samples that crashed a
        worker twice are counted in ``errors`` on the way."""
        ep = self.epoch
        assert ep is not None
        while not ep.done:
            item = next(ep.stream, None)
            if item is None:
                ep.done = True
                break
            if isinstance(item, ShardProblem):
                errors[_REASON[item.reason]] += 1
                ep.note(item.reason, item.message)
                continue
            ep.pos = item.pos + 1
            if item.pos in ep.poison:
                item.shard.release()
                errors[_REASON["worker_crash"]] += 1
                ep.note("worker_crash", f"{item.shard.path} sample {item.sample.key!r} crashed a worker twice; skipped")
                continue
            return item
        return None

    def _in_hand(self, item: SampleRef) -> None:
        """The sample now decoding, in the status table: what the trainer names if this process dies or stalls."""
        ep = self.epoch
        assert ep is not None
        _IN_HAND.pack_into(self._status_bytes, 0, ep.epoch, item.pos, item.shard.ordinal, item.index)
        key = item.sample.key.encode()[: STATUS_KEY_BYTES - 1] + b"\0"
        self._key_bytes[: len(key)] = key

    def _fill(self, slot: int, batch: int, replay: tuple[SampleRef, ...] = (),
              errors: list[int] | None = None) -> BatchResult:
        """Decode the next batch into ``slot`` here; ``replay``: samples already taken from the stream for this
        batch (a remote decode that was lost), decoded first, with ``errors`` counted while taking them."""
        ep = self.epoch
        assert ep is not None
        views = self.ring.slot(slot)
        batch_size = self.ring.layout.batch_size
        errors = [0] * len(ERROR_REASONS) if errors is None else errors
        n = read_bytes = decoded_bytes = 0
        pending = list(replay)
        pending.reverse()
        self.writer.begin()
        t0 = time.perf_counter_ns()
        while n < batch_size:
            item = pending.pop() if pending else self._take(errors)
            if item is None:
                break
            self._in_hand(item)
            if self.writer.reseed:
                reseed(self._seed_of(item), self.writer.reseed)
            try:
                r, d = self._write_sample(item, views, n)
                read_bytes += r
                decoded_bytes += d
                n += 1
            except Exception as exc:
                reason, text = rejection(exc)
                errors[_REASON[reason]] += 1
                ep.note(reason, f"{item.shard.path} sample {item.sample.key!r}: {text}")
            finally:
                item.shard.release()
                _STATE.pack_into(self._status_bytes, 8, IDLE)  # status[1]: numpy's setitem costs several times it
        for item in pending:  # a full batch before the replay's end cannot happen (the same samples, the same
            item.shard.release()  # verdicts), but a taken sample is never left unreleased
        elapsed = time.perf_counter_ns() - t0
        return self._finish(slot, batch, n, errors, elapsed, read_bytes, decoded_bytes)

    def _finish(self, slot: int, batch: int, n: int, errors: list[int], elapsed: int, read_bytes: int,
                decoded_bytes: int, remote: tuple[int, int, int, int] = (0, 0, 0, 0),
                pos: int | None = None) -> BatchResult:
        """The batch's result; ``remote``: (decoded remotely, times redone, bytes sent, bytes received); ``pos``:
        the stream position after it (default: the stream's now; a remote place reads ahead of its batches)."""
        ep = self.epoch
        assert ep is not None
        if n == 0 or (n < self.ring.layout.batch_size and self.setup.drop_last):
            return self._result(END, ep.epoch, slot, batch, 0, errors, elapsed, read_bytes, 0, remote, pos)
        return self._result(DONE, ep.epoch, slot, batch, n, errors, elapsed, read_bytes, decoded_bytes, remote, pos)

    def _seed_of(self, item: SampleRef) -> int:
        """``sample_seed`` of the sample, its shard's part made once an epoch."""
        ep = self.epoch
        assert ep is not None
        ordinal = item.shard.ordinal
        prefix = ep.prefixes.get(ordinal)
        if prefix is None:
            prefix = ep.prefixes[ordinal] = seed_prefix(ep.seed, ep.number, item.shard.path)
        return key_seed(prefix, item.sample.key, ep.repeats[ordinal] if ep.repeats else 0)

    def _source_of(self, item: SampleRef) -> str | None:
        labels = self.epoch.labels if self.epoch is not None else ()
        return labels[item.shard.ordinal] if labels else None

    def _write_sample(self, item: SampleRef, views: dict[str, Any], i: int) -> tuple[int, int]:
        data = item.shard.view()
        try:
            return self.writer.write(data, item.shard.path, item.sample, views, i, self._source_of(item))
        finally:
            data.release()


def worker_main(args: WorkerArgs) -> None:
    """Serve fill commands until STOP or the trainer goes (``launch.child`` set up the process and its
    stack dumps)."""
    logging.basicConfig(
        level=args.setup.log_level, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s feedline.worker[{args.worker_id}] %(message)s",
    )
    setup = args.setup
    if setup.remote is not None and args.worker_id in setup.remote_places:
        # remote/ builds on this stage (its proxy is a Worker): named, not imported, so imports run one way; it
        # imports Ray, in a proxy process only
        proxy = importlib.import_module(REMOTE_PROXY)
        worker: Worker = proxy.RemoteWorker(args, proxy.RemoteDecode.from_json(setup.remote))
    else:
        worker = Worker(args)
    try:
        worker.serve()
    except Exception as exc:
        log.exception("worker %d failed", args.worker_id)
        try:
            args.conn.send_bytes(encode_fatal(f"worker {args.worker_id}: {type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        worker.close()
        worker.ring.close()
        faulthandler.unregister(STACK_SIGNAL)
        os.close(args.stack_fd)
