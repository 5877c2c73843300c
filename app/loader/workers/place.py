"""One worker place: its current process, its pipes read and written without blocking, its restart history.

A message crosses a pipe (``pipes.py``) framed as ``multiprocessing.connection.Connection.send_bytes`` frames
it (a big-endian length, then the bytes); the trainer's side reads and writes the descriptors itself, never
blocking: ``Connection.poll()`` builds a selector a call, which cost more than the rest of a batch's work.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass, field

from .launch import WorkerProcess
from .messages import READY

_HEADER = struct.Struct("!i")  # a message's length, as multiprocessing's Connection frames it
_RECV_BYTES = 1 << 16


@dataclass(frozen=True)
class InHand:
    """What a worker is doing, from the ring's status table (see ``ring.STATUS_WORDS``)."""

    epoch: int
    pos: int  # >= 0: decoding that stream position; IDLE, SKIPPING or OPENING
    shard: int  # ordinal in the worker's shard list
    index: int  # sample index in that shard (SKIPPING: samples skipped so far)


@dataclass
class Place:
    """One worker place: its current process and pipes, and its restart history this epoch."""

    index: int
    process: WorkerProcess | None = None
    results: int = -1  # the read end of its results pipe (non-blocking; -1: no process)
    commands: int = -1  # the write end of its commands pipe (non-blocking)
    outbox: bytearray = field(default_factory=bytearray)
    inbox: bytearray = field(default_factory=bytearray)  # bytes read that do not make a whole message yet
    stack_r: int = -1
    started: bool = False  # it said READY: imports done, the user's code loaded
    seen: InHand | None = None
    progress_at: float = 0.0
    restarts_without_progress: int = 0
    last_crash_pos: int = -1
    poison: set[int] = field(default_factory=set)
    ever_started: bool = False  # a process was started in this place (False: added, not yet started)
    spawned_at: float = 0.0
    ended: bool = False  # its pipe ended (it died) or it is being replaced: nothing more is read from it
    watched: int = 0  # what the dispatcher's selector watches: EVENT_READ its results, EVENT_WRITE its commands

    def receive(self, messages: list[tuple[int, bytes]]) -> bool | None:
        """The whole messages waiting in the pipe, appended to ``messages`` (READY is noted, not appended): True
        if bytes came, None if none were waiting, False at the pipe's end."""
        try:
            data = os.read(self.results, _RECV_BYTES)
        except BlockingIOError:
            return None
        except OSError:
            self.ended = True
            return False
        if not data:
            self.ended = True
            return False
        buf = self.inbox
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf, pos)
            if end - pos - _HEADER.size < n:
                break
            msg = bytes(buf[pos + _HEADER.size : pos + _HEADER.size + n])
            pos += _HEADER.size + n
            if msg == READY:
                self.started, self.progress_at = True, time.monotonic()
            else:
                messages.append((self.index, msg))
        del buf[:pos]
        return True

    def send(self, *msgs: bytes) -> bool:
        """Frame ``msgs`` and send what the pipe takes now, in one write (the caller holds the supervisor's
        out-lock); True when bytes wait in the outbox for the pipe to take them."""
        if self.commands < 0:
            return False  # it is being replaced; the replacement gets its plan and fills anew
        if len(msgs) == 1:
            frame = _HEADER.pack(len(msgs[0])) + msgs[0]
        else:
            frame = b"".join(_HEADER.pack(len(m)) + m for m in msgs)
        if not self.outbox:  # the common case: straight into the pipe, nothing queued before it
            try:
                sent = os.write(self.commands, frame)
            except BlockingIOError:
                sent = 0
            except OSError:
                return False  # it died; its end of file brings the pool to replace(), which resends
            if sent == len(frame):
                return False
            frame = frame[sent:]
        self.outbox += frame
        return self.flush()

    def flush(self) -> bool:
        """Send what the pipe takes now; True if bytes are left."""
        if self.commands < 0:
            self.outbox.clear()
            return False
        try:
            while self.outbox:
                sent = os.write(self.commands, self.outbox)
                del self.outbox[:sent]
        except BlockingIOError:
            pass
        except OSError:
            self.outbox.clear()  # it died; its end of file brings the pool to replace(), which resends
        return bool(self.outbox)
