"""A sampler sidecar the training process starts for remote ``shards=`` and owns: ``StagingLoader(URL)``.

webdataset, Mosaic Streaming and LitData take a remote URL in their dataset's constructor; so does the
loader. For ``https://``, ``s3://``, ``gs://``, ``az://``, ``hf://`` or ``pipe:`` shards the face starts
``feedline sample`` as a child process with its cache in ``/dev/shm/feedline-<uid>-<hash>`` (or ``cache=``)
and a budget (``cache_budget``), waits for it as the loader waits for any cache, reads the cache, and on
``close()`` stops the child and removes the cache it made (``keep_cache=True`` keeps it: the next run
starts warm). The child dies with the thread that started it (``PR_SET_PDEATHSIG``): a trainer killed
with SIGKILL leaves no sidecar running, though its cache stays, and the next loader on the same source
reads it as the sidecar reconciles it.

Under torchrun the ranks of one node share one sidecar: local rank 0 starts it, the others read its cache
(the folder is the same for every rank of a job: the source, the user and torchrun's run id name it).
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
import weakref
from collections.abc import Sequence
from typing import Any

from ..cache.source import CacheSource, CacheWaitAborted, CacheWaitTimeout
from ..errors import SettingError
from ..formats.urls import expand, is_pipe, is_remote, redact, redact_text

log = logging.getLogger("feedline")

DEFAULT_ROOT = "/dev/shm"
DEFAULT_BUDGET_SHARE = 0.5  # of the cache filesystem's free space, when cache_budget is not given ...
DEFAULT_BUDGET_MAX = 16 << 30  # ... and at most this
STDERR_TAIL = 4000


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

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "OwnedSidecar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(proc: subprocess.Popen, remove: str | None, stderr: Any) -> None:
    """SIGTERM (the sidecar stops its fetches and exits), SIGKILL after 10 s; the cache removed when we made it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if remove:
        shutil.rmtree(remove, ignore_errors=True)
    stderr.close()


def split_shards(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``shards`` as the loader was given it, positionally or by name."""
    return args[0] if args else kwargs.get("shards")
