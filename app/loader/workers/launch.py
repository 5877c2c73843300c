"""Worker processes in a fresh interpreter that never re-runs the training script unless it must.

multiprocessing's ``spawn`` re-executes the training script's top level in every
worker (as ``__mp_main__``) so that whatever the script defined can be unpickled
there. A script written without ``if __name__ == "__main__":`` — most notebooks
and quick scripts — then builds a loader inside each worker and dies while
bootstrapping. This launcher starts ``python -c ...`` with the trainer's
``sys.path``, hands it the descriptors of its pipes, ring and stack by number, and sends
it the worker configuration pickled (the user's transform and decoders: code the
user gave, never data). The script is imported in the worker only when that
configuration refers to something defined in it; if the script's top level
would then start training again (no main guard, a notebook, stdin), the loader
is refused before any worker starts, with the change to make named.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import io
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Any

from ...errors import SettingError
from .pipes import TrainerEnds, worker_pipes



@dataclass(frozen=True)
class MainScript:
    """How the training script can be imported in a worker: a file path, or a module name (``python -m``)."""

    path: str | None
    module: str | None


class _MainRecorder(pickle.Pickler):
    """Pickles normally, noting every class and function that lives in ``__main__``."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.from_main: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.from_main.append(f"{'class' if isinstance(obj, type) else 'function'} {obj.__qualname__}")
        return NotImplemented


def _guarded_lines(path: str) -> list[tuple[int, int]]:
    """Line ranges of ``if __name__ == "__main__":`` blocks at the top level of a script."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    out = []
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__" and \
                any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators):
            out.append((node.lineno, node.end_lineno or node.lineno))
    return out


def _unguarded_line(main: types.ModuleType, path: str) -> int | None:
    """The script line now running at its top level outside a main guard, if any (so: under construction there)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
            return None if any(a <= line <= b for a, b in _guarded_lines(path)) else line
        frame = frame.f_back  # type: ignore[assignment]
    return None


def main_script() -> MainScript:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(main, "__file__", None)
    return MainScript(path if path and os.path.isfile(path) else None, getattr(spec, "name", None))


def pickle_config(config: Any) -> tuple[bytes, MainScript | None]:
    """(the configuration pickled, and the script the worker must import first, or None).

    Refuses, naming the fix, a configuration that refers to the script where the worker cannot
    import it, or where importing it would start the training again.
    """
    buf = io.BytesIO()
    recorder = _MainRecorder(buf)
    try:
        recorder.dump(config)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise SettingError("transform", f"cannot be sent to the worker processes: {exc}. Transforms and decoders "
                                        f"must be picklable: a class or a module-level function, not a lambda or "
                                        f"a function defined inside another") from None
    if not recorder.from_main:
        return buf.getvalue(), None
    what = ", ".join(dict.fromkeys(recorder.from_main))
    script = main_script()
    if script.path is None and script.module is None:
        raise SettingError("transform", f"{what} is defined in __main__ (a notebook, stdin or python -c), which a "
                                        f"worker process cannot import: move it into a .py module next to your "
                                        f"code and import it from there")
    line = _unguarded_line(sys.modules["__main__"], script.path) if script.path else None
    if line is not None:
        raise SettingError("transform", f"{what} is defined in the training script {script.path}, whose top level "
                                        f"(line {line}) starts the training: a worker importing the script to find "
                                        f"{what} would start it again. Move {what} into a module of its own and "
                                        f"import it, or put the training code under `if __name__ == \"__main__\":`")
    return buf.getvalue(), script


class WorkerProcess:
    """One worker in a fresh interpreter, started by ``os.posix_spawn``; the part of ``Popen`` the supervisor uses.

    Its pidfd (``sentinel``) says when it exits and signals exactly this process, never a reused pid.
    The dispatcher and the memory watcher both ask ``is_alive()``: one ``waitpid`` at a time, so the
    exit code is never lost to the other's ``ChildProcessError``.
    """

    def __init__(self, pid: int):
        self.pid = pid
        self._exitcode: int | None = None
        self._reaping = threading.Lock()
        try:
            self.sentinel: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfds (old kernel): the pipe's end of file tells instead
            self.sentinel = None

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None:
            with self._reaping:
                if self._exitcode is None:
                    try:
                        pid, status = os.waitpid(self.pid, os.WNOHANG)
                    except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored, os.wait()): gone all the same
                        self._exitcode = -1
                    else:
                        if pid:
                            self._exitcode = os.waitstatus_to_exitcode(status)
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if self.sentinel is not None:
                select.select([self.sentinel], [], [], left)
            else:
                time.sleep(0.01 if left is None else min(0.01, left))

    def kill(self) -> None:
        if self.exitcode is not None:
            return
        try:
            if self.sentinel is not None:
                signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


def spawn(argv: list[str], fds: list[int]) -> int:
    """Start ``argv`` with exactly ``fds`` (at their numbers) besides stdout and stderr; stdin is /dev/null.

    ``subprocess.Popen`` cannot be used here: it waits on an error pipe until the child has exec'd, and a
    process that another thread forks in that moment (a DataLoader worker, any library's pool) inherits
    the pipe's write end and holds it open for its life: the start, and the loader, then wait for ever.
    glibc's ``posix_spawn`` reports a failed exec through memory the child shares until it execs
    (``CLONE_VFORK``), with no descriptor another fork could inherit (musl's waits on a pipe, as Popen does:
    the image and the supported hosts are glibc). A ``dup2`` of a descriptor onto
    itself clears its close-on-exec flag, so only the descriptors named here reach the worker.
    """
    actions: list[tuple[Any, ...]] = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
    actions += [(os.POSIX_SPAWN_DUP2, fd, fd) for fd in fds]
    return os.posix_spawn(argv[0], argv, os.environ, file_actions=actions, setsigmask=(),
                          setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))


