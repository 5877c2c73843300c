"""The decode actor: a Ray actor on a CPU machine that turns a worker place's encoded samples into a batch slot.

It runs the worker's own ``SampleWriter`` on the same bytes with each sample's own seed, into a private buffer
laid out exactly as a ring slot, so the proxy lands it in its slot with one copy and the batch is bit-identical
with one decoded on the training node. It keeps the rows of its proxy's last few batches (``kept``): a batch that
needs more samples than its first chunk (bad ones were skipped) continues at ``start``.

What goes back is small and plain: the slot's bytes and a JSON record of each sample's verdict, on the proxy's own
stream (``serve``) or, where that cannot connect, in Ray's replies (``decode``).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from typing import Any

import numpy as np

from ...formats.images import own_pillow
from ...formats.sample_index import Sample
from ..layout.spec import Spec
from ..plan.seeding import reseed
from ..ring.batch_ring import RingLayout
from ..workers.sample_writer import SampleWriter, rejection
from .channel import ActorChannel, Call


def layout_of(d: dict[str, Any]) -> RingLayout:
    """A ring slot's layout from the fields of a ``RingHandle``'s JSON (no descriptor: the actor maps nothing)."""
    return RingLayout(Spec.from_json(d["spec"]), d["batch_size"], d["side_bytes"], bool(d.get("labelled", False)))


class DecodeActor:
    """One worker place's decoder on a Ray node (wrapped with ``ray.remote`` by ``link.py``)."""

    def __init__(self, code: Any, ring: dict[str, Any], kept: int = 4):
        own_pillow()  # this process decodes for feedline: Pillow's bomb limit from max_member_bytes
        self.layout = layout_of(ring)
        self.writer = SampleWriter(self.layout, code)
        self.batch_size = self.layout.batch_size
        self.batches: dict[int, _Batch] = {}  # the proxy's batches in flight, and those given back and formed again
        self.kept = kept

    def ready(self) -> int:
        return os.getpid()

    def serve(self, host: str, port: int, key: bytes) -> bool:
        """Decode the calls that come on the proxy's own stream (``channel.py``) until the proxy closes it; False at
        once where the proxy cannot be reached (its calls come through Ray then, to ``decode``). Its call stays
        running while the place's batches come: its end is how the proxy hears that the actor is gone."""
        stream = ActorChannel.connect(host, port, key)
        if stream is None:
            return False
        calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        reader = threading.Thread(target=stream.read_calls, args=(calls,), name="feedline-calls", daemon=True)
        reader.start()  # calls are read while a slot is sent: neither end ever waits on the other's writing
        try:
            while (call := calls.get()) is not None:
                record, slot = self._decode(call.token, call.start, call.index, call.members)
                stream.send(call.seq, record, slot)
        finally:
            stream.close()
        return True

    def decode(self, token: int, start: int, index: bytes, blob: np.ndarray) -> tuple[bytes, np.ndarray]:
        """A call through Ray, where the proxy's stream could not connect: (the JSON record, the batch's slot)."""
        return self._decode(token, start, index, blob)

    def _decode(self, token: int, start: int, index: bytes, blob: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Decode the samples ``index`` lists (JSON: path, key, [[ext, offset, size]...], seed, source; the
        offsets into ``blob``) into rows ``start``... of batch ``token``; (a JSON record of the verdicts and
        counts, the batch's slot)."""
        if start == 0:
            b = self.batches.pop(token, None)
            while len(self.batches) >= self.kept:  # the oldest: the proxy has its answer
                self.batches.pop(next(iter(self.batches)))
            b = b or _Batch(self.layout)
            b.n, b.side = 0, 0
            self.batches[token] = b
        else:
            b = self.batches.get(token)
            if b is None or start != b.n:
                raise RuntimeError(f"batch {token} continued at row {start}, but this actor holds "
                                   f"{b.n if b else 'none'} of its rows")
        data = memoryview(blob)
        failed = []
        read = written = 0
        writer = self.writer
        writer.side.offset = b.side  # the batch's side values pack on after its earlier rows'
        t0 = time.perf_counter_ns()
        for i, (path, key, fields, seed, source) in enumerate(json.loads(index)):
            if b.n >= self.batch_size:
                raise RuntimeError(f"more samples than the batch's {self.batch_size} rows")
            if seed is not None:
                reseed(seed, writer.reseed)
            try:
                r, w = writer.write(data, path, Sample(key, {e: (o, s) for e, o, s in fields}), b.views, b.n, source)
                read += r
                written += w
                b.n += 1
            except Exception as exc:
                reason, text = rejection(exc)
                failed.append([i, reason, text])
        b.side = writer.side.offset
        record = {"rows": b.n, "failed": failed, "read": read, "written": written,
                  "decode_ns": time.perf_counter_ns() - t0}
        return json.dumps(record).encode(), b.buffer



class _Batch:
    """A batch's slot on the actor, and how far it is filled."""

    def __init__(self, layout: RingLayout):
        self.buffer = np.zeros(layout.slot_bytes, np.uint8)
        self.views = layout.views(self.buffer, 0)
        self.n = 0
        self.side = 0  # where its side values go on
