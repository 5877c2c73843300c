"""A sampler sidecar the training process starts for remote ``shards=`` and owns: ``StagingLoader(URL)``.

webdataset, Mosaic Streaming and LitData take a remote URL in their dataset's constructor; so does the
loader. For ``https://``, ``s3://``, ``gs://``, ``az://``, ``hf://`` or ``pipe:`` shards the face starts
``feedline sample`` as a child process with its cache in ``/dev/shm/feedline-<uid>-<hash>`` (or ``cache=``)
and a budget (``cache_budget``), waits for it as the loader waits for any cache, reads the cache, and on
``close()`` stops the child and removes the cache it made (``keep_cache=True`` keeps it: the next run
starts warm). The child dies with the thread that started it (``PR_SET_PDEATHSIG``) and removes the
cache it was started for as it stops (``--remove-cache-on-exit``): a trainer killed with SIGKILL, or ended
by a SIGTERM it does not handle, leaves neither a sidecar running nor its cache in ``/dev/shm``.

Under torchrun the ranks of one node share one sidecar: local rank 0 starts it, the others read its cache
(the folder is the same for every rank of a job: the source, the user and torchrun's run id name it). Local
rank 0's ``close()`` waits (at most ``LINGER`` seconds) while other ranks' reader files name live processes:
a rank that ends later than rank 0 reads to its end.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from typing import Any

from ..cache.readers import read_readers
from ..cache.source import CacheSource, CacheWaitAborted, CacheWaitTimeout
from ..errors import SettingError
from ..formats.urls import expand, is_pipe, is_remote, redact, redact_text
from ..procs import stop_process

log = logging.getLogger("feedline")

DEFAULT_ROOT = "/dev/shm"
DEFAULT_BUDGET_SHARE = 0.5  # of the cache filesystem's free space, when cache_budget is not given ...
DEFAULT_BUDGET_MAX = 16 << 30  # ... and at most this
STDERR_TAIL = 4000
# seconds local rank 0's close waits for the other local ranks to stop reading the cache: under torchrun's 30 s
# from SIGTERM to SIGKILL, so that a job stopped by torchrun still stops the sidecar and removes its cache
LINGER = 20.0


def remote_source(shards: Any) -> str | None:
    """The source setting ``shards=`` stands for when it names remote shards (URLs or ``pipe:``), else None;
    a list that mixes remote and local names is refused by name."""
    if shards is None or not isinstance(shards, (str, os.PathLike, list, tuple)):
        return None
    items = [os.fspath(shards)] if isinstance(shards, (str, os.PathLike)) else [os.fspath(s) for s in shards]
    try:
        names = expand(items)
    except ValueError:
        return None
    remote = [n for n in names if is_remote(n) or is_pipe(n)]
    if not remote:
        return None
    if len(remote) != len(names):
        local = next(n for n in names if not (is_remote(n) or is_pipe(n)))
        raise SettingError("shards", f"mixes remote shards ({redact(remote[0])}) with local ones ({local}): give "
                                     f"one kind, or two sources (sources=[...])")
    return "::".join(items)


def default_cache(source: str, root: str = DEFAULT_ROOT) -> str:
    """The cache folder of a source for this user and job: every local rank of a torchrun job names the same."""
    key = f"{source}\0{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    return os.path.join(root, f"feedline-{os.getuid()}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")


def default_budget(cache: str) -> int:
    """Half the free space where the cache goes, at most 16 GiB: the cache grows epoch by epoch up to it."""
    probe = cache
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "."
    free = shutil.disk_usage(probe).free
    return int(min(DEFAULT_BUDGET_MAX, free * DEFAULT_BUDGET_SHARE))


def _die_with_parent() -> None:  # in the child, before exec
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a clean stop
    except (OSError, AttributeError):
        pass


class OwnedSidecar:
    """``feedline sample`` for one source, started by this process (local rank 0) or shared with it."""

    def __init__(self, source: str, *, cache: str | os.PathLike | None = None, budget: int | None = None,
                 min_shards: int = 1, keep_cache: bool = False, local_rank: int | None = None):
        self.source = source
        self.cache = os.path.abspath(os.fspath(cache)) if cache else default_cache(source)
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        self.owner = local_rank == 0
        self.proc: subprocess.Popen | None = None
        self._stderr = None
        self._finalizer: weakref.finalize | None = None
        if not self.owner:
            return
        made = not os.path.exists(self.cache)
        budget = budget or default_budget(self.cache)
        cmd = [sys.executable, "-m", "feedline", "sample", "--source", source, "--cache", self.cache,
               "--budget", str(budget), "--metrics-port", "0", "--min-shards", str(min_shards),
               "--initial-shards", str(max(min_shards, 4))]  # the grow policy's first shards: at least min_shards
        if made and not keep_cache:  # the sidecar removes it as it stops: also when this process dies unannounced
            cmd += ["--remove-cache-on-exit", "true"]
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                     preexec_fn=_die_with_parent)
        log.info("started the sampler sidecar (pid %d) for %s into %s, budget %d MiB", self.proc.pid,
                 redact(source), self.cache, budget >> 20)
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.cache if made and not keep_cache else None,
                                           self._stderr)

    def wait(self, min_shards: int, timeout: float) -> None:
        """Until the cache holds ``min_shards`` (or the whole source); the sidecar's own error if it stops first."""
        def exited() -> str | None:
            if self.proc is None or self.proc.poll() is None:
                return None
            return (f"the sampler sidecar started for {redact(self.source)} exited with status "
                    f"{self.proc.returncode}: {self.error()}")

        try:
            CacheSource(self.cache).wait_for(min_shards, timeout, abort=exited)
        except CacheWaitAborted as exc:
            raise SettingError("shards", str(exc)) from None
        except CacheWaitTimeout:
            raise SettingError("shards", f"the sampler sidecar for {redact(self.source)} cached fewer than "
                                         f"min_shards={min_shards} shards in {timeout:.0f} s (cache {self.cache}); "
                                         f"raise wait_timeout or check the source") from None

    def error(self) -> str:
        """The last lines the sidecar wrote (its refusal names the setting and the fix), redacted."""
        if self._stderr is None:
            return ""
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - STDERR_TAIL))
        lines = self._stderr.read().decode(errors="replace").strip().splitlines()
        errors = [ln for ln in lines if "error" in ln.lower()] or lines[-3:]
        return redact_text(" | ".join(ln.strip() for ln in errors[-3:]))

    def close(self, linger: float = LINGER) -> None:
        """Stop the sidecar (and remove the cache it made) once no other local rank reads the cache, waiting at
        most ``linger`` seconds for the ranks still reading (a live process's reader file in the cache)."""
        if self._finalizer is None or not self._finalizer.alive:
            return
        deadline = time.monotonic() + linger
        waiting = _other_readers(self.cache)
        if waiting:
            log.info("waiting up to %.0f s for local rank(s) %s to finish reading %s before stopping its sidecar",
                     linger, ", ".join(map(str, waiting)), self.cache)
        while waiting and time.monotonic() < deadline:
            time.sleep(0.2)
            waiting = _other_readers(self.cache)
        if waiting:
            log.warning("stopping the sidecar of %s while rank(s) %s still read it (after %.0f s)", self.cache,
                        ", ".join(map(str, waiting)), linger)
        self._finalizer()

    def __enter__(self) -> "OwnedSidecar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _other_readers(cache: str) -> list[int]:
    """The ranks of other live processes whose reader files are in ``cache``: they still read it."""
    ranks = []
    for r in read_readers(cache):
        if r.pid == os.getpid():
            continue
        try:
            os.kill(r.pid, 0)
        except ProcessLookupError:  # a rank that died without closing: nothing to wait for
            continue
        except PermissionError:  # alive, another user's: not this job's rank
            continue
        ranks.append(r.rank)
    return ranks


def _stop(proc: subprocess.Popen, remove: str | None, stderr: Any) -> None:
    """SIGTERM (the sidecar stops its fetches and exits), SIGKILL after 10 s; the cache removed when we made it."""
    stop_process(proc, "the loader's sidecar")
    if remove:
        shutil.rmtree(remove, ignore_errors=True)
    stderr.close()


def split_shards(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``shards`` as the loader was given it, positionally or by name."""
    return args[0] if args else kwargs.get("shards")
