"""The soak run itself: the appliance's processes, the fault schedule carried out, a sample every few seconds.

``Soak`` owns every process it starts (store, sidecar, trainer, Prometheus), the
cache directory in ``/dev/shm`` and the dataset's temporary directory; ``close()``
(also on Ctrl-C and exceptions) stops them all and removes both.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..demo.procs import free_port, stop_process
from ..formats.shard_index import load_index
from ..formats.shard_writer import ShardWriter
from .faults import SIDECAR_KILL, STORE_DOWN, TRAINER_STOP, WORKER_KILL, Fault, schedule
from .probe import children, footprint, shard_bytes, shm_used, started_at, tree_bytes
from .settings import SoakSettings

log = logging.getLogger("feedline.soak")

TAIL_LINES = 30  # lines of a process's log an unexpected exit carries (in the record and the output)
TAIL_BYTES = 64 << 10  # read from the log's end for them

ROLES = ("trainer", "worker", "sidecar", "store", "prometheus")



@dataclass
class Event:
    """Something the run did (a fault, a restart) or saw, at ``t`` seconds after its start."""

    t: float
    kind: str
    detail: str


@dataclass
class Record:
    """Everything a run saw, for ``analysis.py`` (and ``soak.json``)."""

    settings: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)  # t, role, pid, rss, pss, anon, fds, threads
    system: list[dict[str, Any]] = field(default_factory=list)  # t, cache_bytes, keys
    events: list[dict[str, Any]] = field(default_factory=list)
    shard_of: dict[str, str] = field(default_factory=dict)  # key -> shard name
    shard_samples: dict[str, int] = field(default_factory=dict)
    budget: int = 0
    largest_shard: int = 0
    leftovers: list[str] = field(default_factory=list)
    exits: list[dict[str, Any]] = field(default_factory=list)  # every process exit: role, code, expected


def make_dataset(directory: str, s: SoakSettings) -> tuple[list[str], dict[str, str]]:
    """``s.shards`` shards of small photo-like JPEGs with a class label; (shard paths, key -> shard name)."""
    from PIL import Image

    rng = np.random.default_rng(s.seed)
    w, h = s.image
    yy, xx = np.mgrid[0:h, 0:w]
    paths: list[str] = []
    shard_of: dict[str, str] = {}
    for k in range(s.shards):
        with ShardWriter(directory, prefix=f"soak-{k:04d}", target_bytes=1 << 40) as writer:
            for i in range(s.samples_per_shard):
                a, b, c = rng.uniform(0.2, 1.0, 3)
                base = np.stack([xx * a * 255 / w, yy * b * 255 / h, (xx + yy) * c * 127 / (w + h)], -1)
                pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
                jpg = io.BytesIO()
                Image.fromarray(pixels).save(jpg, format="JPEG", quality=90)
                key = f"s{k:04d}-{i:04d}"
                writer.write(key, {"jpg": jpg.getvalue(), "cls": str(i % 10).encode()})
        paths += writer.shards
        for p in writer.shards:
            for sample in load_index(p).samples:
                shard_of[sample.key] = os.path.basename(p)
    with open(os.path.join(directory, "index.txt"), "w") as f:
        f.writelines(f"{os.path.basename(p)}\n" for p in paths)
    return paths, shard_of


class _Proc:
    """One role's process, started again the same way after a fault."""

    def __init__(self, role: str, argv: Callable[[], list[str]], logs: str):
        self.role, self.argv, self.logs = role, argv, logs
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.started_at = 0.0

    def start(self) -> None:
        self.starts += 1
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def log_path(self) -> str:
        """This life's log (the one started last)."""
        return os.path.join(self.logs, f"{self.role}-{self.starts}.log")

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines of this life's log: why it ended, where it said so."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
                text = f.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(its log could not be read: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        code = stop_process(self.proc, self.role, timeout, sig)
        self.proc = None
        return code


class Soak:
    """Runs the appliance under the fault schedule; ``run()`` returns the ``Record``."""

    def __init__(self, settings: SoakSettings, on_sample: Callable[[float, int], None] | None = None):
        self.s = s = settings
        self.on_sample = on_sample
        self.out = os.path.abspath(s.out)
        self.logs = os.path.join(self.out, "logs")
        self.keys_dir = os.path.join(self.out, "keys")
        for d in (self.logs, self.keys_dir):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        self.tmp = tempfile.mkdtemp(prefix="feedline-soak-")
        self.cache = tempfile.mkdtemp(prefix="feedline-soak-cache-", dir="/dev/shm")
        self.data = os.path.join(self.tmp, "data")
        self.checkpoint = os.path.join(self.tmp, "checkpoint")
        self.ports = {"store": free_port(), "sidecar": free_port(), "trainer": free_port()}
        self.record = Record(asdict(s))
        self.seen: set[tuple[int, int]] = set()  # (pid, start time) of every process it saw: none may outlive it
        self.prometheus: Any = None
        self.t0 = 0.0
        self.shm_before = 0
        py = [sys.executable, "-m", "feedline"]
        store = f"http://127.0.0.1:{self.ports['store']}"
        self.procs = {
            "store": _Proc("store", lambda: [*py, "serve", self.data, "--port", str(self.ports["store"])],
                           self.logs),
            "sidecar": _Proc("sidecar", lambda: [
                *py, "sample", "--source", f"{store}/index.txt", "--cache", self.cache,
                "--budget", str(self.record.budget), "--policy", "grow", "--initial-shards", "4",
                "--grow-shards", "4", "--replace-fraction", "0.25", "--min-shards", "4",
                "--fetch-threads", str(s.fetch_threads), "--fetch-timeout", "10", "--seed", str(s.seed),
                "--metrics-port", str(self.ports["sidecar"]), "--progress", "false"], self.logs),
            "trainer": _Proc("trainer", self._trainer_argv, self.logs),
        }

    def _trainer_argv(self) -> list[str]:
        s = self.s
        argv = [sys.executable, "-m", "feedline", "train", "--cache", self.cache, "--min-shards", "4",
                "--checkpoint", self.checkpoint, "--checkpoint-every", "100",
                "--trace-keys", os.path.join(self.keys_dir, "epoch-{epoch}.txt"),
                "--summary-json", os.path.join(self.out, f"summary-{self.procs['trainer'].starts}.json"),
                "--epochs", "1000000", "--workers", str(s.workers), "--batch-size", str(s.batch_size),
                "--image-size", "32", "--step-ms", str(s.step_ms), "--seed", str(s.seed), "--device", "cpu",
                "--metrics-port", str(self.ports["trainer"]), "--progress", "false", "--wait-timeout", "120"]
        return argv + (["--resume"] if self.procs["trainer"].starts > 1 else [])

    # -- the run ---------------------------------------------------------------------------------------

    def run(self) -> Record:
        s, r = self.s, self.record
        paths, r.shard_of = make_dataset(self.data, s)
        sizes = [os.path.getsize(p) for p in paths]
        r.shard_samples = {os.path.basename(p): len(load_index(p).samples) for p in paths}
        r.largest_shard = max(sizes)
        r.budget = int(s.cached_shards * sum(sizes) / len(sizes))
        self._event("start", f"{len(paths)} shards of {s.samples_per_shard} samples; budget {r.budget} bytes "
                             f"(about {s.cached_shards} shards)")
        self.procs["store"].start()
        self._wait_for_store()  # the sidecar refuses to start with an unreachable source, as it should
        for role in ("sidecar", "trainer"):
            self.procs[role].start()
        self._start_prometheus()
        self.t0 = time.monotonic()
        self.shm_before = shm_used()
        duration = s.minutes * 60
        faults = schedule(duration, s.worker_every, s.store_down)
        store_back_at: float | None = None
        next_sample = 0.0
        keys = _KeyCount(self.keys_dir)
        while True:
            now = time.monotonic() - self.t0
            if now >= duration:
                break
            if store_back_at is not None and now >= store_back_at:
                self.procs["store"].start()
                self._wait_for_store()
                self._event("store_up", "the store is back on the same port")
                store_back_at = None
            while faults and faults[0].at <= now:
                fault = faults.pop(0)
                back = self._fault(fault)
                if back is not None:
                    store_back_at = now + back
            self._watch_exits()
            if now >= next_sample:
                self._sample(now, keys.total())
                next_sample += s.interval
            time.sleep(0.2)
        self._finish(keys)
        return r

    def _wait_for_store(self, timeout: float = 30.0) -> None:
        """Until the store answers on its port (a server's start takes a moment)."""
        import urllib.request

        url = f"http://127.0.0.1:{self.ports['store']}/index.txt"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    r.read()
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"the soak's store did not answer on {url} within {timeout:.0f} s; see "
                                       f"{self.logs}/store-{self.procs['store'].starts}.log") from None
                time.sleep(0.1)

    def _fault(self, fault: Fault) -> float | None:
        """Carry a fault out; the seconds until the store comes back, for a store fault."""
        if fault.kind == WORKER_KILL:
            trainer = self.procs["trainer"].pid
            workers = children(trainer) if trainer else []
            if not workers:
                self._event(fault.kind, "no worker to kill (the trainer is starting)")
                return None
            try:
                os.kill(workers[0], signal.SIGKILL)
            except ProcessLookupError:  # it ended between the listing and the kill (the trainer stopping)
                self._event(fault.kind, f"worker {workers[0]} was gone before the kill")
                return None
            self._event(fault.kind, f"SIGKILL worker {workers[0]} of trainer {trainer}")
        elif fault.kind == SIDECAR_KILL:
            p = self.procs["sidecar"]
            code = p.stop(signal.SIGKILL)
            self._exit("sidecar", code, expected=True)
            p.start()
            self._event(fault.kind, f"SIGKILL the sidecar (exit {code}), started again")
        elif fault.kind == STORE_DOWN:
            code = self.procs["store"].stop(signal.SIGTERM, 10)
            self._exit("store", code, expected=True)
            self._event(fault.kind, f"the store stopped for {fault.seconds:.0f} s")
            return fault.seconds
        elif fault.kind == TRAINER_STOP:
            p = self.procs["trainer"]
            code = p.stop(signal.SIGTERM, 120)
            self._exit("trainer", code, expected=code == 0)
            p.start()
            self._event(fault.kind, f"SIGTERM the trainer (exit {code}: checkpoint saved), started with --resume")
        return None

    def _watch_exits(self) -> None:
        """A process that ended by itself is an unexpected exit: recorded, and started again (the trainer
        resumes), as a restart policy would."""
        for role, p in self.procs.items():
            if p.proc is not None and p.proc.poll() is not None:
                code = p.proc.returncode
                p.proc = None
                tail = p.log_tail()  # its cause, in the record and the output: the logs folder may be gone later
                self._exit(role, code, expected=False, log_tail=tail)
                self._event("unexpected_exit", f"{role} exited with {code} by itself; started again")
                log.warning("%s exited with %s by itself; the end of its log (%s):\n%s", role, code, p.log_path,
                            tail)
                p.start()

    def _sample(self, now: float, keys: int) -> None:
        pids: list[tuple[str, int]] = [(role, p.pid) for role, p in self.procs.items() if p.pid]
        trainer = self.procs["trainer"].pid
        if trainer:
            pids += [("worker", w) for w in children(trainer)]
        if self.prometheus is not None:
            pids.append(("prometheus", self.prometheus.proc.pid))
        for role, pid in pids:
            since = started_at(pid)
            if since is not None:
                self.seen.add((pid, since))
            fp = footprint(pid)
            if fp is not None:
                self.record.rows.append({"t": round(now, 2), "role": role, **asdict(fp)})
        self.record.system.append({"t": round(now, 2), "cache_bytes": tree_bytes(self.cache),
                                   "shard_bytes": shard_bytes(self.cache),
                                   "retained_bytes": shard_bytes(self.cache, kept=True), "keys": keys,
                                   "shm_bytes": shm_used() - self.shm_before})
        if self.on_sample is not None:
            self.on_sample(now, keys)

    def _start_prometheus(self) -> None:
        from ..demo.prometheus import PrometheusServer

        try:
            self.prometheus = PrometheusServer({"sampler": self.ports["sidecar"], "trainer": self.ports["trainer"]})
        except FileNotFoundError as exc:
            self._event("prometheus", f"not started: {exc}")

    def _event(self, kind: str, detail: str) -> None:
        t = time.monotonic() - self.t0 if self.t0 else 0.0
        log.info("%6.0f s  %s: %s", t, kind, detail)
        self.record.events.append(asdict(Event(round(t, 2), kind, detail)))

    def _exit(self, role: str, code: int | None, expected: bool, log_tail: str | None = None) -> None:
        t = time.monotonic() - self.t0 if self.t0 else 0.0
        self.record.exits.append({"t": round(t, 2), "role": role, "code": code, "expected": expected,
                                  **({"log_tail": log_tail} if log_tail is not None else {})})

    def _finish(self, keys: "_KeyCount") -> None:
        """Stop the trainer as an orchestrator does (SIGTERM: it saves), then the rest; what is left over."""
        code = self.procs["trainer"].stop(signal.SIGTERM, 120)
        self._exit("trainer", code, expected=code == 0)
        for role in ("sidecar", "store"):
            code = self.procs[role].stop(signal.SIGTERM, 30)
            self._exit(role, code, expected=code == 0)
        self._event("end", f"{keys.total()} samples trained")
        self.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(started_at(p) == since for p, since in self.seen):
            time.sleep(0.2)
        # the same pid and start time: that process itself, not a later one given its pid
        self.record.leftovers = [f"process {p}" for p, since in sorted(self.seen) if started_at(p) == since]
        self.record.leftovers += [f"/dev/shm entry {self.cache}"] if os.path.exists(self.cache) else []
        self.record.leftovers += [f"temporary directory {self.tmp}"] if os.path.exists(self.tmp) else []

    def close(self) -> None:
        """Stop whatever still runs (Ctrl-C, an exception) and remove the cache and the dataset."""
        for p in self.procs.values():
            if p.proc is not None:
                p.stop(signal.SIGKILL if p.role != "trainer" else signal.SIGTERM, 60)
        if self.prometheus is not None:
            self.prometheus.close()
            self.prometheus = None
        shutil.rmtree(self.cache, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "Soak":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _KeyCount:
    """Keys trained so far, over every epoch's trace file, read incrementally."""

    def __init__(self, directory: str):
        self.directory = directory
        self._seen: dict[str, tuple[int, int]] = {}  # file -> (bytes read, lines)

    def total(self) -> int:
        total = 0
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            done, lines = self._seen.get(name, (0, 0))
            with open(path, "rb") as f:
                f.seek(done)
                chunk = f.read()
            whole = chunk.rfind(b"\n") + 1  # a line being written counts once it ends
            self._seen[name] = (done + whole, lines + chunk.count(b"\n", 0, whole))
            total += self._seen[name][1]
        return total
