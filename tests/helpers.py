"""Test data written as real tar shards, processes the tests start, and checks that nothing was left behind."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request

import numpy as np

from feedline.bench.ray_nodes import descendants  # noqa: F401  (every live process below a pid, via /proc)
from feedline.demo.procs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_SHARDS = 10  # shards of the remote dataset fixture (conftest: data)


def jpeg_bytes(seed: int, size: tuple[int, int] = (96, 72)) -> bytes:
    """A small photo-like JPEG (smooth gradients plus noise), different for every seed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * rng.uniform(1, 3) + y) % 256, (y * rng.uniform(1, 3)) % 256,
                    (x + y * rng.uniform(0, 2)) % 256], axis=-1)
    img = np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_tar(path: str, samples: list[tuple[str, dict[str, bytes]]], fmt: int = tarfile.PAX_FORMAT) -> str:
    with tarfile.open(path, "w", format=fmt) as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def id_samples(start: int, count: int, payload: int = 64) -> list[tuple[str, dict[str, bytes]]]:
    """Samples whose .cls is a unique id and whose .bin repeats it, so mix-ups are visible."""
    return [(f"s{i:07d}", {"cls": str(i).encode(), "bin": np.full(payload, i % 251, np.uint8).tobytes()})
            for i in range(start, start + count)]


def id_shards(directory: str, shards: int, per_shard: int, payload: int = 64) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    return [write_tar(os.path.join(directory, f"ids-{k:04d}.tar"), id_samples(k * per_shard, per_shard, payload))
            for k in range(shards)]


