"""Finding the Ray cluster and asking whether it answers, without importing Ray in the training process.

``ray.init`` has no timeout of its own (it retries the cluster's control store for a minute), so the training
process first opens a TCP connection to that address itself: a cluster that is not there is refused, or fallen
back from, within ``connect_timeout`` seconds, naming the address.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import time

from ...errors import SettingError
from .settings import AUTO, INSTALL, RemoteDecode

log = logging.getLogger("feedline.loader")

CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"  # where `ray start` writes the address of the cluster it joined
MOST_AUTO_PLACES = 32  # workers="auto" with places="auto": the most places it grows onto a cluster (one proxy each here)
ASK_TIMEOUT = 60.0  # seconds the one question to the cluster (its CPUs) may take, beyond connect_timeout
_ASK = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False, configure_logging=False)
print(json.dumps(ray.cluster_resources()))
"""


def ray_installed() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except ValueError:  # sys.modules["ray"] is None: importing it is blocked
        return False


def resolve_address(address: str) -> str:
    """``auto``: ``RAY_ADDRESS``, else the cluster a local ``ray start`` joined; any other address as given."""
    if address != AUTO:
        return address
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env and env != AUTO:
        return env
    try:
        with open(CURRENT_CLUSTER) as f:
            found = f.read().strip()
    except OSError:
        found = ""
    if not found:
        raise SettingError("remote", "address 'auto' found no cluster: RAY_ADDRESS is not set and no `ray start` "
                                     f"ran on this machine ({CURRENT_CLUSTER} is missing); join one "
                                     "(`ray start --address=HEAD:6379 --num-cpus=0`) or give its address")
    return found


def host_port(address: str) -> tuple[str, int]:
    """The TCP endpoint an address names: the head's control store (``host:6379``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise SettingError("remote", f"{address!r} is not a Ray address: write host:port (the head's GCS, "
                                     f"6379 by default), or auto")
    return host.strip("[]"), int(port)


def answers(address: str, timeout: float) -> str | None:
    """None when something accepts connections at ``address`` within ``timeout`` seconds, else why not."""
    host, port = host_port(address)
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return last
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)):
                return None
        except OSError as exc:
            last = exc.strerror or str(exc)
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def check_cluster(remote: RemoteDecode) -> RemoteDecode | None:
    """The settings with the address resolved when the cluster answers; None when it does not and
    ``fallback="local"`` (a warning); refused with the address named otherwise, or when Ray is missing."""
    if not ray_installed():
        raise SettingError("remote", f"remote decoding runs on Ray, which is not installed here: {INSTALL}")
    address = resolve_address(remote.address)
    problem = answers(address, remote.connect_timeout)
    if problem is None:
        return remote.with_address(address)
    message = (f"no Ray cluster answers at {address} within {remote.connect_timeout:g} s ({problem}): start it "
               f"(`ray start --head --port=6379`), fix the address")
    if remote.fallback == "local":
        log.warning("remote: %s; decoding every worker place on this machine (fallback=local)", message)
        return None
    raise SettingError("remote", f"{message}, or set fallback=local to decode here without it")


def cluster_cpus(address: str, timeout: float) -> float | None:
    """The CPUs a Ray cluster has, asked by a short-lived driver process (the training process never imports
    Ray); None when it cannot say within ``timeout`` seconds."""
    try:
        done = subprocess.run([sys.executable, "-c", _ASK, address], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        if done.returncode == 0:
            return float(json.loads(done.stdout.strip().splitlines()[-1]).get("CPU", 0.0))
        log.warning("remote: asking %s for its CPUs failed: %s", address, done.stderr.strip()[-300:])
    except subprocess.TimeoutExpired:
        log.warning("remote: %s did not say how many CPUs it has within %.0f s", address, timeout)
    except (OSError, ValueError, IndexError, AttributeError) as exc:
        log.warning("remote: asking %s for its CPUs failed: %s", address, exc)
    return None


def remote_capacity(remote: RemoteDecode, local: int) -> int:
    """``workers="auto"``: the most places the cluster (``remote``, as ``check_cluster`` found it answering) may
    decode beyond the ``local`` ones: ``places`` when it is a number; ``auto``: the cluster's CPUs over ``cpus`` an
    actor (at most ``MOST_AUTO_PLACES``; as many as the local ones when it cannot say)."""
    if remote.places != AUTO:
        return int(remote.places)
    address = remote.address
    cpus = cluster_cpus(address, remote.connect_timeout + ASK_TIMEOUT)
    if cpus is None:
        log.warning("remote: places=auto with workers=auto grows onto at most %d places of the cluster (as many as "
                    "the local ones); give places=N to say how many", local)
        return local
    places = min(MOST_AUTO_PLACES, int(cpus // remote.cpus))
    log.info("remote: the cluster at %s has %g CPUs: at most %d places of %g CPU(s)", address, cpus, places,
             remote.cpus)
    return places


def refuse_parquet(shards: list[str]) -> None:
    """Remote decoding reads tar and TFRecord shards: Parquet is refused, before the cluster is asked anything."""
    from ...formats import parquet

    bad = next((p for p in shards if parquet.is_parquet(p)), None)
    if bad is not None:
        raise SettingError("remote", f"{bad} is a Parquet file: remote decoding reads tar and TFRecord shards "
                                     f"(a Parquet row is read through its file); decode Parquet here (no remote)")


def remote_setup(remote: RemoteDecode | None, workers: int, local_cpus: int,
                 shards: list[str], places: tuple[int, ...] | None = None) -> tuple[dict | None, tuple[int, ...]]:
    """(the RemoteDecode the proxies get, as JSON; the worker places they decode): none without ``remote`` or,
    with ``fallback="local"``, without a cluster. Checked before any worker starts. ``places``: the places
    ``workers="auto"`` may grow onto the cluster (every one beyond the local ones), else ``remote.places``'s."""
    if remote is None:
        return None, ()
    refuse_parquet(shards)
    if places is None:
        places = remote.remote_places(workers, local_cpus)  # refused before the cluster is asked
    checked = check_cluster(remote)
    if checked is None:
        return None, ()
    log.info("remote: worker places %s of %d decoded on the Ray cluster at %s", list(places), workers,
             checked.address)
    return checked.to_json(), places
