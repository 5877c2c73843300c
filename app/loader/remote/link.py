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
from .slots import SlotReceiver
from .settings import RemoteDecode

log = logging.getLogger("feedline.remote")

CALL_TIMEOUT = 120.0  # seconds one chunk may take on an actor before it counts as lost
ATTEMPTS = 3  # actors lost in a row, no answer between, before the cluster counts as gone


class Lost(Exception):
    """The cluster cannot decode for this place any more: decode it locally from now on."""


class Unavailable(Exception):
    """The actor owing this batch was lost (a new one is starting): decode the batch locally."""


class Pending(NamedTuple):
    """A chunk sent: the answer to come, which of the place's actors owes it, and (streamed) the number its slot's
    frame carries on the slot stream."""

    ref: Any
    generation: int
    seq: int = 0
    streamed: bool = False


class Answer:
    """What an actor returned for one chunk, checked: its verdicts and the slot's bytes."""

    def __init__(self, record: dict[str, Any], slot: np.ndarray):
        self.rows: int = record["rows"]
        self.failed: list[tuple[int, str, str]] = [(int(i), str(r), str(t)) for i, r, t in record["failed"]]
        self.read: int = record["read"]
        self.written: int = record["written"]
        self.decode_ns: int = record["decode_ns"]
        self.slot = slot  # empty when it came on the slot stream, straight into the ring
        self.received = slot.nbytes


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
        self.pid: int | None = None
        self.generation = 0  # counts the actors started: an answer owed by an earlier one is not waited for
        self._losses = 0  # actors lost since the last answer
        self._seq = 0  # calls sent: each slot's frame on the stream carries its call's number
        self.slots: SlotReceiver | None = None
        self.streaming = False  # the current actor sends its slots on the slot stream
        problem = answers(remote.address, remote.connect_timeout)
        if problem is not None:
            raise Lost(f"no Ray cluster answers at {remote.address} ({problem})")
        _code_by_value(code)
        if not ray.is_initialized():
            ray.init(address=remote.address, namespace="feedline", log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=False)
        from .actor import DecodeActor

        try:  # where this node's actors... and other nodes' reach it: the address Ray knows this node by
            self.slots = SlotReceiver(ray.util.get_node_ip_address(), slot_bytes)
        except OSError as exc:
            log.warning("remote: worker place %d receives its slots through Ray (no slot stream: %s)", place, exc)
        self._actor_class = ray.remote(DecodeActor)
        self._start()

    def _start(self) -> None:
        """A new actor, asked for now; ``available`` says when it has started."""
        self.generation += 1
        self._actor = self._actor_class.options(num_cpus=self.remote.cpus, max_restarts=0, max_task_retries=0,
                                                scheduling_strategy="SPREAD").remote(self._code, self._ring)
        self._stream_ref = (self._actor.stream_to.remote(self.slots.host, self.slots.port, self.slots.new_key())
                            if self.slots is not None else None)
        self._ready_ref = self._actor.ready.remote()
        self.pid = None
        self.streaming = False

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
        """The actor has started and takes batches (never waits: a place decodes locally until then; one that
        cannot start yet, on a cluster without free CPUs, starts when a node joins)."""
        if self.pid is not None:
            return True
        ray = self._ray
        done, _ = ray.wait([self._ready_ref], timeout=0)
        if not done:
            return False
        try:
            self.pid = int(ray.get(self._ready_ref))
            self.streaming = bool(self._stream_ref is not None and ray.get(self._stream_ref)
                                  and self.slots is not None and self.slots.accept())
        except Exception as exc:  # it died starting: another one
            self._replace(exc)
            return False
        log.info("remote: worker place %d decodes on an actor (pid %d)", self.place, self.pid)
        return True

    def submit(self, token: int, chunks: list[tuple[int, bytes, np.ndarray]]) -> Pending | None:
        """Send the last of batch ``token``'s ``chunks`` to the actor, not waiting; None when it could not be sent
        (``wait`` then says the batch is to be decoded locally)."""
        try:
            start, index, blob = chunks[-1]
            self._seq += 1
            return Pending(self._actor.decode.remote(token, start, index, blob, self._seq), self.generation,
                           self._seq, self.streaming)
        except Exception:  # an actor handle that is gone
            log.debug("remote: a chunk could not be sent", exc_info=True)
            return None

    def ready(self, pending: Pending | None) -> bool:
        """The answer is coming in (or nothing was sent: ``wait`` will not wait on the actor for it). A streamed
        slot's frame comes before its reply: its first bytes say so."""
        if pending is None:
            return True
        if pending.streamed and self.slots is not None and self.slots.conn is not None:
            readable, _, _ = select.select([self.slots.conn], [], [], 0)
            if readable:
                return True
        done, _ = self._ray.wait([pending.ref], timeout=0)
        return bool(done)

    def wait_for(self, pipe: Any, poll: float) -> str | None:
        """What comes first: a command on the proxy's ``pipe`` ("pipe"), or the slot stream's bytes ("answer"), up to
        a second; without a stream, the pipe for ``poll`` seconds (the caller asks ``ready`` in between). None:
        nothing yet."""
        if self.streaming and self.slots is not None and self.slots.conn is not None:
            readable, _, _ = select.select([pipe, self.slots.conn], [], [], 1.0)
            return "pipe" if pipe in readable else "answer" if readable else None
        return "pipe" if pipe.poll(poll) else None

    def wait(self, pending: Pending | None, into: memoryview) -> Answer:
        """The answer to a chunk, its slot in ``into`` (streamed: received there; else ``Answer.slot`` holds it);
        ``Unavailable`` when its actor was lost (replaced meanwhile), ``Lost`` when the cluster is gone."""
        from ray.exceptions import GetTimeoutError, RayError

        if pending is None or pending.generation != self.generation:
            raise Unavailable("its actor was lost before it answered")
        ray = self._ray
        try:
            if pending.streamed:
                assert self.slots is not None
                size = self.slots.receive(pending.seq, into, lambda: bool(ray.wait([pending.ref], timeout=0)[0]))
            answer = self._check(ray.get(pending.ref, timeout=CALL_TIMEOUT), pending.streamed)
        except (RayError, GetTimeoutError, OSError) as exc:
            self._replace(exc)
            raise Unavailable(f"its actor was lost ({type(exc).__name__})") from None
        if pending.streamed:
            answer.received = size
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

    def _check(self, answer: Any, streamed: bool) -> Answer:
        """Only bytes and a uint8 array of a slot's size (none, when the slot came on the stream) are taken from
        an actor."""
        if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bytes)
                and isinstance(answer[1], np.ndarray) and answer[1].dtype == np.uint8
                and answer[1].shape == ((0,) if streamed else (self.slot_bytes,))):
            raise RuntimeError(f"a decode actor answered {type(answer).__name__}, not (bytes, a slot's uint8 array): "
                               f"do the training node and the decode nodes run the same feedline?")
        return Answer(json.loads(answer[0]), answer[1])

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
        if self.slots is not None:
            self.slots.close()
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
