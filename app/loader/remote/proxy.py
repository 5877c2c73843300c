"""A worker place decoded on a Ray cluster: a worker process that reads, a remote actor that decodes.

The proxy is an ordinary worker process of the pool (same pipe, same ring slots, same status table, same
replacement when it dies), so the plan, the order, the resume positions and the failure budget are the local
ones by construction. Per batch it takes the samples its stream gives, sends their encoded bytes (from the shards'
mappings) and seeds to its actor, takes more if some were bad (the verdicts come back), and receives the finished
slot straight into its ring slot, all on the place's own TCP stream (``channel.py``; through Ray's calls and replies
where the actor cannot reach it). The training process does none of this work, and never imports Ray.

Two batches (``inflight=``) are on their way at a time: while the actor decodes one, the next one's bytes travel,
so the actor is not idle through each batch's round trip. A batch's samples are the stream's next ones, which
depend on how many bad samples the batch before it skipped: the next batch is formed assuming none, and when
the one before needed more, the next one's samples go back to the stream's front and it is formed again.

When its cluster is gone (no actor within ``connect_timeout``, or three lost in a row) the proxy decodes the
batches in hand, and every later one, itself: the same code on the same samples, so the loop sees the same
batches (a warning; ``remote=0`` in its results is what the metrics count).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field


from ...formats import tfrecord
from ..plan.stream import SampleRef
from ..ring.batch_ring import IDLE
from ..workers.messages import EPOCH, ERROR_REASONS, FILL, READY, STOP, BatchResult
from ..workers.worker import Worker, WorkerArgs
from .link import ActorLink, Answer, Chunk, Lost, Pending, Unavailable
from .settings import RemoteDecode

log = logging.getLogger("feedline.remote")
_REASON = {r: i for i, r in enumerate(ERROR_REASONS)}
POLL = 0.005  # seconds between looks at the pipe and the answer while a batch is in flight (its slot not streamed)


@dataclass
class _Batch:
    """One batch of this place on its way: its slot, the samples taken for it, what was sent, what came back."""

    slot: int
    number: int  # the worker-local batch number j
    items: list[SampleRef] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # the bytes of each chunk sent
    errors: list[int] = field(default_factory=lambda: [0] * len(ERROR_REASONS))
    pending: Pending | None = None
    generation: int = 0  # the actor its first chunk went to: a later chunk goes to that one or nowhere
    formed: bool = False  # its samples are taken (given back when the batch before it needed more)
    t0: int = 0


@dataclass
class _Answers:
    """What the actor answered for one batch over its calls: the last answer, rows, bytes, verdicts and notes."""

    answer: Answer | None = None
    rows: int = 0
    read: int = 0
    written: int = 0
    received: int = 0
    verdicts: list[int] = field(default_factory=lambda: [0] * len(ERROR_REASONS))
    notes: list[tuple[str, str]] = field(default_factory=list)


class RemoteWorker(Worker):
    """A worker place whose decoding runs on a Ray actor, falling back to this process when the cluster is gone."""

    def __init__(self, args: WorkerArgs, remote: RemoteDecode):
        super().__init__(args)
        selection = args.code.selection
        # the members a sample may be read from (the rest never cross the network); None: all of them
        self._shipped = (selection.extensions | {tfrecord.RECORD} if selection.names is not None
                         else None if self.writer.wanted is None else set(self.writer.wanted) | {tfrecord.RECORD})
        self._pushback: deque[SampleRef] = deque()  # samples taken for a batch formed again: the stream's front
        self.link: ActorLink | None = None
        try:
            self.link = ActorLink(remote, args.worker_id, args.code, args.setup.ring.to_json(),
                                  self.ring.layout.slot_bytes)
            self.link.started(remote.connect_timeout)
        except Lost as exc:
            log.warning("remote: worker place %d decodes here: %s", args.worker_id, exc)
        except Exception as exc:  # ray.init refused (another Ray version, a bad address): decode here, say why
            log.warning("remote: worker place %d decodes here: could not join the Ray cluster at %s: %s: %s",
                        args.worker_id, remote.address, type(exc).__name__, exc)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    # -- the stream, with the samples of batches formed again at its front --------------------------------------

    def _take(self, errors: list[int]) -> SampleRef | None:
        return self._pushback.popleft() if self._pushback else super()._take(errors)

    def _next_pos(self) -> int | None:
        """The stream position after what was delivered so far: the first sample given back, if any."""
        return self._pushback[0].pos if self._pushback else None

    def _finish(self, slot: int, batch: int, n: int, errors: list[int], elapsed: int, read_bytes: int,
                decoded_bytes: int, remote: tuple[int, int, int, int] = (0, 0, 0, 0),
                pos: int | None = None) -> BatchResult:
        return super()._finish(slot, batch, n, errors, elapsed, read_bytes, decoded_bytes, remote,
                               pos if pos is not None else self._next_pos())

    # -- serving ------------------------------------------------------------------------------------------------

    def serve(self) -> None:
        conn = self.args.conn
        conn.send_bytes(READY)
        inflight: deque[_Batch] = deque()
        while True:
            if inflight and self.link is not None:
                if len(inflight) >= self.link.remote.inflight or self.link.ready(inflight[0].pending):
                    self._complete(inflight)
                    continue
                came = self.link.wait_for(conn, POLL)  # a fill, or the head batch's answer coming in
                if came == "answer":
                    self._complete(inflight)
                if came != "pipe":
                    continue
            elif inflight:  # the cluster went: what is in flight is decoded here, in order
                self._complete(inflight)
                continue
            command = self._command(conn, lambda: self._settle(inflight))  # answers go back in the fills' order
            if command is None:
                return  # the trainer is gone
            kind, msg, fill = command
            if fill is not None:
                slot, batch = fill
                if any(not x.formed for x in inflight):  # their samples come before this batch's
                    self._settle(inflight)
                if self.link is not None and self._actor_takes():
                    inflight.append(self._start(_Batch(slot, batch)))
                else:  # no actor (yet): this batch is decoded here
                    self._settle(inflight)
                    conn.send_bytes(self._fill(slot, batch).encode())
            elif kind != FILL:
                self._settle(inflight)
                if kind == EPOCH:
                    while self._pushback:  # another epoch's samples
                        self._pushback.popleft().shard.release()
                    self._new_epoch(msg)
                elif kind == STOP:
                    return

    def _settle(self, inflight: deque["_Batch"]) -> None:
        """Every batch in flight completed and answered, in order."""
        while inflight:
            self._complete(inflight)

    def _actor_takes(self) -> bool:
        """The actor has started (and the cluster is there: otherwise this place decodes here from now on)."""
        assert self.link is not None
        try:
            return self.link.available()
        except Lost as exc:
            self._give_up(exc)
            return False

    def _give_up(self, exc: Exception) -> None:
        log.warning("remote: worker place %d decodes here from now on: %s", self.args.worker_id, exc)
        if self.link is not None:
            self.link.abandon()
            self.link = None

    def _start(self, b: _Batch) -> _Batch:
        """Take the batch's samples and send them (its first chunk)."""
        b.t0 = time.perf_counter_ns()
        self._send_more(b, 0)
        return b

    def _send_more(self, b: _Batch, rows: int) -> bool:
        """Take the samples rows ``rows``... may need and send them; False when the stream has none left."""
        assert self.link is not None
        b.formed = True
        chunk: list[SampleRef] = []
        while len(chunk) < self.ring.layout.batch_size - rows:
            item = self._take(b.errors)
            if item is None:
                break
            chunk.append(item)
        if not chunk:
            return False
        b.items += chunk
        self._in_hand(chunk[0])
        if rows == 0:
            b.generation = self.link.generation
        sending = self._pack(rows, chunk)
        try:  # a batch goes on only on the actor that holds its first rows
            b.pending = self.link.submit(b.number, sending) if b.generation == self.link.generation else None
            b.sent.append(sending.nbytes)
        finally:
            for view in sending.members:  # the shards' mappings may close once the batch is done
                view.release()
        return True

    def _complete(self, inflight: deque[_Batch]) -> None:
        """The oldest batch in flight finished (more samples sent where bad ones were skipped), its slot filled and
        answered; where it needed more samples, the batches after it are formed again."""
        b = inflight.popleft()
        conn = self.args.conn
        if self.link is None or not b.formed:  # the cluster went, or its actor did before this batch was formed
            conn.send_bytes(self._decode_here(b, inflight).encode())
            self._reform(inflight)
            return
        try:
            got = self._collect(b, inflight)
        except Unavailable:  # its actor was lost (a new one is starting): the batch is decoded again, here
            conn.send_bytes(self._decode_here(b, inflight, redone=True).encode())
            self._reform(inflight)
            return
        except Lost as exc:
            self._give_up(exc)
            conn.send_bytes(self._decode_here(b, inflight, redone=True).encode())
            return
        self.status[1] = IDLE
        assert self.epoch is not None
        b.errors = [a + v for a, v in zip(b.errors, got.verdicts)]  # the actor's, counted once the batch is done
        for reason, text in got.notes:
            self.epoch.note(reason, text)
        answer, n = got.answer, got.rows
        if answer is not None and n and answer.slot.nbytes:  # (a streamed slot is in the ring already)
            sb = self.ring.layout.slot_bytes
            self.ring.memory.base[b.slot * sb : (b.slot + 1) * sb] = answer.slot  # the one copy into the ring
        elapsed = answer.decode_ns if answer is not None else time.perf_counter_ns() - b.t0
        result = self._finish(b.slot, b.number, n, b.errors, elapsed, got.read, got.written,
                              (1, 0, sum(b.sent), got.received),
                              b.items[-1].pos + 1 if b.items else None)  # the stream ran ahead: this batch's end
        for item in b.items:
            item.shard.release()
        conn.send_bytes(result.encode())
        self._reform(inflight)

    def _collect(self, b: _Batch, inflight: deque[_Batch]) -> _Answers:
        """The actor's answers for ``b`` (its slot streamed into the ring), more of the stream's samples sent while
        skipped ones leave it short; raises ``Unavailable`` or ``Lost`` as the link does."""
        assert self.link is not None
        got = _Answers()
        batch_size, sb = self.ring.layout.batch_size, self.ring.layout.slot_bytes
        into = memoryview(self.ring.memory.base[b.slot * sb : (b.slot + 1) * sb])
        seen = 0  # items whose verdicts are in
        while b.sent:  # none: the stream had no sample left for this batch
            answer = got.answer = self.link.wait(b.pending, into)
            got.received += answer.received
            chunk = b.items[seen:]
            for i, reason, text in answer.failed:
                got.verdicts[_REASON[reason]] += 1
                got.notes.append((reason, f"{chunk[i].shard.path} sample {chunk[i].sample.key!r}: {text}"))
            seen = len(b.items)
            got.rows, got.read, got.written = answer.rows, got.read + answer.read, got.written + answer.written
            if got.rows >= batch_size:
                break
            self._give_back(inflight)  # the samples the next batches took are this one's to take first
            if not self._send_more(b, got.rows):
                break
        return got

    def _give_back(self, inflight: deque[_Batch]) -> None:
        """Put the samples of the batches in flight after this one back at the stream's front, in order; they are
        formed again once this one has what it needs (their take-time counts move with them, in total)."""
        for later in reversed(inflight):
            self._pushback.extendleft(reversed(later.items))
            later.items, later.sent, later.pending, later.formed = [], [], None, False

    def _reform(self, inflight: deque[_Batch]) -> None:
        """The batches given back, formed again in order while the actor takes them (else decoded here)."""
        for later in inflight:
            if not later.formed and self.link is not None and self._actor_takes():
                self._send_more(later, 0)

    def _decode_here(self, b: _Batch, inflight: deque[_Batch], redone: bool = False) -> BatchResult:
        """This batch's samples, and those of the batches after it, back at the stream's front; this one decoded
        here (the later ones go to the actor again, or are decoded here too, as they complete)."""
        self._give_back(inflight)
        self._pushback.extendleft(reversed(b.items))
        b.items, b.sent = [], []
        result = self._fill(b.slot, b.number, errors=b.errors)
        return result._replace(redone=1) if redone else result

    def _pack(self, start: int, chunk: list[SampleRef]) -> Chunk:
        """Rows ``start``... from these samples: a JSON index, and the members they are read from as views of the
        shards' mappings (sent from there, never copied here)."""
        members: list[memoryview] = []
        index = []
        at = 0
        for item in chunk:
            extra = 4 if tfrecord.is_tfrecord(item.shard.path) else 0  # a record's CRC follows its data
            data = item.shard.view()
            try:
                fields = []
                for ext, (off, size) in item.sample.fields.items():
                    if self._shipped is not None and ext not in self._shipped:
                        continue
                    piece = data[off : off + size + extra]  # short where the shard is cut: as a local read
                    members.append(piece)
                    fields.append([ext, at, min(size, len(piece))])
                    at += len(piece)
            finally:
                data.release()
            seed = self._seed_of(item) if self.writer.reseed else None
            index.append([item.shard.path, item.sample.key, fields, seed, self._source_of(item)])
        return Chunk(start, json.dumps(index).encode(), members)
