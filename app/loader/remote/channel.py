"""A place's own TCP stream between its proxy and its actor: the encoded samples out, each finished slot back
straight into its ring slot.

Through Ray, each batch costs the GPU host's CPU a call (its arguments copied into a message, the message handed
to gRPC's threads) and a reply (a 5 MB slot copied four times: the kernel's, gRPC's, the reply object's, the
ring's): on the bench's machine about 15 % of the core the local worker decodes on. On this stream a call is one
``sendmsg`` of the members straight from the shard's mapping (the kernel's copy only) and a slot is one
``recv_into`` its ring slot. Ray stays the control plane: it places and ends the actor, carries the key, and says
when the actor is gone.

The proxy listens; its actor connects back and proves itself with a key the proxy gave it through Ray (which
carries it under the cluster's token). Frames, each way in order: a call (its sequence number, the batch's token,
the first row, the JSON index, the members back to back), and an answer (the call's number, the JSON record of the
verdicts, the slot's bytes). The actor reads calls on a thread of its own, so neither side can block the other by
writing while the other writes. Only bytes and JSON cross; nothing is unpickled.
"""

from __future__ import annotations

import hmac
import os
import queue
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

_CALL = struct.Struct("<QQQQQ")  # call number, batch token, first row, index bytes, member bytes
_ANSWER = struct.Struct("<QQQ")  # call number, record bytes, slot bytes
KEY_BYTES = 32
TIMEOUT = 120.0  # seconds a frame may take: as long as a call may
POLL = 0.5  # seconds between asking whether the actor is still there while no frame comes
MAX_RECORD = 16 << 20  # a record's bytes (the verdicts of a batch's samples) past which the stream is broken
_IOV = 512  # buffers a sendmsg takes at once (the kernel's limit is 1024)


class Call(NamedTuple):
    """A chunk of a batch to decode, as the actor reads it."""

    seq: int
    token: int
    start: int
    index: bytes
    members: np.ndarray


class ActorChannel:
    """The actor's end: connected back to its proxy, reading calls and sending answers."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    @classmethod
    def connect(cls, host: str, port: int, key: bytes) -> "ActorChannel | None":
        try:
            sock = socket.create_connection((host, port), timeout=10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(key)
            sock.settimeout(None)  # calls come when the proxy has batches to send: reading waits for them
            return cls(sock)
        except OSError:
            return None

    def read_calls(self, into: "queue.SimpleQueue[Call | None]") -> None:
        """Every call until the proxy closes the stream (or it breaks), then None: the actor's reading thread."""
        try:
            while True:
                head = _read_exactly(self.sock, _CALL.size)
                if head is None:
                    return
                seq, token, start, index_bytes, member_bytes = _CALL.unpack(head)
                if index_bytes > MAX_RECORD:
                    return
                index = _read_exactly(self.sock, index_bytes) if index_bytes else b""
                members = np.empty(member_bytes, np.uint8)
                if index is None or not _read_into(self.sock, memoryview(members)):
                    return
                into.put(Call(seq, token, start, index, members))
        except OSError:
            return
        finally:
            into.put(None)

    def send(self, seq: int, record: bytes, slot: np.ndarray) -> None:
        _send_all(self.sock, [_ANSWER.pack(seq, len(record), slot.nbytes), record, memoryview(slot).cast("B")])

    def close(self) -> None:
        self.sock.close()


class ProxyChannel:
    """The proxy's end: a listening socket, the connection of its current actor, calls sent and answers read into
    ring slots."""

    def __init__(self, host: str, slot_bytes: int):
        self.listener = socket.create_server((host, 0))
        self.host = host
        self.port = self.listener.getsockname()[1]
        self.key = b""
        self.conn: socket.socket | None = None
        self._scratch = np.empty(slot_bytes, np.uint8)

    def new_key(self) -> bytes:
        """A key for the next actor; the connection of the one before is closed."""
        self.drop()
        self.key = os.urandom(KEY_BYTES)
        return self.key

    def accept(self, given_up: Callable[[], bool], timeout: float = 30.0) -> bool:
        """The actor that was given the current key, connected; False if it has ``given_up`` (it could not reach
        this address) or none did within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not select.select([self.listener], [], [], 0.1)[0]:
                    if given_up():
                        return False
                    continue
                conn, _ = self.listener.accept()
                conn.settimeout(10)
                got = _read_exactly(conn, KEY_BYTES)
                if got is not None and hmac.compare_digest(got, self.key):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conn.settimeout(TIMEOUT)
                    self.conn = conn
                    return True
                conn.close()  # an earlier actor's, or not an actor of ours
        except OSError:
            pass
        return False

    def send_call(self, seq: int, token: int, start: int, index: bytes, members: Sequence[memoryview]) -> int:
        """Call ``seq``: rows ``start``... of batch ``token`` from ``members`` (views of the shards' mappings, sent
        from there); the bytes it took. OSError when the stream is broken."""
        if self.conn is None:
            raise OSError("no stream")
        size = sum(m.nbytes for m in members)
        _send_all(self.conn, [_CALL.pack(seq, token, start, len(index), size), index, *members])
        return _CALL.size + len(index) + size

    def receive(self, seq: int, into: memoryview, ended: Callable[[], bool]) -> tuple[int, bytes]:
        """Call ``seq``'s answer: its slot into ``into`` (earlier calls' frames dropped), (the slot's size, its
        record). OSError when the stream fails or the actor ``ended`` with no answer (it is gone, or failed)."""
        conn = self.conn
        if conn is None:
            raise OSError("no stream")
        while True:
            while not select.select([conn], [], [], POLL)[0]:  # a node that vanished sends no FIN: ask Ray
                if ended() and not select.select([conn], [], [], 0)[0]:
                    raise OSError(f"the actor ended without answering call {seq}")
            head = _read_exactly(conn, _ANSWER.size)
            if head is None:
                raise OSError("the stream ended")
            got, record_bytes, size = _ANSWER.unpack(head)
            if size > len(into) or record_bytes > MAX_RECORD:
                raise OSError(f"an answer of {size} bytes and a record of {record_bytes}, over a slot's {len(into)}")
            record = _read_exactly(conn, record_bytes)
            target = into if got == seq else memoryview(self._scratch)
            if record is None or not _read_into(conn, target[:size]):
                raise OSError("the stream ended in a frame")
            if got == seq:
                return size, record
            if got > seq:
                raise OSError(f"the stream skipped call {seq}")

    def readable(self) -> bool:
        """An answer's first bytes are here."""
        return self.conn is not None and bool(select.select([self.conn], [], [], 0)[0])

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def close(self) -> None:
        self.drop()
        self.listener.close()


def _send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """``sendall`` of several buffers in one system call each round (no joining copy)."""
    views = [memoryview(b) for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views[:_IOV])
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _read_exactly(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if _read_into(conn, memoryview(buf)) else None


def _read_into(conn: socket.socket, view: memoryview) -> bool:
    """False when the stream ended before ``view`` was full."""
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True
