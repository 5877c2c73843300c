"""Remote decode on a real Ray cluster (127.0.0.1, token auth): the loop sees the same batches with remote decoding
off, for some worker places, or for all; actors killed or a cluster stopped mid-epoch lose nothing and repeat
nothing; an address nobody answers is refused within its bound."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers import KEPT_FOR_THE_MODULE, ROOT, jpeg_bytes, write_tar
from ray_cluster import RayCluster, actor_pids, free_port

from feedline import SettingError, StagingLoader
from feedline.formats.transforms import RandomResizedCrop
from feedline.loader.remote.settings import RemoteDecode

pytestmark = pytest.mark.xdist_group("ray")

BATCH = 6


@pytest.fixture(scope="module")
def cluster():
    c = RayCluster(cpus=2)
    kept = {p.pid for p in c.procs}
    KEPT_FOR_THE_MODULE.update(kept)
    try:
        yield c
    finally:
        c.close()
        KEPT_FOR_THE_MODULE.difference_update(kept)


@pytest.fixture(autouse=True)
def token(cluster, monkeypatch):
    """The training process and its proxies carry the cluster's token, as every node and driver must."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.token)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """4 shards of JPEGs of two sizes (a crop makes them one), one of them corrupt."""
    d = tmp_path_factory.mktemp("remote-shards")
    for s in range(4):
        samples = []
        for i in range(10):
            k = s * 10 + i
            jpg = b"not a jpeg at all" if k == 13 else jpeg_bytes(k, (64, 48) if k % 2 else (48, 64))
            samples.append((f"s{k:03d}", {"jpg": jpg, "cls": str(k).encode()}))
        write_tar(str(d / f"shard-{s}.tar"), samples)
    return str(d / "shard-{0..3}.tar")


def crop():
    return RandomResizedCrop(24, fields=["jpg"])


def batches(shards, remote=None, **kwargs):
    """Every batch of an epoch (the pixels, the labels, the keys) and the loader's stats at its end."""
    out = []
    with StagingLoader(shards, batch_size=BATCH, workers=2, transform=crop(), seed=7, remote=remote,
                       **kwargs) as loader:
        for b in loader:
            out.append((b["jpg"].clone(), [int(c) for c in b["cls"]], list(b["__key__"])))
        return out, loader.stats()


def same(a, b):
    assert len(a) == len(b)
    for (pa, ca, ka), (pb, cb, kb) in zip(a, b):
        assert ka == kb and ca == cb
        assert torch.equal(pa, pb), ka


@pytest.fixture(scope="module")
def local(shards):
    return batches(shards)


@pytest.fixture(scope="module")
def two_places(cluster, shards):
    """The epoch decoded by two remote places (the stream, the default): read by more than one test. (Made before
    the function-scoped ``token`` runs: it carries the token itself.)"""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "token")
        mp.setenv("RAY_AUTH_TOKEN", cluster.token)
        return batches(shards, f"{cluster.address},places=2")


def test_batches_are_bit_identical_with_remote_decoding_off_for_some_places_and_for_all(cluster, shards, local,
                                                                                      two_places):
    expected, stats = local
    assert stats.batches_decoded_total == {"local": len(expected), "remote": 0}
    assert stats.worker_places == {"local": 2, "remote": 0}
    for places, stream in ((1, True), (2, True), (2, False)):  # stream off: calls and slots through Ray
        if (places, stream) == (2, True):
            got, stats = two_places
        else:
            got, stats = batches(shards, RemoteDecode(cluster.address, places=places, stream=stream))
        same(got, expected)
        assert stats.batches_decoded_total["remote"] > 0
        remote = stats.batches_decoded_total["remote"]
        assert stats.batches_decoded_total["local"] == (0 if places == 2 else len(expected) - remote)
        assert stats.worker_places == {"local": 2 - places, "remote": places}  # where each place's last batch was
        assert stats.remote_bytes_total["sent"] > 0 and stats.remote_bytes_total["received"] > 0


def test_a_corrupt_sample_decoded_remotely_is_skipped_and_counted_like_a_local_one(two_places, local):
    got, stats = two_places
    assert stats.sample_errors_total["corrupt"] == local[1].sample_errors_total["corrupt"] == 1
    assert sum(len(c) for _, c, _ in got) == 39 and 13 not in [k for _, c, _ in got for k in c]


