"""The slots' own stream from an actor to its proxy: one TCP connection, each slot received straight into its ring
slot.

Through Ray, a 5 MB slot is copied four times in the proxy's process (the kernel's, gRPC's, the reply object's,
the ring's): on the bench's machine about 6 ms of the GPU host's CPU a batch, which its local workers need.
Here the kernel's copy into the ring is the only one. The proxy listens; its actor connects back and proves
itself with a key the proxy gave it through Ray (which carries it under the cluster's token); each slot is a
frame (the call's sequence number, its length, its bytes) written before the call's reply, so the proxy reads
the frame first and then the reply, and frames of calls it gave up on are read and dropped.
"""

from __future__ import annotations

import hmac
import os
import select
import socket
import struct
from collections.abc import Callable

import numpy as np

_HEADER = struct.Struct("<QQ")  # sequence number of the call, bytes that follow
KEY_BYTES = 32
TIMEOUT = 120.0  # seconds a frame may take: as long as a call may
POLL = 0.5  # seconds between looks at the call's reply while no frame comes


class SlotStream:
    """The actor's end: connected back to its proxy."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    @classmethod
    def connect(cls, host: str, port: int, key: bytes) -> "SlotStream | None":
        try:
            sock = socket.create_connection((host, port), timeout=10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(key)
            sock.settimeout(TIMEOUT)
            return cls(sock)
        except OSError:
            return None

    def send(self, seq: int, slot: np.ndarray) -> None:
        self.sock.sendall(_HEADER.pack(seq, slot.nbytes))
        self.sock.sendall(memoryview(slot))


class SlotReceiver:
    """The proxy's end: a listening socket, the connection of its current actor, frames read into ring slots."""

    def __init__(self, host: str, slot_bytes: int):
        self.listener = socket.create_server((host, 0))
        self.listener.settimeout(10)
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

    def accept(self) -> bool:
        """The actor that was given the current key, connected (after it said it had); False if none did."""
        try:
            while True:
                conn, _ = self.listener.accept()
                conn.settimeout(10)
                got = _read_exactly(conn, KEY_BYTES)
                if got is not None and hmac.compare_digest(got, self.key):
                    conn.settimeout(TIMEOUT)
                    self.conn = conn
                    return True
                conn.close()  # an earlier actor's, or not an actor of ours
        except OSError:
            return False

    def receive(self, seq: int, into: memoryview, ended: Callable[[], bool]) -> int:
        """Call ``seq``'s slot into ``into`` (earlier calls' frames dropped); its size. OSError when the
        connection fails or the call ``ended`` with no frame (the actor is gone, or its call failed)."""
        conn = self.conn
        if conn is None:
            raise OSError("no slot stream")
        while True:
            while not select.select([conn], [], [], POLL)[0]:  # a node that vanished sends no FIN: ask Ray
                if ended() and not select.select([conn], [], [], 0)[0]:
                    raise OSError(f"call {seq} ended without its slot on the stream")
            head = _read_exactly(conn, _HEADER.size)
            if head is None:
                raise OSError("the slot stream ended")
            got, size = _HEADER.unpack(head)
            if size > len(into):
                raise OSError(f"a frame of {size} bytes, over a slot's {len(into)}")
            target = into if got == seq else memoryview(self._scratch)
            _read_into(conn, target[:size])
            if got == seq:
                return size
            if got > seq:
                raise OSError(f"the slot stream skipped call {seq}")

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def close(self) -> None:
        self.drop()
        self.listener.close()


def _read_exactly(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _read_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if k == 0:
            raise OSError("the slot stream ended in a frame")
        got += k