def _close_inherited(keep: set[int]) -> None:
    """Close every descriptor a worker inherited but was not given (posix_spawn, unlike close_fds, keeps
    the trainer's inheritable ones)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:  # the listing's own descriptor, already closed
                pass


def _die_with_parent(trainer: int) -> None:
    """Ask the kernel to kill this worker when the trainer goes (even by SIGKILL); exit if it already has."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != trainer:  # it died before the request took effect
        os._exit(0)


def child(header: dict[str, Any]) -> None:
    """The worker's entry point: import the script if needed, load the user's code, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    _die_with_parent(header["trainer"])
    if header.get("cpus"):  # its CPUs (the trainer set them too, as it spawned): every thread it starts stays there
        from ..cpus.pinning import pin_self

        pin_self(header["cpus"])
    from .heap import reuse_large_buffers

    reuse_large_buffers()
    _close_inherited({0, 1, 2, header["commands"], header["results"], header["stack"], header["code_fd"],
                      *header["shared"], *header["shard_fds"].values()})
    from .messages import STACK_SIGNAL, encode_fatal

    # armed before the user's code loads: a start that hangs there shows its stack too
    faulthandler.register(STACK_SIGNAL, file=header["stack"], all_threads=True)
    from .pipes import Duplex, WorkerEnds

    conn = Duplex(WorkerEnds(header["commands"], header["results"]))
    try:
        _import_main(header["main_path"], header["main_module"])
        code = pickle.loads(_read_all(header["code_fd"], header["code_size"]))
    except Exception as exc:
        hint = ""
        if isinstance(exc, AttributeError) and (header["main_path"] or header["main_module"]):
            hint = (" (a worker imports the training script without running its `if __name__ == \"__main__\":` "
                    "block: define the transform at the script's top level or in a module)")
        conn.send_bytes(encode_fatal(f"worker {header['worker_id']} could not start: {type(exc).__name__}: "
                                     f"{exc}{hint}"))
        raise SystemExit(1) from None
    finally:
        os.close(header["code_fd"])
    from .worker import WorkerArgs, WorkerSetup, worker_main

    worker_main(WorkerArgs(header["worker_id"], conn, header["stack"], WorkerSetup.from_json(header["setup"]), code,
                           header["shard_fds"]))


def _read_all(fd: int, size: int) -> bytes:
    chunks, off = [], 0
    while off < size:
        chunk = os.pread(fd, size - off, off)
        if not chunk:
            raise EOFError(f"the worker code ends after {off} of {size} bytes")
        chunks.append(chunk)
        off += len(chunk)
    return b"".join(chunks)


def _import_main(path: str | None, module: str | None) -> None:
    """Import the training script as ``__mp_main__`` (its guarded code does not run), as spawn does."""
    import runpy

    if module is not None:
        content = runpy.run_module(module, run_name="__mp_main__", alter_sys=True)
    elif path is not None:
        content = runpy.run_path(path, run_name="__mp_main__")
    else:
        return
    main = types.ModuleType("__mp_main__")
    main.__dict__.update(content)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main


class Launcher:
    """Starts the workers of one loader: the user's code pickled once into a memfd, the script to import.

    Owns that memfd (``close()``); every worker reads it through an inherited descriptor, so starting
    one never waits on a pipe, whatever the size of the transform.
    """

    def __init__(self, code: Any):
        self.payload, self.script = pickle_config(code)
        self._fd = os.memfd_create("feedline-worker-code", os.MFD_CLOEXEC)
        try:
            view, off = memoryview(self.payload), 0
            while off < len(view):
                off += os.write(self._fd, view[off:])
        except BaseException:
            os.close(self._fd)
            raise

    def code(self) -> Any:
        """A fresh copy of the user's code, as a worker gets it (for the probe: the original stays unused)."""
        return pickle.loads(self.payload)

    def start(self, worker_id: int, setup: dict[str, Any], shared_fds: list[int],
              shard_fds: dict[str, int] | None = None,
              cpus: tuple[int, ...] = ()) -> tuple[WorkerProcess, TrainerEnds, int]:
        """(the process, the trainer's ends of its pipes, the read end of its stack pipe); ``shard_fds`` are the
        epoch's shards the trainer holds (``held.py``), inherited at their numbers; ``cpus``: where it runs (CPU
        placement; it would otherwise start on the training process's CPUs, whose mask it inherits)."""
        parent, child_end = worker_pipes()
        stack_r, stack_w = os.pipe()
        os.set_blocking(stack_r, False)
        header = {"worker_id": worker_id, "commands": child_end.commands, "results": child_end.results,
                  "stack": stack_w, "code_fd": self._fd,
                  "code_size": len(self.payload), "setup": setup, "trainer": os.getpid(), "shared": shared_fds,
                  "shard_fds": dict(shard_fds or {}), "cpus": list(cpus),
                  "main_path": self.script.path if self.script else None,
                  "main_module": self.script.module if self.script else None}
        entry = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
                 f"from {__name__} import child; child(json.loads(sys.argv[2]))")
        argv = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", entry, json.dumps(sys.path),
                json.dumps(header)]
        try:
            pid = spawn(argv, [*child_end, stack_w, self._fd, *shared_fds, *(shard_fds or {}).values()])
            if cpus:  # at once: the interpreter's start and imports already run there
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(pid, cpus)
        except BaseException:
            for fd in (*parent, stack_r):
                os.close(fd)
            raise
        finally:
            for fd in (*child_end, stack_w):
                os.close(fd)
        return WorkerProcess(pid), parent, stack_r

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
