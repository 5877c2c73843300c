"""``--quick``'s contender processes, forked from one that imported torch once (a zygote).

Each row of the bench runs in a process of its own, and a fresh Python spends about 1.8 s of CPU importing torch
and the bench before its loader starts: most of a quick row's 3.5 s. ``--quick`` checks that every row runs and
measures nothing, so its rows are forked from a ``multiprocessing`` forkserver that preloaded those imports; each
is still a process of its own, with its own stdout, stderr, environment and exit status. A measured run keeps
fresh processes: a forked row would share the server's memory layout and allocator state. (A row takes ~1.3 s
this way, ~3.6 s started afresh: ``--quick`` over the raw, JPEG, captioned, scaling and sampler rows went from 60
to 37 s here.)

Only ``python -m feedline.bench.<module> ...`` with the bench's own interpreter and Python path go this way (the
stock-Pillow rows put another Pillow first on the path, which a preloaded process cannot take back); anything
else runs as a subprocess. The server is stopped at ``close()`` (and ends with the bench's process in any case: it
reads a pipe the bench holds), and a row still running when the bench is stopped is killed, as
``subprocess.run`` kills its child. So is a row whose environment changes what Python or torch read as they start
(``AT_START``: the hash seed, torch's thread counts): the server read them before it forked.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
from typing import Any

PRELOAD = ["torch", "feedline.bench.contenders"]  # what every quick row imports first: ~1.8 s of CPU a process
MODULES = ("contenders", "e2e", "launch", "placement_bench")  # bench modules whose main(argv) a row runs
# read when Python or the preloaded torch starts: a forked row inherits the server's, whatever its env says
AT_START = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONMALLOC", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "OPENBLAS_NUM_THREADS")
_current: "Zygote | None" = None


def current() -> "Zygote | None":
    """The zygote ``--quick`` holds while it runs, or None."""
    return _current


def _row(module: str, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: the row's stdout and stderr to files, its environment, its module's main."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *argv]
    importlib.import_module(module).main(argv)
    sys.stdout.flush()
    sys.stderr.flush()


class Zygote:
    """Forks the quick rows from one server process; ``close()`` (or the context's end) stops the server."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)

    def module_of(self, cmd: list[str], env: dict[str, str] | None) -> str | None:
        """The bench module ``cmd`` runs, if a forked row can run it; None: a subprocess must (``env`` None: this
        process's, as ``subprocess.run`` takes it)."""
        if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m":
            return None
        package, _, name = cmd[2].rpartition(".")
        if package != "feedline.bench" or name not in MODULES:
            return None
        if env is not None and any(env.get(k) != os.environ.get(k) for k in AT_START):
            return None  # another Pillow first, or a setting the server read before it forked (torch's threads)
        return cmd[2]

    def run(self, module: str, argv: list[str], env: dict[str, str] | None,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """One row, as ``subprocess.run(capture_output=True, text=True)`` reports it; killed past ``timeout``."""
        with tempfile.TemporaryDirectory(prefix="feedline-zygote-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            for path in (out, err):
                open(path, "w").close()
            env = dict(os.environ) if env is None else env
            # not daemonic: a row starts processes of its own (its loader's workers)
            proc = self._ctx.Process(target=_row, args=(module, argv, env, out, err))
            proc.start()
            try:
                proc.join(timeout)
                if proc.exitcode is None:
                    raise subprocess.TimeoutExpired([module, *argv], timeout)
            finally:
                if proc.exitcode is None:  # a timeout, Ctrl-C or SIGTERM in the bench: the row goes too
                    proc.kill()
                    proc.join()
            with open(out) as f_out, open(err) as f_err:
                return subprocess.CompletedProcess([module, *argv], proc.exitcode, f_out.read(), f_err.read())

    def __enter__(self) -> "Zygote":
        global _current
        _current = self
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """The server stops now, not at the bench's exit (``_stop`` is the stop CPython's own tests use)."""
        global _current
        if _current is self:
            _current = None
        from multiprocessing import forkserver

        stop = getattr(forkserver._forkserver, "_stop", None)
        if stop is not None:
            stop()
