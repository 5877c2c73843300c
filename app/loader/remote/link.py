"""A proxy's link to the Ray cluster: its connection, its one decode actor, and what happens when either is lost.

The proxy process (not the training process) is the Ray driver: it owns its actor, which Ray ends with it, so
a loader that closes or dies leaves nothing running on the decode nodes. The actor is asked for at once and
used once it has started (``available``): until then, and whenever it is lost, the proxy decodes its batches
itself, so a place never waits for the cluster. An actor lost with batches in flight (its process killed, its
node gone) is replaced in the background and those batches are decoded again here (``Unavailable``): the same
bytes and seeds give the same rows, so nothing is lost or delivered twice; the results count them as redone.
A cluster whose address no longer answers, or whose actors are lost ``ATTEMPTS`` times in a row without an
answer between, is given up for good (``Lost``).
"""

from __future__ import annotations

import json
import logging
import select
import sys
import threading
from typing import Any, NamedTuple

import numpy as np

from .cluster import answers
from .channel import ProxyChannel
from .settings import RemoteDecode

log = logging.getLogger("feedline.remote")
_EMPTY = np.empty(0, np.uint8)

CALL_TIMEOUT = 120.0  # seconds one chunk may take on an actor before it counts as lost
ATTEMPTS = 3  # actors lost in a row, no answer between, before the cluster counts as gone


class Lost(Exception):
    """The cluster cannot decode for this place any more: decode it locally from now on."""


class Unavailable(Exception):
    """The actor owing this batch was lost (a new one is starting): decode the batch locally."""


class Pending(NamedTuple):
    """A chunk sent: the answer to come (Ray's reply; None on the stream), which of the place's actors owes it,
    and its call's number."""

    ref: Any
    generation: int
    seq: int = 0
    streamed: bool = False


class Chunk(NamedTuple):
    """Rows ``start``... of a batch: the JSON index of its samples, and their members as views of the shards'
    mappings (sent from there)."""

    start: int
    index: bytes
    members: list[memoryview]

    @property
    def nbytes(self) -> int:
        return len(self.index) + sum(m.nbytes for m in self.members)


class Answer:
    """What an actor returned for one chunk, checked: its verdicts and the slot's bytes."""

    def __init__(self, record: bytes, slot: np.ndarray):
        try:
            r = json.loads(record)
            self.rows: int = int(r["rows"])
            self.failed: list[tuple[int, str, str]] = [(int(i), str(x), str(t)) for i, x, t in r["failed"]]
            self.read, self.written, self.decode_ns = int(r["read"]), int(r["written"]), int(r["decode_ns"])
        except (ValueError, KeyError, TypeError) as exc:
            raise OSError(f"a decode actor answered a record that is not one ({type(exc).__name__}): do the "
                          f"training node and the decode nodes run the same feedline?") from None
        self.slot = slot  # empty when it came on the stream, straight into the ring
        self.received = slot.nbytes + len(record)


