"""The sampler's benchmark: fill rate from a loopback HTTP store (against curl and urllib) and from a
local S3 server (against boto3's own parallel download), from GCS and Azure emulators (against each cloud's
own SDK), and training throughput while the sidecar fills the cache (against a pre-filled cache)."""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..cache.manifest import LOG, MANIFEST, read_manifest
from ..demo.procs import free_port, stop_process
from ..loader.tune.tuner import CpuMeter
from .rounds import rotated


class _Proc:
    """A feedline subprocess, stopped with SIGTERM (then SIGKILL) on exit."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "feedline", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **env} if env else None)

    def __enter__(self) -> "_Proc":
        return self

    def __exit__(self, *exc: object) -> None:
        stop_process(self.proc, " ".join(self.proc.args[3:5]), timeout=15)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _serve(root: str) -> tuple[_Proc, str]:
    server = _Proc("serve", root)
    assert server.proc.stdout is not None
    return server, server.proc.stdout.readline().strip()


def _until(pred: Callable[[], bool], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench: timed out waiting for {what}")
        time.sleep(0.005)
    return time.monotonic()


def _cached(cache: str) -> int:
    try:
        return len(read_manifest(cache).shards)
    except (FileNotFoundError, ValueError):
        return 0


class _Filled:
    """Whether ``count`` shards are cached, the manifest read only when it changed: polling every 5 ms, a
    JSON parse each time took CPU from the sidecar it measures (2 cores)."""

    def __init__(self, cache: str, count: int):
        self.cache, self.count, self.seen = cache, count, ()

    def __call__(self) -> bool:
        try:  # a publish appends to the log, a fold replaces both files (new inodes)
            seen = tuple((st.st_mtime_ns, st.st_ino, st.st_size)
                         for st in (os.stat(os.path.join(self.cache, name)) for name in (MANIFEST, LOG)))
        except FileNotFoundError:
            return False
        if seen == self.seen:
            return False
        self.seen = seen
        return _cached(self.cache) == self.count


def _up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
            return True
    except OSError:
        return False


def _pattern(url: str, shards: list[str]) -> str:
    first, last = os.path.basename(shards[0])[:-4], os.path.basename(shards[-1])[:-4]
    prefix = first.rsplit("-", 1)[0]
    return f"{url}/{prefix}-{{{first.rsplit('-', 1)[1]}..{last.rsplit('-', 1)[1]}}}.tar"


def _sampler(url: str, cache: str, budget: int, port: int, *extra: str, env: dict[str, str] | None = None) -> _Proc:
    return _Proc("sample", "--source", url, "--cache", cache, "--budget", str(budget), "--policy", "fill",
                 "--metrics-port", str(port), "--progress", "false", "--log-level", "WARNING", *extra, env=env)


def in_memory(src: str, shm_root: str) -> str:
    """The shards copied into /dev/shm: the store serves them from memory, so the run measures the
    network path and the cache writes, not the disk (whose page cache this machine drops at will)."""
    dst = os.path.join(shm_root, "store")
    if not os.path.isdir(dst):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.idx", "complete"))
    return dst


def _plain_http(url: str, names: list[str], out: str, threads: int) -> None:
    """The standard library's plain parallel download: urllib, one file per thread at a time."""
    def one(name: str) -> None:
        with urllib.request.urlopen(f"{url}/{name}", timeout=60) as r, open(os.path.join(out, name), "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, names))


def _timed(fn: Callable[[], object], mark: Callable[[], None] | None = None) -> float:
    if mark is not None:
        mark()
    t0 = time.monotonic()
    fn()
    t = time.monotonic() - t0
    if mark is not None:
        mark()
    return t


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc: the emulators are not our children's kin)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _sidecar_fill(source: str, cache: str, budget: int, count: int, threads: int,
                  env: dict[str, str] | None = None, mark: Callable[[], None] | None = None) -> float:
    """Seconds from the sidecar's start of work (/healthz answers) to ``count`` shards cached; ``mark()`` is
    called at both ends of that span."""
    port = free_port()
    with _sampler(source, cache, budget, port, "--fetch-threads", str(threads), env=env):
        t_up = _until(lambda: _up(port), 60, "the sampler to start")
        if mark is not None:
            mark()
        t_all = _until(_Filled(cache, count), 300, "the cache to fill")
        if mark is not None:
            mark()
    shutil.rmtree(cache)
    return t_all - t_up


