"""A Ray cluster on 127.0.0.1 owned by one object: a head node (``ray start --head --block``) and more nodes,
each optionally under ``taskset`` (one host as several machines, by CPU sets), with token authentication.

For the bench's ``remote`` section and the tests: a ``ray`` of a given venv (Ray Data's rows run from
``.venv-raydata``'s), its own temp folder, stopped by killing its processes, never by ``ray stop`` (which would
end every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from ..demo.procs import free_port


def pids_where(match: Callable[[bytes], bool]) -> list[int]:
    """Processes whose command line (NUL-separated, as /proc has it) ``match`` accepts."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if match(f.read()):
                    out.append(int(pid))
        except OSError:
            pass
    return out


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (via /proc; zombies left out)."""
    parents = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(e)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                pass
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


class RayNodes:
    """A head node and optional worker nodes on 127.0.0.1; ``address`` and ``env`` (the token) for drivers."""

    def __init__(self, cpus: int = 2, object_store_mb: int = 200, bin_dir: str | None = None,
                 taskset: str | None = None, system_config: dict[str, int] | None = None):
        self.bin_dir = bin_dir or os.path.dirname(sys.executable)
        self.token = secrets.token_hex(32)
        self.temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: Ray's socket paths have a limit
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.procs: list[subprocess.Popen] = []
        try:
            self._start(["--head", f"--port={self.port}", f"--num-cpus={cpus}", "--include-dashboard=false",
                         f"--object-store-memory={object_store_mb << 20}", f"--temp-dir={self.temp_dir}",
                         *([f"--system-config={json.dumps(system_config)}"] if system_config else [])], taskset)
            self.wait_ready(60)
        except BaseException:
            self.close()
            raise

    def _start(self, args: list[str], taskset: str | None = None) -> subprocess.Popen:
        cmd = [os.path.join(self.bin_dir, "ray"), "start", "--block", "--node-ip-address=127.0.0.1",
               "--disable-usage-stats", *args]
        if taskset:
            cmd = ["taskset", "-c", taskset, *cmd]
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def add_node(self, cpus: int, taskset: str | None = None, object_store_mb: int = 100) -> None:
        """A worker node; returns once the cluster counts its CPUs."""
        before = self.cpus()
        self._start([f"--address={self.address}", f"--num-cpus={cpus}",
                     f"--object-store-memory={object_store_mb << 20}"], taskset)
        deadline = time.monotonic() + 60
        while self.cpus() < before + cpus:
            if time.monotonic() > deadline:
                raise RuntimeError(f"a node of {cpus} CPUs did not join {self.address} within 60 s")
            time.sleep(0.5)

    def _ask(self, expr: str) -> str:
        out = subprocess.run([os.path.join(self.bin_dir, "python"), "-c",
                              f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); print({expr})"],
                             env=self.env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return out.stdout.strip().splitlines()[-1]

    def cpus(self) -> int:
        return int(float(self._ask("ray.cluster_resources().get('CPU', 0)")))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                self.cpus()
                return
            except (OSError, RuntimeError, subprocess.TimeoutExpired):
                time.sleep(0.3)
        raise RuntimeError(f"the Ray head at {self.address} did not start within {timeout} s")

    def stop(self) -> None:
        """Every process of this cluster ended at once, as when its machines go: the actors' processes (children of
        its raylets, in sessions of their own), its process groups, then anything naming its temp folder."""
        doomed: set[int] = set()
        for proc in self.procs:
            doomed |= descendants(proc.pid)
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        folder = self.temp_dir.encode()
        while (left := pids_where(lambda cmd: folder in cmd)) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self.procs = []

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "RayNodes":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