# Processes a module-scoped fixture owns across its tests (a Prometheus holding a run's scrapes), and the soak
# run beside the suite (background_soak.py): the per-test leak check leaves them alone; their owner checks them gone.
KEPT_FOR_THE_MODULE: set[int] = set()


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (zombies and multiprocessing's resource tracker excluded).

    The tracker is started once per interpreter by the spawn start method and exits with it.
    """
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None) if pid == os.getpid() else None
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and int(entry) != tracker:
            out.append(int(entry))
    return out


def shm_entries() -> set[str]:
    """What tests may leave in /dev/shm, less the cache of the soak run beside them (its test checks that)."""
    return {e for e in os.listdir("/dev/shm") if ("feedline" in e or e.startswith(("psm_", "wnsm_", "torch_")))
            and not e.startswith("feedline-soak-")}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone(pids, timeout: float = 10.0) -> bool:
    """True once none of ``pids`` runs (zombies count as gone)."""
    return wait_for(lambda: not any(alive(p) for p in pids), timeout)


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def shard_bytes(data) -> int:
    return os.path.getsize(data / "ids-0000.tar")


def publish_copy(store, data, k: int):
    """Publish shard ``k`` of the remote dataset into a CacheStore, as the sampler does after a download."""
    partial = store.partial_path(f"ids-{k:04d}")
    shutil.copyfile(data / f"ids-{k:04d}.tar", partial)
    return store.publish(f"ids-{k:04d}", partial)


def manifest_ids(cache: str) -> list[str]:
    from feedline.cache.manifest import read_manifest

    try:
        return [s.id for s in read_manifest(cache).shards]
    except (FileNotFoundError, ValueError):
        return []


class Sampler:
    """`feedline sample` in its own process, over the remote store's N_SHARDS shards."""

    def __init__(self, remote, cache, *args, port=None, source=None, env=None):
        self.port = port or free_port()
        source = source or f"{remote.url}/ids-{{0000..{N_SHARDS - 1:04d}}}.tar"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "feedline", "sample", "--source", source,
             "--cache", cache, "--metrics-port", str(self.port), "--progress", "false", "--retries", "1", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **env} if env else None)

    def get(self, path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return None, ""

    def metric(self, name, **labels):
        """One sample of its /metrics (0 when absent): ``metric("feedline_fetch_errors_total", reason="timeout")``."""
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_ready(self, timeout=20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            if self.get("/readyz")[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError("the sampler never became ready")

    def exit_output(self, timeout=30):
        """Its output once it exits by itself (a refusal at start-up)."""
        out, _ = self.proc.communicate(timeout=timeout)
        return out

    def stop(self, sig=signal.SIGTERM, timeout=10):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=timeout)
        return out


def caption(i: int) -> str:
    return "a photo of thing %d" % i + " and more" * (i % 7)  # lengths vary: longer than the first later


def wds_shards(directory, shards=4, per_shard=12, suffix="tar", extra=None, sizes=((64, 48), (48, 64))) -> str:
    """Shards written by webdataset.ShardWriter (jpg, cls, txt, json and an unknown member); their brace list."""
    import webdataset as wds

    os.makedirs(directory, exist_ok=True)
    with wds.ShardWriter(os.path.join(directory, f"shard-%06d.{suffix}"), maxcount=per_shard, verbose=0) as sink:
        for i in range(shards * per_shard):
            sample = {"__key__": f"{i:06d}", "jpg": jpeg_bytes(i, sizes[i % len(sizes)]), "cls": i % 5,
                      "txt": caption(i), "json": {"id": i, "tags": ["t"] * (i % 3), "ok": True},
                      "dat": bytes([i % 256]) * (1 + i % 4)}
            sample.update((extra or {}).get(i, {}))
            sink.write(sample)
    return os.path.join(directory, f"shard-{{000000..{shards - 1:06d}}}.{suffix}")


class Slow:
    """A transform that waits (a remote read, a slow disk): more workers help while the CPUs stay idle."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, sample):
        time.sleep(self.seconds)
        return sample


class Burn:
    """A transform that computes (a decode): ``rounds`` of arithmetic, CPU time that stretches when it shares a
    CPU."""

    def __init__(self, rounds: int):
        self.rounds = rounds

    def __call__(self, sample):
        burn(self.rounds)
        return sample


def burn(rounds: int) -> int:
    """A fixed amount of CPU work (its wall time grows when the CPU is shared)."""
    x = 0
    for i in range(rounds):
        x = (x * 31 + i) & 0xFFFF
    return x


PEERS_PY = os.path.join(ROOT, ".venv-peers", "bin", "python")  # tensorflow-cpu and datasets (scripts/setup-peers)


def peer_written(fmt: str, directory, *extra: str) -> dict:
    """Files the real writer of ``fmt`` made in ``directory`` (tests/peer_writer.py), and what it was given."""
    import json

    run = subprocess.run([PEERS_PY, os.path.join(ROOT, "tests", "peer_writer.py"), fmt, str(directory), *extra],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(os.path.join(directory, "given.json")) as f:
        return json.load(f)


def trained_samples(shards: str, tmp_path) -> list[int]:
    """Samples per epoch of one epoch of ``feedline train`` (the demo model) on ``shards``."""
    import json

    summary = os.path.join(tmp_path, "summary.json")
    out = subprocess.run([sys.executable, "-m", "feedline", "train", "--shards", shards, "--epochs", "1",
                          "--batch-size", "8", "--image-size", "32", "--progress", "false", "--summary-json",
                          summary, "--metrics-port", "0"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(summary) as f:
        return [e["samples"] for e in json.load(f)["epochs"]]


def within(seconds: float, call):
    """``call()``'s result or exception (``out["value"]``, ``out["error"]``), from a thread given ``seconds``; fails
    the test if it is still running (a client that would hang on a hostile store)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    return out


def store_sampler(store, cache, source, samplers, **env):
    """`feedline sample` filling ``cache`` from an object store's ``source`` with the store's environment
    (``store.env(**env)``: its endpoint and credentials), its retries quick; kept in ``samplers``."""
    s = Sampler(None, cache, "--policy", "fill", "--budget", "64MiB", "--retry-max-seconds", "2", source=source,
                env=store.env(**env))
    samplers.append(s)
    return s


def cached_ids(cache):
    """Every sample id a loader reads from ``cache`` in one epoch, sorted (2 KiB id samples)."""
    from feedline import StagingLoader

    seen = []
    with StagingLoader(cache=cache, batch_size=10, workers=1, spec={"cls": "int64", "bin": ("uint8", (2048,))}) as loader:
        for batch in loader:
            seen += batch["cls"].tolist()
    return sorted(seen)