FILL_REPS = 7  # a 1 GB fill lasts half a second: one of this machine's slow spells halves a round (either side's)


def fill_rate(src: str, shm_root: str, threads: int = 4, reps: int = FILL_REPS) -> dict[str, Any]:
    """The sidecar filling an empty cache from a loopback HTTP store, against curl and urllib fetching the
    same files with as many parallel transfers; medians of ``reps`` interleaved rounds, and the median of the
    per-round ratios (both sides of a ratio from the same round, as every other row's ratio)."""
    src = in_memory(src, shm_root)
    shards = sorted(glob.glob(os.path.join(src, "*.tar")))
    names = [os.path.basename(s) for s in shards]
    total = sum(os.path.getsize(s) for s in shards)
    out = os.path.join(shm_root, "out")
    times: dict[str, list[float]] = {"sidecar": [], "curl": [], "urllib": []}
    server, url = _serve(src)

    def sidecar() -> float:
        return _sidecar_fill(_pattern(url, shards), os.path.join(shm_root, "fill"), 2 * total, len(shards), threads)

    def curl() -> float:
        cmd = ["curl", "-s", "-f", "--parallel", "--parallel-max", str(threads)]
        for n in names:
            cmd += ["-o", os.path.join(out, n), f"{url}/{n}"]
        return _into(out, lambda: subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL))

    def urllib_() -> float:
        return _into(out, lambda: _plain_http(url, names, out, threads))

    runs = {"sidecar": sidecar, "curl": curl, "urllib": urllib_}
    with server:
        warm = 1 if reps > 1 else 0  # a --quick run (one rep) is a check, not a measurement: no warm-up
        for rep in range(reps + warm):  # the first round warms this machine's tmpfs up and is not counted
            for who in rotated(list(runs), rep):  # none always runs first (after the last round's 1 GB is freed)
                times[who].append(runs[who]())
            if warm and rep == 0:
                times = {k: [] for k in times}
    gb = {k: [total / t / 1e9 for t in v] for k, v in times.items()}
    return {"shards": len(shards), "bytes": total, "threads": threads, "reps": reps,
            "sampler_gb_per_s": _median(gb["sidecar"]), "curl_gb_per_s": _median(gb["curl"]),
            "urllib_gb_per_s": _median(gb["urllib"]), "runs_gb_per_s": gb,
            "ratios": {peer: per_round_ratio(gb["sidecar"], gb[peer]) for peer in ("curl", "urllib")}}


def _into(out: str, fetch: Callable[[], object]) -> float:
    """Seconds ``fetch`` takes to write into the empty directory ``out``, which is removed after."""
    os.makedirs(out)
    try:
        return _timed(fetch)
    finally:
        shutil.rmtree(out)