def test_batches_that_skip_many_bad_samples_are_the_same_remote_as_local(cluster, tmp_path):
    """Every third sample bad: a batch needs more samples than it was sent, so the batch after it, already in
    flight with the samples it would take, is formed again; what the loop sees does not change."""
    for s in range(3):
        samples = [(f"b{s}{i:02d}", {"jpg": b"bad" if i % 3 == 1 else jpeg_bytes(s * 30 + i, (40, 40)),
                                     "cls": str(s * 30 + i).encode()}) for i in range(30)]
        write_tar(str(tmp_path / f"bad-{s}.tar"), samples)
    pattern = str(tmp_path / "bad-{0..2}.tar")
    local, local_stats = batches(pattern, max_sample_errors=0.5)
    for options in ("inflight=3", "stream=off"):  # three batches formed again behind one; calls through Ray
        remote, remote_stats = batches(pattern, f"{cluster.address},places=2,{options}", max_sample_errors=0.5)
        same(remote, local)
        assert remote_stats.sample_errors_total["corrupt"] == local_stats.sample_errors_total["corrupt"] == 30
        assert remote_stats.batches_decoded_total["local"] == 0


def test_a_state_saved_with_remote_decoding_resumes_exactly_without_it_and_back(cluster, shards, local):
    expected, _ = local
    for saved_with, resumed_with in ((f"{cluster.address},places=2", None), (None, f"{cluster.address},places=1")):
        with StagingLoader(shards, batch_size=BATCH, workers=2, transform=crop(), seed=7, remote=saved_with) as loader:
            it = iter(loader)
            for _ in range(2):
                next(it)
            state = json.loads(json.dumps(loader.state_dict()))
        with StagingLoader(shards, batch_size=BATCH, workers=2, transform=crop(), seed=7,
                           remote=resumed_with) as loader:
            loader.load_state_dict(state)
            rest = [(b["jpg"].clone(), [int(c) for c in b["cls"]], list(b["__key__"])) for b in loader]
        same(rest, expected[2:])


class SlowCrop(RandomResizedCrop):
    """A crop that takes 50 ms a sample: long enough batches to kill an actor in the middle of one."""

    def __call__(self, sample):
        time.sleep(0.05)
        return super().__call__(sample)


def test_an_actor_killed_mid_batch_is_replaced_and_nothing_is_lost_or_repeated(cluster, shards, local):
    expected, _ = local
    killed = []
    running = []

    def killer():
        """Once both places' last batches came from actors (each has taken its actor, and holds its next batch on
        it), one actor is killed: not one still starting, which its place would replace before using it."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            pids = actor_pids()
            if running and len(pids) == 2 and running[0].stats().worker_places["remote"] == 2:
                try:
                    os.kill(pids[0], signal.SIGKILL)
                except ProcessLookupError:  # gone meanwhile (listed as it ended): the next look finds the others
                    continue
                killed.append(pids[0])
            time.sleep(0.02)

    t = threading.Thread(target=killer, daemon=True)
    out = []
    with StagingLoader(shards, batch_size=BATCH, workers=2, transform=SlowCrop(24, fields=["jpg"]), seed=7,
                       remote=f"{cluster.address},places=2") as loader:
        running.append(loader)
        t.start()
        for b in loader:
            out.append((b["jpg"].clone(), [int(c) for c in b["cls"]], list(b["__key__"])))
        stats = loader.stats()
    t.join()
    assert killed
    same(out, expected)
    assert stats.remote_redone_batches_total >= 1  # decoded again (here, while a new actor started)
    assert stats.batches_decoded_total["remote"] > 0


def test_a_cluster_stopped_mid_epoch_leaves_the_epoch_to_local_decoding(shards, local, monkeypatch, caplog):
    expected, _ = local
    other = RayCluster(cpus=2)
    monkeypatch.setenv("RAY_AUTH_TOKEN", other.token)
    try:
        out = []
        with StagingLoader(shards, batch_size=BATCH, workers=2, transform=SlowCrop(24, fields=["jpg"]), seed=7,
                           remote=f"{other.address},places=2", stall_timeout=60) as loader:
            t0 = time.monotonic()
            for i, b in enumerate(loader):
                out.append((b["jpg"].clone(), [int(c) for c in b["cls"]], list(b["__key__"])))
                if i == 0:  # the places are in their second batches: at least half the epoch is left
                    other.stop()
            stats = loader.stats()
        took = time.monotonic() - t0
    finally:
        other.close()
    same(out, expected)
    assert stats.batches_decoded_total["remote"] >= 1 and stats.batches_decoded_total["local"] >= 1
    assert took < 60, took


def test_a_node_that_joins_mid_epoch_takes_the_place_that_had_no_actor(tmp_path, monkeypatch):
    """One CPU in the cluster for two remote places: the second has no actor and decodes here; a node joins in
    the middle of the epoch, its actor starts there and the place goes remote; the batches do not change."""
    for s in range(4):
        write_tar(str(tmp_path / f"j-{s}.tar"), [(f"j{s}{i:02d}", {"jpg": jpeg_bytes(s * 40 + i, (40, 40)),
                                                                   "cls": str(s * 40 + i).encode()})
                                                  for i in range(40)])
    pattern = str(tmp_path / "j-{0..3}.tar")
    expected, _ = batches(pattern)
    small = RayCluster(cpus=1)
    monkeypatch.setenv("RAY_AUTH_TOKEN", small.token)
    try:
        out = []
        with StagingLoader(pattern, batch_size=BATCH, workers=2, transform=SlowCrop(24, fields=["jpg"]), seed=7,
                           remote=f"{small.address},places=2,connect_timeout=2") as loader:
            for i, b in enumerate(loader):
                out.append((b["jpg"].clone(), [int(c) for c in b["cls"]], list(b["__key__"])))
                if i == 0:
                    small.add_node(1)  # returns once the cluster counts its CPU
            stats = loader.stats()
    finally:
        small.close()
    same(out, expected)
    n = len(out)
    # in order, each place delivers every other batch: more than half came from actors only if the second place's
    # did too, once the node had joined
    assert n // 2 < stats.batches_decoded_total["remote"] < n, stats.batches_decoded_total


class Sleepy(RandomResizedCrop):
    """A crop that takes 20 ms a sample without using a CPU: one local worker cannot feed a loop with no step."""

    def __call__(self, sample):
        time.sleep(0.02)
        return super().__call__(sample)


@pytest.fixture
def one_local_cpu():
    """The training process on one CPU (its workers on it too), whatever this machine has: auto's local places
    are 1."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@pytest.fixture(scope="module")
