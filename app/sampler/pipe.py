"""Shards from a command: webdataset's ``pipe:COMMAND`` sources (``pipe:curl -sL https://.../shard-000.tar``,
``pipe:aws s3 cp s3://bucket/x.tar -``, ``pipe:cat /data/x.tar``).

The command runs as webdataset runs it, under ``/bin/sh -c``, in a process group of its own, with stdin
``/dev/null``; its stdout is the shard, streamed into a new file, and its exit status is checked: a command
that fails, is killed, or exits 0 having written nothing is a failed attempt, its stderr's last lines quoted.

- The command comes only from the user's own source setting (``--source`` / ``shards=``), never from a
  fetched index; what logs and errors show of it is redacted (``formats.urls.redact_text``): a presigned
  URL inside a ``curl`` command keeps its host and path, never its signature.
- Bounded as an HTTP body is (``http.py``): by the budget (the group is killed past it), the shared rate
  cap, ``timeout`` seconds of silence, and the speed floor over each ``timeout`` window.
- The stop event kills the group (SIGTERM, SIGKILL ~2 s later) and raises ``FetchAborted``; the pipes are
  polled, so a command that writes nothing still sees the stop and the timeout.
- No process is left behind: on any way out, a KeyboardInterrupt included, the whole group is killed and
  the command reaped; a failure leaves no ``dest`` either.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import subprocess
import threading
import time

from ..formats.files import create_new
from ..formats.urls import redact_text
from .errors import FetchAborted, FetchError
from .http import CHUNK, space_error
from .ratelimit import RateLimiter, SpeedFloor

log = logging.getLogger("feedline.sampler")

PREFIX = "pipe:"
SHELL = "/bin/sh"
STDERR_TAIL = 2000  # bytes of the command's stderr kept for its error
KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL
TICK = 0.1  # seconds: how often the stop and the timeouts are checked while the command is silent
READ = 1 << 16


def pipe_command(url: str) -> str:
    """The command of a ``pipe:`` URL, stripped; ValueError if it is not one or names no command."""
    if not url.startswith(PREFIX):
        raise ValueError(f"{redact_text(url)!r} is not a pipe: source")
    cmd = url[len(PREFIX):].strip()
    if not cmd:
        raise ValueError("pipe: names no command: write pipe:COMMAND, whose stdout is the shard "
                         "(pipe:curl -sfL https://host/shard-000.tar)")
    return cmd


def fetch_pipe(url: str, dest: str, max_bytes: int, stop: threading.Event, limiter: RateLimiter,
               timeout: float, min_rate: float = 0.0) -> int:
    """Run the command of ``url`` (``pipe:COMMAND``) and write its stdout into the new file ``dest``; its size.

    Raises FetchError: ``too_large`` past ``max_bytes`` (not retried); ``timeout`` after ``timeout`` s without
    a byte, or slower than ``min_rate`` bytes/s over a ``timeout`` window (no rate cap set), or a command that
    closed its stdout and did not exit within ``timeout`` s; ``connection`` for a non-zero exit status or a
    signal, naming it and quoting the end of its stderr; ``truncated`` for an exit 0 with nothing written.
    Raises FetchAborted once ``stop`` is set. Whatever the outcome, the command's process group is gone and
    reaped when this returns, and ``dest`` exists only on success.
    """
    cmd = pipe_command(url)
    shown = redact_text(cmd)
    if stop.is_set():
        raise FetchAborted()
    ok = False
    proc: subprocess.Popen | None = None
    try:
        with create_new(dest) as f:  # never a file that was there, never through a link
            log.debug("running pipe: %s", shown)
            try:
                proc = subprocess.Popen([SHELL, "-c", cmd], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True, close_fds=True, bufsize=0)
            except OSError as exc:
                raise FetchError("connection", f"pipe: cannot run {SHELL} for {shown}: {exc.strerror}",
                                 retry=False) from None
            run = _Run(proc, shown, stop, limiter, timeout, min_rate)
            n = run.pump(f, max_bytes)
            run.wait_exit()
        _kill_group(proc, grace=0.0)  # what the command left running in the background (its leader exited)
        code = proc.wait()
        if code != 0:
            how = (f"was killed by signal {_signame(-code)}" if code < 0 else f"exited with status {code}")
            # 126/127: the shell found no command to run: trying again would only find the same
            raise FetchError("connection", f"pipe: {shown} {how}: {run.stderr_tail()}",
                             retry=code not in (126, 127))
        if n == 0:
            raise FetchError("truncated", f"pipe: {shown} exited 0 having written nothing: "
                                          f"{run.stderr_tail()}", retry=True)
        ok = True
        return n
    finally:
        if proc is not None:
            _close(proc)
            if proc.returncode is None:
                _kill_group(proc, grace=0.0 if ok else KILL_GRACE)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:  # a process in uninterruptible sleep: reaped when it can be
                    log.warning("pipe: %s (pid %d) did not die on SIGKILL within 10 s", shown, proc.pid)
        if not ok:
            try:
                os.unlink(dest)
            except FileNotFoundError:
                pass


class _Run:
    """One command's pipes read to their end: stdout into the file, stderr's tail kept."""

    def __init__(self, proc: subprocess.Popen, shown: str, stop: threading.Event, limiter: RateLimiter,
                 timeout: float, min_rate: float):
        self.proc = proc
        self.shown = shown
        self.stop = stop
        self.limiter = limiter
        self.timeout = timeout
        self.min_rate = min_rate
        self.poller = select.poll()
        assert proc.stdout is not None and proc.stderr is not None
        self.out = proc.stdout.fileno()
        self.err: int | None = proc.stderr.fileno()
        self.poller.register(self.out, select.POLLIN)
        self.poller.register(self.err, select.POLLIN)
        self._tail = bytearray()

    def stderr_tail(self) -> str:
        self._drain_err()
        text = self._tail.decode("utf-8", "replace").strip()
        if not text:
            return "(nothing on stderr)"
        return redact_text(("..." if len(self._tail) >= STDERR_TAIL else "") + text)

    def _read_err(self) -> None:
        """One read of stderr (it is readable or at its end)."""
        assert self.err is not None
        data = os.read(self.err, READ)
        if not data:
            self.poller.unregister(self.err)
            self.err = None
            return
        self._tail += data
        del self._tail[:-STDERR_TAIL]

    def _drain_err(self) -> None:
        """What stderr holds now, without waiting (a background process may keep it open), 1 MiB at most."""
        for _ in range(CHUNK // READ):
            if self.err is None or self.err not in dict(self.poller.poll(0)):
                return
            self._read_err()

    def _kill(self, error: BaseException) -> BaseException:
        _kill_group(self.proc, KILL_GRACE)
        return error

    def _check_stop(self) -> None:
        if self.stop.is_set():
            raise self._kill(FetchAborted())

    def pump(self, f, max_bytes: int) -> int:
        """stdout -> a 1 MiB buffer -> ``f`` until stdout's end; the bytes written."""
        buf = memoryview(bytearray(CHUNK))
        n = filled = 0
        last = time.monotonic()
        floor = SpeedFloor(self.min_rate, self.timeout, self.limiter)
        while True:
            self._check_stop()
            ready = dict(self.poller.poll(TICK * 1000))
            if self.err is not None and self.err in ready:
                self._read_err()
            k = -1  # nothing read
            if self.out in ready:
                k = os.readv(self.out, [buf[filled:]])
            now = time.monotonic()
            if k > 0:
                n += k
                filled += k
                last = now
                if n > max_bytes:
                    raise self._kill(FetchError(
                        "too_large", f"pipe: {self.shown} wrote over {max_bytes} bytes, more than the budget "
                                     f"allows; raise --budget / FEEDLINE_BUDGET", retry=False))
                self.limiter.take(k, self.stop)
                self._check_stop()
            if filled and (filled == len(buf) or k == 0):
                try:
                    f.write(buf[:filled])
                except OSError as exc:
                    raise self._kill(space_error(exc, f.name)) from None
                filled = 0
            if k == 0:
                self.poller.unregister(self.out)
                return n
            if now - last >= self.timeout:
                raise self._kill(FetchError("timeout", f"pipe: {self.shown} stalled: no data for {self.timeout:g} s",
                                            retry=True))
            slow = floor.moved(max(k, 0), now)
            if slow:
                raise self._kill(FetchError("timeout", f"pipe: {self.shown} too slow: {slow}", retry=True))

    def wait_exit(self) -> None:
        """After stdout's end: the command's leader exits within ``timeout`` s (left unreaped, so its process
        group id cannot be reused before the group is killed); stderr read meanwhile."""
        deadline = time.monotonic() + self.timeout
        while not _exited(self.proc):
            self._check_stop()
            if time.monotonic() >= deadline:
                raise self._kill(FetchError("timeout", f"pipe: {self.shown} closed its output but did not exit "
                                                       f"within {self.timeout:g} s", retry=True))
            if self.err is not None:
                if self.err in dict(self.poller.poll(TICK * 1000)):  # stdout, at its end, is no longer polled
                    self._read_err()
            else:
                time.sleep(0.01)
        self._drain_err()


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the command's leader has exited, leaving it unreaped (a zombie keeps its pid and group id)."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen, grace: float) -> None:
    """The command's whole process group: SIGTERM, then SIGKILL once the leader exits or ``grace`` s pass.

    Signalled only while the leader is unreaped (running or a zombie): its pid, the group's id, is then
    still held, so no other process can have taken that id."""
    if proc.returncode is not None:
        return
    if grace > 0 and not _exited(proc):
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while not _exited(proc) and time.monotonic() < deadline:
            time.sleep(0.01)
    _signal_group(proc.pid, signal.SIGKILL)  # the leader's stragglers too, once it has gone


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:  # a member that changed its user (setuid): nothing more this process can do
        pass


def _close(proc: subprocess.Popen) -> None:
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    raise


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)