def per_round_ratio(ours: list[float], theirs: list[float]) -> list[float]:
    """``[median, min, max]`` of ``ours[i] / theirs[i]``: rounds measured side by side, compared side by side."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return [statistics.median(ratios), min(ratios), max(ratios)]


def s3_fill_rate(src: str, shm_root: str, threads: int = 4, count: int | None = None, reps: int = 3) -> dict[str, Any]:
    """The sidecar filling from a local S3 server (moto) against boto3's own parallel download of the
    same keys (``download_file`` in as many threads); medians of ``reps`` interleaved runs. Every shard of
    ``src`` unless ``count`` says fewer: a fill of GBs is steady, one of a few objects mostly start-up."""
    from ..demo.s3store import S3Store

    src = in_memory(src, shm_root)
    names = sorted(os.path.basename(s) for s in glob.glob(os.path.join(src, "*.tar")))[:count]
    total = sum(os.path.getsize(os.path.join(src, n)) for n in names)
    out = os.path.join(shm_root, "out")
    times: dict[str, list[float]] = {"sidecar": [], "boto3": []}
    with S3Store("bench") as store:
        keys = store.upload(src, "raw", names)
        first, last = names[0][:-4].rsplit("-", 1), names[-1][:-4].rsplit("-", 1)[1]
        source = f"s3://bench/raw/{first[0]}-{{{first[1]}..{last}}}.tar"

        import boto3
        from botocore.config import Config

        # boto3 as a user would call it, with a connection pool for its threads x download_file's own 10
        client = boto3.client("s3", config=Config(max_pool_connections=10 * threads), **store.client_args())

        def plain() -> None:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda k: client.download_file("bench", k, os.path.join(out, k[4:])), keys))

        for _ in range(reps):
            times["sidecar"].append(_sidecar_fill(source, os.path.join(shm_root, "fill"), 2 * total, len(names),
                                                  threads, env=store.env()))
            os.makedirs(out)
            times["boto3"].append(_timed(plain))
            shutil.rmtree(out)
    mb = {k: [total / t / 1e6 for t in v] for k, v in times.items()}
    return {"shards": len(names), "bytes": total, "threads": threads, "reps": reps,
            "sampler_mb_per_s": _median(mb["sidecar"]), "boto3_mb_per_s": _median(mb["boto3"]), "runs_mb_per_s": mb}


def _cloud_fill_rate(kind: str, src: str, shm_root: str, threads: int, count: int | None, reps: int) -> dict[str, Any]:
    """The sidecar filling from a local emulator (fake-gcs-server or Azurite) against that cloud's own Python
    SDK downloading the same objects with its defaults, in as many threads; medians of ``reps`` interleaved
    runs, after one warm-up round of each. Every shard of ``src`` (32, 1.08 GB in the bench) unless ``count``
    says fewer: 8 of them (0.27 GB, 0.3 s at these rates) came down in two waves of four, where the sidecar's
    first connections, a fresh process's, were a sixth of the run."""
    from ..demo.cloudstores import AzuriteEmulator, GcsEmulator

    src = in_memory(src, shm_root)
    names = sorted(os.path.basename(s) for s in glob.glob(os.path.join(src, "*.tar")))[:count]
    total = sum(os.path.getsize(os.path.join(src, n)) for n in names)
    out = os.path.join(shm_root, "out")
    sdk_name = "google-cloud-storage" if kind == "gcs" else "azure-storage-blob"
    times: dict[str, list[float]] = {"sidecar": [], sdk_name: []}
    busy: dict[str, list[float]] = {"sidecar": [], sdk_name: []}  # the emulator's cores busy during each run
    machine: dict[str, list[float]] = {"sidecar": [], sdk_name: []}  # and the whole machine's
    server: Any = GcsEmulator("bench") if kind == "gcs" else AzuriteEmulator("bench")
    with server:
        keys = server.upload(src, "raw", names)
        first, last = names[0][:-4].rsplit("-", 1), names[-1][:-4].rsplit("-", 1)[1]
        scheme = "gs" if kind == "gcs" else "az"
        source = f"{scheme}://bench/raw/{first[0]}-{{{first[1]}..{last}}}.tar"
        env = server.env()

        if kind == "gcs":
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            os.environ["STORAGE_EMULATOR_HOST"] = server.url  # the SDK's own way to an emulator
            bucket = storage.Client(project="bench", credentials=AnonymousCredentials()).bucket("bench")

            def one(key: str) -> None:
                bucket.blob(key).download_to_filename(os.path.join(out, key[4:]))
        else:
            from azure.storage.blob import BlobServiceClient

            service = BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"])
            container = service.get_container_client("bench")

            def one(key: str) -> None:
                with open(os.path.join(out, key[4:]), "wb") as f:
                    container.download_blob(key).readinto(f)

        def plain() -> None:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, keys))

        meter, cores = CpuMeter(), len(os.sched_getaffinity(0))
        marks: list[tuple[float, float]] = []  # (the emulator's CPU seconds, the machine's busy cores since before)

        def mark() -> None:
            marks.append((_cpu_seconds(server.proc.pid), cores - meter.idle_cpus()))

        def measured(who: str, run: Callable[[], float]) -> None:
            marks.clear()
            times[who].append(run())
            (server0, _), (server1, machine_busy) = marks[0], marks[-1]
            busy[who].append((server1 - server0) / times[who][-1])
            machine[who].append(machine_busy)

        try:
            warm = 1 if reps > 1 else 0  # a --quick run (one rep) is a check, not a measurement: no warm-up
            for rep in range(reps + warm):  # the first round warms the emulator and this machine up: not counted
                measured("sidecar", lambda: _sidecar_fill(source, os.path.join(shm_root, "fill"), 2 * total,
                                                          len(names), threads, env=env, mark=mark))
                os.makedirs(out)
                measured(sdk_name, lambda: _timed(plain, mark))
                shutil.rmtree(out)
                if rep == 0 and warm:
                    times, busy, machine = ({k: [] for k in times} for _ in range(3))
        finally:
            if kind == "gcs":
                os.environ.pop("STORAGE_EMULATOR_HOST", None)
            else:
                service.close()
    mb = {k: [total / t / 1e6 for t in v] for k, v in times.items()}
    sampler, sdk = _median(mb["sidecar"]), _median(mb[sdk_name])
    return {"shards": len(names), "bytes": total, "threads": threads, "reps": reps, "sdk": sdk_name,
            "sampler_mb_per_s": sampler, "sdk_mb_per_s": sdk, "ratio": sampler / sdk, "runs_mb_per_s": mb,
            "server_cores": {"sampler": _median(busy["sidecar"]), "sdk": _median(busy[sdk_name])},
            "machine_cores": {"sampler": _median(machine["sidecar"]), "sdk": _median(machine[sdk_name])},
            "cores": cores}


