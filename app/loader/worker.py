"""The worker process: read members, decode, transform, write straight into a ring slot.

A worker serves one command at a time from its pipe. It keeps the stream
position it is decoding in the ring's status table, so that when it dies the
trainer knows which sample was in hand and a replacement can resume exactly
after the last batch it delivered.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..formats.decoders import DecodeError, Decoder
from ..formats.shard_index import Sample
from .messages import DONE, END, EPOCH, ERROR_REASONS, FILL, STOP, BatchResult, decode_fill, decode_json, encode_fatal
from .plan import stream_seed
from .ring import BatchRing, RingHandle
from .spec import SampleRejected, fill
from .stream import SampleRef, ShardProblem, open_ahead, sample_stream

log = logging.getLogger("feedline.worker")
_REASON = {r: i for i, r in enumerate(ERROR_REASONS)}
_LOG_FIRST = 5  # per reason and epoch; the counters carry the rest


@dataclass
class WorkerArgs:
    worker_id: int
    conn: Connection
    ring: RingHandle
    decoder: Decoder
    transform: Callable[[dict[str, Any]], dict[str, Any]] | None
    shuffle_buffer: int
    drop_last: bool
    log_level: int


class _Epoch:
    """One epoch's stream and the counters of the batch being filled."""

    def __init__(self, plan: dict[str, Any], shuffle_buffer: int):
        self.epoch: int = plan["epoch"]
        self.poison = set(plan.get("poison", ()))
        seed = stream_seed(plan["seed"], plan["epoch"], plan["rank"], plan["worker"])
        self.fds = open_ahead(plan["shards"])
        self.stream: Iterator[SampleRef | ShardProblem] = sample_stream(plan["shards"], shuffle_buffer, seed,
                                                                         self.fds)
        self.pos = 0  # samples consumed
        self.done = False
        self.logged: dict[str, int] = {}
        # transforms draw from `random` and `np.random`: seed both from the stream, reproducibly
        random.seed(seed)
        np.random.seed(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "little"))
        self._skip_to(int(plan.get("resume", 0)))

    def _skip_to(self, resume: int) -> None:
        while self.pos < resume:
            item = next(self.stream, None)
            if item is None:
                self.done = True
                return
            if isinstance(item, SampleRef):
                item.shard.release()
                self.pos += 1

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


class Worker:
    def __init__(self, args: WorkerArgs):
        self.args = args
        self.ring: BatchRing = args.ring.attach()
        self.fields = self.ring.layout.fields
        self.sources = self.ring.layout.spec.sources
        self.wanted = self.sources if args.transform is None else None
        self.epoch: _Epoch | None = None

    def serve(self) -> None:
        conn = self.args.conn
        while True:
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                return  # the trainer is gone
            kind = msg[:1]
            if kind == FILL:
                epoch, slot, batch = decode_fill(msg)
                if self.epoch is None or epoch != self.epoch.epoch:
                    conn.send_bytes(self._result(END, epoch, slot, batch, 0, [0] * len(ERROR_REASONS)).encode())
                else:
                    conn.send_bytes(self._fill(slot, batch).encode())
            elif kind == EPOCH:
                if self.epoch is not None:
                    self.epoch.close()
                self.epoch = _Epoch(decode_json(msg), self.args.shuffle_buffer)
            elif kind == STOP:
                return

    def _result(self, kind: bytes, epoch: int, slot: int, batch: int, n: int, errors: list[int],
                decode_ns: int = 0, read_bytes: int = 0, decoded_bytes: int = 0) -> BatchResult:
        pos = self.epoch.pos if self.epoch is not None else 0
        return BatchResult(kind, epoch, slot, batch, n, pos, decode_ns, read_bytes, decoded_bytes, tuple(errors))

    def _fill(self, slot: int, batch: int) -> BatchResult:
        ep = self.epoch
        assert ep is not None
        views = self.ring.slot(slot)
        status = self.ring.status[self.args.worker_id]
        batch_size = self.ring.layout.batch_size
        errors = [0] * len(ERROR_REASONS)
        n = read_bytes = decoded_bytes = 0
        t0 = time.perf_counter_ns()
        while n < batch_size and not ep.done:
            item = next(ep.stream, None)
            if item is None:
                ep.done = True
                break
            if isinstance(item, ShardProblem):
                errors[_REASON[item.reason]] += 1
                ep.note(item.reason, item.message)
                continue
            pos = ep.pos
            ep.pos += 1
            if pos in ep.poison:
                item.shard.release()
                errors[_REASON["worker_crash"]] += 1
                ep.note("worker_crash", f"{item.shard.path} sample {item.sample.key!r} crashed a worker twice; skipped")
                continue
            status[0], status[1] = ep.epoch, pos
            try:
                r, d = self._write_sample(item, views, n)
                read_bytes += r
                decoded_bytes += d
                n += 1
            except SampleRejected as exc:
                errors[_REASON[exc.reason]] += 1
                ep.note(exc.reason, f"{item.shard.path} sample {item.sample.key!r}: {exc}; skipped")
            except DecodeError as exc:
                errors[_REASON["corrupt"]] += 1
                ep.note("corrupt", f"{item.shard.path} sample {item.sample.key!r}: {exc}; skipped")
            except Exception as exc:  # a decoder or the user's transform failed on this sample
                errors[_REASON["corrupt"]] += 1
                ep.note("corrupt", f"{item.shard.path} sample {item.sample.key!r}: {type(exc).__name__}: {exc}; skipped")
            finally:
                item.shard.release()
        status[1] = -1
        elapsed = time.perf_counter_ns() - t0
        if n == 0 or (n < batch_size and self.args.drop_last):
            return self._result(END, ep.epoch, slot, batch, 0, errors, elapsed, read_bytes, 0)
        return self._result(DONE, ep.epoch, slot, batch, n, errors, elapsed, read_bytes, decoded_bytes)

    def _write_sample(self, item: SampleRef, views: dict[str, Any], i: int) -> tuple[int, int]:
        data = item.shard.view()
        try:
            sample, read = load_sample(data, item.shard.path, item.sample, self.args.decoder, self.wanted,
                                       self.args.transform, self.sources)
            written = 0
            for f in self.fields:
                written += fill(f, views[f.name], sample[f.source], views.get(f.length_name), i)
            sample.clear()
            return read, written
        finally:
            data.release()


def load_sample(data: memoryview, path: str, ref: Sample, decoder: Decoder, wanted: set[str] | None,
                transform: Callable[[dict[str, Any]], dict[str, Any]] | None,
                sources: set[str]) -> tuple[dict[str, Any], int]:
    """Decode (only the wanted members) and transform one sample; (sample, bytes read)."""
    sample: dict[str, Any] = {"__key__": ref.key, "__shard__": path}
    read = 0
    for ext, (off, size) in ref.fields.items():
        if wanted is None or ext in wanted:
            sample[ext] = decoder(ext, data[off : off + size])
            read += size
    if transform is not None:
        sample = transform(sample)
        if not isinstance(sample, dict):
            raise TypeError(f"the transform returned a {type(sample).__name__}, not a dict")
    missing = sources.difference(sample)
    if missing:
        have = sorted(k for k in sample if not k.startswith("__"))
        raise SampleRejected("missing_field", f"has no field {sorted(missing)} (it has {have})")
    return sample, read


def _die_with_parent() -> None:
    """Ask the kernel to kill this worker if the trainer dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_main(args: WorkerArgs) -> None:
    """Entry point of a worker process (spawned; never forked after CUDA)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    _die_with_parent()
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s feedline.worker[{args.worker_id}] %(message)s",
    )
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
        worker.ring.close()