def long_epoch(tmp_path_factory):
    """480 small JPEGs: ~10 s for one worker of ``Sleepy``, long enough for auto's windows."""
    d = tmp_path_factory.mktemp("long-epoch")
    for s in range(4):
        write_tar(str(d / f"l-{s}.tar"), [(f"l{s}{i:03d}", {"jpg": jpeg_bytes(s * 120 + i, (32, 32)),
                                                           "cls": str(s * 120 + i).encode()}) for i in range(120)])
    return str(d / "l-{0..3}.tar")


def test_auto_workers_grow_onto_the_cluster_once_the_local_cpus_are_used(cluster, long_epoch, one_local_cpu,
                                                                         caplog):
    """Pecan's rule: the local places first, the cluster's for the rest, as many as the loop's wait says; the
    cluster's size (2 CPUs: 2 places) is asked at start; every sample once."""
    with caplog.at_level(logging.INFO, logger="feedline.loader"):
        with StagingLoader(long_epoch, batch_size=BATCH, workers="auto", transform=Sleepy(24, fields=["jpg"]),
                           remote=cluster.address) as loader:
            assert loader.workers == 1 and loader.most_workers == 3
            for _ in range(2):  # the growth is in the first epoch (from the next one if its workers come up late)
                ids = [int(c) for b in loader for c in b["cls"]]
                assert sorted(ids) == list(range(480))
                stats = loader.stats()
                if loader.workers > 1 and stats.batches_decoded_total["remote"] > 0:
                    break  # grown, and the cluster decoded: a second epoch would show nothing more
            assert loader.workers > 1
    assert stats.batches_decoded_total["remote"] > 0
    said = [r.getMessage() for r in caplog.records]
    assert any("has 2 CPUs: at most 2 places" in m for m in said), said
    assert any("workers=auto: growing to" in m and "on the Ray cluster" in m for m in said), said


def test_auto_workers_stay_local_while_the_loop_does_not_wait(cluster, long_epoch, one_local_cpu, caplog):
    with caplog.at_level(logging.INFO, logger="feedline.loader"):
        with StagingLoader(long_epoch, batch_size=BATCH * 4, workers="auto", remote=f"{cluster.address},places=2",
                           spec={"cls": "int64"}) as loader:
            for _ in loader:
                time.sleep(0.2)  # a slow training step: the one local worker keeps up
            assert loader.workers == 1
            stats = loader.stats()
    assert stats.batches_decoded_total["remote"] == 0
    assert any("workers=auto: keeping 1 workers" in r.getMessage() for r in caplog.records)


def test_an_address_nobody_answers_is_refused_naming_it_within_its_connect_timeout(shards):
    address = f"127.0.0.1:{free_port()}"
    assert RemoteDecode.parse(address).connect_timeout == 10  # the default bound (waited out here as 1 s)
    t0 = time.monotonic()
    with pytest.raises(SettingError, match=f"remote: no Ray cluster answers at {address} within 1 s.*fallback=local"):
        StagingLoader(shards, batch_size=4, workers=2, transform=crop(), remote=f"{address},connect_timeout=1")
    assert time.monotonic() - t0 < 6  # the 1 s bound, and the loader's own start