def gcs_fill_rate(src: str, shm_root: str, threads: int = 4, count: int | None = None,
                  reps: int = 3) -> dict[str, Any]:
    """The sidecar filling from fake-gcs-server against google-cloud-storage's ``Blob.download_to_filename``
    of the same objects in as many threads (``_cloud_fill_rate``)."""
    return _cloud_fill_rate("gcs", src, shm_root, threads, count, reps)


def azure_fill_rate(src: str, shm_root: str, threads: int = 4, count: int | None = None,
                    reps: int = 3) -> dict[str, Any]:
    """The sidecar filling from Azurite against azure-storage-blob's ``download_blob().readinto`` of the same
    blobs in as many threads (``_cloud_fill_rate``)."""
    return _cloud_fill_rate("azure", src, shm_root, threads, count, reps)


def cloud_fill_rates(src: str, shm_root: str, reps: int) -> dict[str, dict[str, Any]]:
    """Issue 51's rows: the sidecar from each cloud's emulator against that cloud's SDK (``gcs``, ``azure``)."""
    out = {}
    for name, rate in (("gcs", gcs_fill_rate), ("azure", azure_fill_rate)):
        print(f"  sampler: fill rate from the {name} emulator, sidecar vs its SDK ...", file=sys.stderr, flush=True)
        out[name] = rate(src, shm_root, reps=reps, count=None if reps > 1 else 2)  # --quick: a check, 2 objects
        print(f"        sidecar {out[name]['sampler_mb_per_s']:.0f} MB/s, {out[name]['sdk']} "
              f"{out[name]['sdk_mb_per_s']:.0f} MB/s", file=sys.stderr, flush=True)
    return out


def train_while_filling(src: str, shm_root: str, run_contender: Callable[..., dict[str, Any]],
                        seconds: float, rounds: int = 3) -> dict[str, Any]:
    """The loader on a pre-filled cache and on an empty cache the sidecar fills during the run, in
    ``rounds`` interleaved pairs; the ratio is the median of the rounds' ratios (one pair swings by
    5-10 % on this machine)."""
    src = in_memory(src, shm_root)
    shards = sorted(glob.glob(os.path.join(src, "*.tar")))
    total = sum(os.path.getsize(s) for s in shards)
    runs: dict[str, list[dict[str, Any]]] = {"prefilled": [], "filling": []}
    at_end = []
    server, url = _serve(src)
    with server:
        pattern = _pattern(url, shards)
        pre = os.path.join(shm_root, "prefilled")
        with _sampler(pattern, pre, 2 * total, free_port()):
            _until(lambda: _cached(pre) == len(shards), 300, "the cache to fill")
        cap_mbps = total / 1e6 / seconds  # the fill spans the measured window
        for _ in range(rounds):
            runs["prefilled"].append(run_contender("--cache", pre))
            live = os.path.join(shm_root, "filling")
            with _sampler(pattern, live, 2 * total, free_port(), "--max-mbps", f"{cap_mbps:.3f}"):
                runs["filling"].append(run_contender("--cache", live))
                at_end.append(_cached(live))
            shutil.rmtree(live)
    ratios = [f["samples_per_s"] / p["samples_per_s"] for p, f in zip(runs["prefilled"], runs["filling"])]
    mid = ratios.index(_median(ratios))
    return {"prefilled": runs["prefilled"][mid], "filling": runs["filling"][mid], "ratio": ratios[mid],
            "ratios": ratios, "rounds": rounds, "fill_mb_per_s": cap_mbps, "shards": len(shards),
            "shards_cached_at_end": at_end[mid]}