class ActorLink:
    """The Ray connection and the decode actor of one worker place."""

    def __init__(self, remote: RemoteDecode, place: int, code: Any, ring: dict[str, Any], slot_bytes: int):
        import ray  # here, in the proxy process only: the training process never imports Ray

        self._ray = ray
        self.remote = remote
        self.place = place
        self.slot_bytes = slot_bytes
        self._code = code
        self._ring = ring
        self._actor: Any = None
        self._ready_ref: Any = None
        self._serve_ref: Any = None
        self.pid: int | None = None
        self.generation = 0  # counts the actors started: an answer owed by an earlier one is not waited for
        self._losses = 0  # actors lost since the last answer
        self._seq = 0  # calls sent: each answer carries its call's number
        self._broken: BaseException | None = None  # a call could not be sent: the actor is to be replaced
        self._blob = np.empty(0, np.uint8)  # the members of a call sent through Ray
        self.channel: ProxyChannel | None = None
        self.streaming = False  # the current actor takes its calls on the place's own stream
        problem = answers(remote.address, remote.connect_timeout)
        if problem is not None:
            raise Lost(f"no Ray cluster answers at {remote.address} ({problem})")
        _code_by_value(code)
        try:
            if not ray.is_initialized():
                ray.init(address=remote.address, namespace="feedline", log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=False)
            from .actor import DecodeActor

            try:  # where this node's actors... and other nodes' reach it: the address Ray knows this node by
                self.channel = ProxyChannel(ray.util.get_node_ip_address(), slot_bytes) if remote.stream else None
            except OSError as exc:
                log.warning("remote: worker place %d talks to its actor through Ray (no stream of its own: %s)",
                            place, exc)
            self._actor_class = ray.remote(DecodeActor)
            self._start()
        except BaseException:
            self.close()  # the listening socket and the connection are this link's: none outlives it
            raise

    def _start(self) -> None:
        """A new actor, asked for now; ``available`` says when it has started."""
        self.generation += 1
        options = self._actor_class.options(num_cpus=self.remote.cpus, max_restarts=0, max_task_retries=0,
                                            scheduling_strategy="SPREAD")
        self._actor = options.remote(self._code, self._ring, self.remote.inflight + 2)  # + a batch formed again
        self._ready_ref = self._actor.ready.remote()  # before ``serve``, which holds the actor while it streams
        self._serve_ref = (self._actor.serve.remote(self.channel.host, self.channel.port, self.channel.new_key())
                           if self.channel is not None else None)
        self.pid = None
        self.streaming = False
        self._broken = None

    def started(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the first actor to start (at the place's start: its first batches go
        to it); False when it has not, and the place decodes here until it has."""
        done, _ = self._ray.wait([self._ready_ref], timeout=timeout)
        if done:
            return self.available()
        log.warning("remote: worker place %d has no actor after %g s (no free CPUs in the cluster?); it decodes "
                    "here until one starts", self.place, timeout)
        return False

    def available(self) -> bool:
        """The actor has started and takes batches (never waits for a start: a place decodes locally until then;
        one that cannot start yet, on a cluster without free CPUs, starts when a node joins)."""
        if self.pid is not None:
            return True
        ray = self._ray
        done, _ = ray.wait([self._ready_ref], timeout=0)
        if not done:
            return False
        try:
            self.pid = int(ray.get(self._ready_ref))
            if self.channel is not None:
                self.streaming = self.channel.accept(self._served)
                if not self.streaming and not self._served():
                    raise OSError("it did not connect to its proxy's stream")
                if not self.streaming and not ray.get(self._serve_ref):
                    log.warning("remote: worker place %d talks to its actor through Ray: the actor cannot reach "
                                "%s:%d", self.place, self.channel.host, self.channel.port)
        except Exception as exc:  # it died starting: another one
            self.pid = None
            self._replace(exc)
            return False
        log.info("remote: worker place %d decodes on an actor (pid %d)", self.place, self.pid)
        return True

    def _served(self) -> bool:
        """The actor's ``serve`` call has ended (it could not connect, or it is gone)."""
        return self._serve_ref is not None and bool(self._ray.wait([self._serve_ref], timeout=0)[0])

    def submit(self, token: int, chunk: Chunk) -> Pending | None:
        """Send batch ``token``'s ``chunk`` to the actor, not waiting for its answer; None when it could not be sent
        (``wait`` then replaces the actor and says the batch is to be decoded locally)."""
        self._seq += 1
        try:
            if self.streaming:
                assert self.channel is not None
                self.channel.send_call(self._seq, token, chunk.start, chunk.index, chunk.members)
                return Pending(None, self.generation, self._seq, True)
            return Pending(self._actor.decode.remote(token, chunk.start, chunk.index, self._joined(chunk)),
                           self.generation, self._seq)
        except Exception as exc:  # the stream broke, or an actor handle that is gone
            log.debug("remote: a chunk could not be sent", exc_info=True)
            self._broken = exc
            return None

    def _joined(self, chunk: Chunk) -> np.ndarray:
        """The members back to back, for a call through Ray (one buffer a link, grown as needed: Ray copies a
        call's arguments as it sends)."""
        total = sum(m.nbytes for m in chunk.members)
        if len(self._blob) < total:
            self._blob = np.empty(max(total, 2 * len(self._blob)), np.uint8)
        at = 0
        for m in chunk.members:
            self._blob[at : at + m.nbytes] = np.frombuffer(m, np.uint8)
            at += m.nbytes
        return self._blob[:at]

    def ready(self, pending: Pending | None) -> bool:
        """The answer is coming in (or nothing was sent: ``wait`` will not wait on the actor for it)."""
        if pending is None or pending.generation != self.generation:
            return True
        if pending.streamed:
            assert self.channel is not None
            return self.channel.readable() or self._served()
        done, _ = self._ray.wait([pending.ref], timeout=0)
        return bool(done)

    def wait_for(self, pipe: Any, poll: float) -> str | None:
        """What comes first: a command on the proxy's ``pipe`` ("pipe"), or an answer on the stream ("answer"), up
        to a second; without a stream, the pipe for ``poll`` seconds (the caller asks ``ready`` in between). None:
        nothing yet."""
        if self.streaming and self.channel is not None and self.channel.conn is not None:
            readable, _, _ = select.select([pipe, self.channel.conn], [], [], 1.0)
            return "pipe" if pipe in readable else "answer" if readable else None
        return "pipe" if pipe.poll(poll) else None

    def wait(self, pending: Pending | None, into: memoryview) -> Answer:
        """The answer to a chunk, its slot in ``into`` (streamed: received there; else ``Answer.slot`` holds it);
        ``Unavailable`` when its actor was lost (replaced meanwhile), ``Lost`` when the cluster is gone."""
        from ray.exceptions import GetTimeoutError, RayError

        if pending is None and self._broken is not None:
            self._replace(self._broken)
        if pending is None or pending.generation != self.generation:
            raise Unavailable("its actor was lost before it answered")
        ray = self._ray
        try:
            if pending.streamed:
                assert self.channel is not None
                size, record = self.channel.receive(pending.seq, into, self._served)
                answer = Answer(record, _EMPTY)
                answer.received += size
            else:
                answer = self._check(ray.get(pending.ref, timeout=CALL_TIMEOUT))
        except (RayError, GetTimeoutError, OSError) as exc:
            self._replace(exc)
            raise Unavailable(f"its actor was lost ({type(exc).__name__})") from None
        self._losses = 0
        return answer

    def _replace(self, exc: BaseException) -> None:
        """The actor is lost: a new one, unless the cluster is gone (``Lost``)."""
        log.warning("remote: worker place %d lost its decode actor%s (%s: %s)", self.place,
                    f" (pid {self.pid})" if self.pid else "", type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        self._kill()
        gone = answers(self.remote.address, 1.0)
        if gone is not None:  # not an actor: the cluster itself
            raise Lost(f"the Ray cluster at {self.remote.address} no longer answers ({gone})") from None
        self._losses += 1
        if self._losses >= ATTEMPTS:
            raise Lost(f"{ATTEMPTS} decode actors in a row were lost before one answered")
        self._start()

    def _check(self, answer: Any) -> Answer:
        """Only bytes and a uint8 array of a slot's size are taken from an actor's reply."""
        if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bytes)
                and isinstance(answer[1], np.ndarray) and answer[1].dtype == np.uint8
                and answer[1].shape == (self.slot_bytes,)):
            raise OSError(f"a decode actor answered {type(answer).__name__}, not (bytes, a slot's uint8 array): "
                          f"do the training node and the decode nodes run the same feedline?")
        return Answer(answer[0], answer[1])

    def _kill(self) -> None:
        if self._actor is not None:
            try:
                self._ray.kill(self._actor, no_restart=True)
            except Exception:  # already gone, or the cluster is
                pass
            self._actor = None

    def abandon(self) -> None:
        """Leave a cluster that is gone: its connection closes in the background (``ray.shutdown`` waits 5 s on
        a dead cluster; the batch in hand is decoded here meanwhile)."""
        self._actor = None
        threading.Thread(target=self.close, name="feedline-ray-shutdown", daemon=True).start()

    def close(self) -> None:
        """End the actor and this process's connection to the cluster."""
        self._kill()
        if self.channel is not None:
            self.channel.close()
        try:
            self._ray.shutdown()
        except Exception:
            log.debug("remote: ray.shutdown failed", exc_info=True)


def _code_by_value(code: Any) -> None:
    """The user's functions travel to the actor by value when they live in the training script or in a module of
    theirs (which the decode nodes do not have); installed packages travel by name, as Ray does."""
    import pickle

    from ray import cloudpickle

    modules: set[str] = set()

    class Recorder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, type) or callable(obj) and hasattr(obj, "__code__"):
                name = getattr(obj, "__module__", None)
                if name:
                    modules.add(name)
            return NotImplemented

    import io

    try:
        Recorder(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(code)
    except Exception:  # the launcher pickled it already; what cannot be recorded travels as Ray decides
        return
    for name in modules:
        module = sys.modules.get(name)
        if module is None or name.split(".")[0] in ("feedline", "builtins", "numpy", "torch", "PIL"):
            continue
        path = getattr(module, "__file__", None) or ""
        if name in ("__main__", "__mp_main__") or ("site-packages" not in path and "dist-packages" not in path
                                                   and not path.startswith(sys.base_prefix)):
            try:
                cloudpickle.register_pickle_by_value(module)
            except (ValueError, TypeError):
                pass