def test_fallback_local_decodes_every_place_here_when_nobody_answers(shards, local, caplog):
    got, stats = batches(shards, f"127.0.0.1:{free_port()},places=2,fallback=local,connect_timeout=1")
    same(got, local[0])
    assert stats.batches_decoded_total["remote"] == 0
    assert "decoding every worker place on this machine (fallback=local)" in caplog.text


def test_a_transform_defined_in_the_training_script_reaches_the_actors_by_value(cluster, shards, tmp_path):
    """A user's script: its transform lives in ``__main__``, which the decode nodes do not have."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        import numpy as np
        from feedline import StagingLoader

        def darker(sample):
            sample["jpg"] = (np.asarray(sample["jpg"])[:24, :24] // 2).copy()
            return sample

        if __name__ == "__main__":
            with StagingLoader({shards!r}, batch_size=4, workers=2, transform=darker,
                               remote={cluster.address + ",places=2"!r}) as loader:
                n = sum(len(b["cls"]) for b in loader)
                print(json.dumps({{"samples": n, "remote": loader.stats().batches_decoded_total["remote"]}}))
    """))
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["samples"] == 39 and result["remote"] > 0


def test_asking_for_remote_without_ray_installed_says_how_to_install(tmp_path):
    code = ("import sys; sys.modules['ray'] = None\n"
            "from feedline import StagingLoader, SettingError\n"
            "try:\n"
            "    StagingLoader('/x-{0..1}.tar', remote='127.0.0.1:6379')\n"
            "except SettingError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'feedline[ray]'" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("value, named", [
    ("auto,places=0", "places must be 'auto' or an integer >= 1"),
    ("auto,speed=3", "'speed=3' is not an option"),
    ("auto,fallback=maybe", "fallback must be one of error, local"),
    ("auto,cpus=0", "cpus (Ray CPUs an actor asks for) must be a number in (0, 256]"),
    ("auto,stream=maybe", "stream must be on or off, got 'maybe'"),
    ("auto,inflight=0", "inflight (batches of a place on their way to its actor) must be an integer in [1, 16]"),
    ("ray://head:10001", "ray://head:10001: Ray Client (ray://) would route every batch through the head"),
])
def test_a_remote_setting_that_cannot_work_is_refused_naming_what_would(value, named):
    with pytest.raises(SettingError, match="remote: " + __import__("re").escape(named)):
        RemoteDecode.parse(value)


def test_remote_takes_no_more_places_than_workers(shards):
    with pytest.raises(SettingError, match="places=3 is more than workers=2"):
        StagingLoader(shards, workers=2, transform=crop(), remote="127.0.0.1:1,places=3")


def test_the_stream_takes_only_the_actor_with_the_key_and_carries_calls_out_and_answers_back():
    """A place's own TCP stream (remote/channel.py), real sockets on 127.0.0.1: a connection without the key is
    refused; a call's members arrive whole from several views; answers of calls given up are read and dropped; call
    n's slot lands in the buffer given for it with its record."""
    import queue
    import socket

    import numpy as np

    from feedline.loader.remote.channel import ActorChannel, ProxyChannel

    receiver = ProxyChannel("127.0.0.1", 64)
    try:
        key = receiver.new_key()
        stranger = socket.create_connection(("127.0.0.1", receiver.port))
        stranger.sendall(b"x" * len(key))
        actor = ActorChannel.connect("127.0.0.1", receiver.port, key)
        assert actor is not None and receiver.accept(lambda: False, timeout=10)
        members = bytes(range(200)) * 10
        receiver.send_call(5, 9, 3, b'[["a"]]', [memoryview(members)[:700], memoryview(members)[700:]])
        calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=actor.read_calls, args=(calls,), daemon=True).start()
        call = calls.get(timeout=10)
        assert (call.seq, call.token, call.start, call.index) == (5, 9, 3, b'[["a"]]')
        assert call.members.tobytes() == members
        actor.send(4, b"{}", np.full(64, 1, np.uint8))  # a call the proxy gave up on
        actor.send(5, b'{"rows": 2}', np.arange(64, dtype=np.uint8))
        into = np.zeros(64, np.uint8)
        assert receiver.receive(5, memoryview(into), lambda: False) == (64, b'{"rows": 2}')
        assert into.tolist() == list(range(64))
        actor.sock.shutdown(socket.SHUT_RDWR)  # the actor is gone: the proxy hears it at once, not after a timeout
        assert calls.get(timeout=10) is None  # and the actor's reader ends
        with pytest.raises(OSError):
            receiver.receive(6, memoryview(into), lambda: False)
        actor.close()
        stranger.close()
    finally:
        receiver.close()
