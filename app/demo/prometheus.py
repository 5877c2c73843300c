"""A real Prometheus (Debian's ``prometheus``) on 127.0.0.1, scraping feedline processes.

Used by the main job (``feedline demo``) and the end-to-end tests: it loads the
project's own rules from ``deploy/prometheus/rules/``, with a short scrape interval.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any

from .procs import free_port, stop_process

# The project's rule files, in the source tree (the demo and the tests run from a checkout).
RULES_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "prometheus", "rules")


class PrometheusServer:
    """Owns a prometheus process and its temporary config and data directory."""

    def __init__(self, targets: dict[str, int], scrape_interval: str = "1s", rules_dir: str = RULES_DIR,
                 binary: str = "prometheus", config_path: str | None = None):
        """Scrapes ``targets`` on 127.0.0.1 with the project's rules, or runs ``config_path`` as it is."""
        if shutil.which(binary) is None:
            raise FileNotFoundError(f"{binary} is not installed (Debian package 'prometheus'; ./scripts/setup "
                                    f"installs it)")
        self.dir = tempfile.mkdtemp(prefix="feedline-prometheus-")
        self.port = free_port()
        if config_path is not None:
            self.config_path = os.path.abspath(config_path)
            self._start(binary)
            return
        static = "\n".join(
            f'      - targets: ["127.0.0.1:{port}"]\n        labels:\n          component: {name}'
            for name, port in targets.items())
        config = (f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
                  f"rule_files:\n  - {os.path.abspath(rules_dir)}/*.yml\n"
                  f"scrape_configs:\n  - job_name: feedline\n    static_configs:\n{static}\n")
        self.config_path = os.path.join(self.dir, "prometheus.yml")
        with open(self.config_path, "w") as f:
            f.write(config)
        self._start(binary)

    def _start(self, binary: str) -> None:
        self._log = open(os.path.join(self.dir, "prometheus.log"), "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={os.path.join(self.dir, 'data')}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params: str) -> Any:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as r:
            doc = json.load(r)
        if doc.get("status") != "success":
            raise RuntimeError(f"Prometheus API {path}: {doc}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_until_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}); log in {self._log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("prometheus did not become ready")

    def wait_for(self, expr: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll until ``expr`` returns data (the first scrape lands some seconds after start)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.25)

    def close(self) -> None:
        stop_process(self.proc, "prometheus")
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "PrometheusServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
