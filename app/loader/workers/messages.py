"""The wire format between the trainer process and its workers.

Only small integers and per-batch counters cross the process boundary, packed
with ``struct``; the rare epoch command is JSON. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import signal
import struct
from typing import Any, NamedTuple

from ..plan.epoch_plan import WorkerPlan
from ..stats import ERROR_REASONS  # the wire order of the per-reason counts

STACK_SIGNAL = signal.SIGUSR1  # the trainer asks a worker for its stack with this (a stall, a start that hangs)
EPOCH = b"E"  # parent -> worker: a JSON WorkerPlan; abandons any earlier epoch
FILL = b"F"  # parent -> worker: fill this slot with your next batch
STOP = b"S"  # parent -> worker: exit
READY = b"R"  # worker -> parent: started, ring mapped, stack dumps armed
DONE = b"D"  # worker -> parent: slot filled with n samples
END = b"N"  # worker -> parent: stream exhausted, slot returned unused
FATAL = b"X"  # worker -> parent: JSON {"message"}: cannot go on

_FILL = struct.Struct("<III")
_RESULT = struct.Struct("<IIIIqQQQBIQQ" + "I" * len(ERROR_REASONS))


def encode_epoch(plan: WorkerPlan) -> bytes:
    return EPOCH + plan.to_json().encode()


def decode_epoch(msg: bytes) -> WorkerPlan:
    return WorkerPlan.from_json(msg[1:])


def encode_fill(epoch: int, slot: int, batch: int) -> bytes:
    return FILL + _FILL.pack(epoch, slot, batch)


def decode_fill(msg: bytes) -> tuple[int, int, int]:
    return _FILL.unpack_from(msg, 1)  # type: ignore[return-value]


class BatchResult(NamedTuple):
    """What a worker reports with each slot it hands back (a tuple: the trainer decodes one a batch)."""

    kind: bytes  # DONE or END
    epoch: int
    slot: int
    batch: int  # the worker-local batch number
    samples: int
    stream_pos: int  # samples consumed from the worker's stream after this batch
    decode_ns: int
    read_bytes: int
    decoded_bytes: int
    errors: tuple[int, ...]
    remote: int = 0  # 1: decoded by a remote actor (remote/), 0: in this worker process
    redone: int = 0  # times the batch was decoded again after a remote actor was lost
    sent: int = 0  # bytes of encoded samples sent to a remote actor
    received: int = 0  # bytes of slots received from it

    def encode(self) -> bytes:
        return self.kind + _RESULT.pack(
            self.epoch, self.slot, self.batch, self.samples, self.stream_pos,
            self.decode_ns, self.read_bytes, self.decoded_bytes, self.remote, self.redone,
            self.sent, self.received, *self.errors,
        )

    @classmethod
    def decode(cls, msg: bytes) -> "BatchResult":
        v = _RESULT.unpack_from(msg, 1)
        return cls(msg[:1], *v[:8], v[12:], *v[8:12])


def encode_fatal(message: str) -> bytes:
    return FATAL + json.dumps({"message": message}).encode()


def decode_json(msg: bytes) -> dict[str, Any]:
    return json.loads(msg[1:])
