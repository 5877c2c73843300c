"""One measurement of the scale simulation, in a process of its own (its memory is its own):
``python -m feedline.bench.scale.points NAME JSON`` prints one JSON line.

Each runs the real planning, resume, index and cache code on made-up inputs (``made_up.py``):
- ``state``: one rank's ``state_dict`` (the loader's ``make_state``) mid-epoch, over S shards whose sample
  counts a cache's manifest gave, optionally after an elastic resume (the plan's skip lists): its part of a
  checkpoint's gather, and the shard names a checkpoint keeps once;
- ``epoch_start``: one rank's epoch start over a folder of S real tiny shards (the source's listing, the plan, the
  batch count the loader asks for), its metadata calls counted;
- ``compressed_start``: the same over S tiny ``.tar.gz`` shards: the plain copies a rank makes;
- ``mixture_start``: the same for a two-source mixture (the draw needs every shard's count), listed or not;
- ``index``: a shard index's memory a sample (``load_index`` of a real tar of S samples);
- ``index_builds``: a real loader of W workers over S shards with no index files, one epoch: the builds a shard;
- ``fill``: a cache filled with C tiny shards by the sidecar's store (``CacheStore.publish``);
- ``elastic``: an elastic resume R -> R/2 of an epoch of N samples half delivered (``plan_resume``), for one rank:
  its time, and the most memory it allocates at once (traced, in a second run);
- ``agreement``: R real gloo ranks: the loader's process group, an epoch's agreement, a state gather.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
import tracemalloc
from typing import Any

from ...loader.plan.epoch_plan import EpochPlan
from ...loader.plan.rank import Rank
from ...loader.plan.resume import Cursor, make_state, plan_resume
from .made_up import metadata_calls, shard_names, tar_bytes, write_shards

W = 16  # workers a rank
BATCH = 256


def _settings(rank: Rank, workers: int = W) -> dict[str, Any]:
    return {"seed": 0, "batch_size": BATCH, "drop_last": False, "shuffle": True, "shuffle_buffer": 0,
            "shuffle_block": 0, "workers": workers, "rank": rank.rank, "world_size": rank.world_size, "sources": None}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _state(plan: EpochPlan, counts: dict[str, int], delivered: int, workers: int = W) -> dict[str, Any]:
    """A rank's state taken mid-epoch, as a checkpoint's gather holds it (the shard list by its digest: the names
    are kept once for all ranks): each worker ``delivered`` samples into its stream."""
    per = max(1, delivered // workers)
    cursor = Cursor.start(workers, [per // BATCH] * workers, [per] * workers)
    return make_state(plan, cursor, plan.epoch, _settings(plan.rank, workers), counts, with_shards=False)


def state(S: int, N: int, R: int, resumed: bool = False) -> dict[str, Any]:
    shards = shard_names(S)
    counts = {p: N // S for p in shards}
    skip = None
    if resumed:  # what an elastic resume leaves in every rank's plan: the first half of each shard delivered
        skip = {p: tuple(range(N // S // 2)) for p in shards}
    plan = EpochPlan.make(shards, epoch=3, seed=0, rank=Rank(R // 2, R), workers=W, skip=skip)
    t0 = time.perf_counter()
    text = json.dumps(_state(plan, counts, N // R // 2))
    seconds = time.perf_counter() - t0
    return {"bytes": len(text), "seconds": seconds, "rss_mib": _rss_mib(),
            "list_bytes": len(json.dumps({plan.digest: list(plan.shards)}))}


def epoch_start(S: int, R: int, folder: str) -> dict[str, Any]:
    from ...loader.plan.sources import PathSource

    source = PathSource(folder)
    rank = Rank(R // 2, R)
    with metadata_calls() as calls:
        t0 = time.perf_counter()
        shards = source.snapshot()
        plan = EpochPlan.make(shards, epoch=0, seed=0, rank=rank, workers=W)
        batches = plan.batches(BATCH, False, source.listed or None)
        seconds = time.perf_counter() - t0
    assert len(shards) == S, (len(shards), S)
    return {"seconds": seconds, "calls": sum(calls.values()), "by_call": dict(calls), "rank_shards": plan.rank_shards,
            "batches": batches, "rss_mib": _rss_mib()}


def mixture_start(S: int, R: int, folder: str, listed: bool = True) -> dict[str, Any]:
    """One rank's epoch start of a two-source mixture over a folder's S shards (half each): the draw (which needs
    every shard's count), the plan, the listed counts of the rank's own shards checked against their indexes (as
    the loader does), the batch count; the sources given as webdataset shard indexes (``shardindex.json``: the
    counts listed) or, with ``listed=False``, as the shards themselves."""
    from ...loader.plan.mixture import Source
    from ...loader.plan.sources import MixedSource, PathSource, check_counts, known_counts

    names = sorted(n for n in os.listdir(folder) if n.endswith(".tar"))
    halves = [names[: S // 2], names[S // 2:]]
    specs: list[Any] = []
    for k, half in enumerate(halves):
        if listed:
            path = os.path.join(folder, f"shardindex-{k}.json")
            with open(path, "w") as f:
                json.dump({"wids_version": 1, "shardlist": [{"url": n, "nsamples": 1} for n in half]}, f)
            specs.append(path)
        else:
            specs.append([os.path.join(folder, n) for n in half])
    sources = [Source(f"s{k}", shards=spec, weight=1.0) for k, spec in enumerate(specs)]
    rank = Rank(R // 2, R)
    with metadata_calls() as calls:
        t0 = time.perf_counter()
        mixed = MixedSource([s.name for s in sources], [PathSource(s.shards) for s in sources])
        shards, mix = mixed.draw(sources, seed=0, epoch=0, shuffle=True)
        plan = EpochPlan.make(shards, epoch=0, seed=0, rank=rank, workers=W, mixture=mix, interleaved=True)
        check_counts(mixed.listed, sorted(plan.own_paths()))  # the loader's check of its own shards' counts
        batches = plan.batches(BATCH, False, known_counts(mixed))
        seconds = time.perf_counter() - t0
    assert len(shards) == S, (len(shards), S)
    return {"S": S, "listed": listed, "seconds": seconds, "calls": sum(calls.values()), "by_call": dict(calls),
            "rank_shards": plan.rank_shards, "batches": batches}


def compressed_start(S: int, R: int, folder: str) -> dict[str, Any]:
    """One rank's epoch start over S tiny ``.tar.gz`` shards: the listing, the plan, the plain copies of the rank's
    own shards (``PathSource.local_files``), the batch count; the copies it made counted."""
    from ...loader.plan.sources import PathSource

    gz = os.path.join(folder, "gz")
    write_shards(gz, S, gzipped=True)
    copies = os.path.join(folder, "plain")
    source = PathSource(gz, decompress_dir=copies)
    rank = Rank(R // 2, R)
    try:
        with metadata_calls() as calls:
            t0 = time.perf_counter()
            shards = source.snapshot()
            plan = EpochPlan.make(shards, epoch=0, seed=0, rank=rank, workers=W)
            plan = plan.reading(source.local_files(plan.own_paths()))
            batches = plan.batches(BATCH, False)
            seconds = time.perf_counter() - t0
        made = sum(1 for n in os.listdir(copies) if n.endswith(".tar")) if os.path.isdir(copies) else 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert len(shards) == S and (batches >= 1 or not plan.rank_shards)
    return {"S": S, "seconds": seconds, "calls": sum(calls.values()), "by_call": dict(calls),
            "rank_shards": plan.rank_shards, "copies": made}


def index(S: int, folder: str) -> dict[str, Any]:
    from ...formats.shard_index import build_index

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"index-{S}.tar")
    with open(path, "wb") as f:
        f.write(tar_bytes(S, ("jpg", "cls")))
    try:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        built = build_index(path)
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert len(built.samples) == S
        return {"bytes_per_sample": held / S, "samples": S}
    finally:
        os.unlink(path)


def index_builds(S: int, W: int, samples: int, folder: str) -> dict[str, Any]:
    """A real loader of W workers over S tar shards with no index files, the default epoch shuffle (each worker
    reads its part of every shard), one epoch: how many times each index was built, and how often copied."""
    from ...loader.loader import StagingLoader

    shards = write_shards(folder, S, samples)
    try:
        t0 = time.perf_counter()
        with StagingLoader(shards, batch_size=8, workers=W, spec={"bin": ("uint8", (1,))}, device="cpu",
                           worker_timeout=0) as loader:
            delivered = sum(len(b["bin"]) for b in loader)
            assert loader.settings.block > 0, "not the epoch shuffle"
            built, copied = loader._pipeline.indexes.counts() if loader._pipeline.indexes else (0, 0)
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert delivered == S * samples, (delivered, S * samples)
    return {"S": S, "W": W, "samples": samples, "built": built, "copied": copied, "seconds": seconds,
            "builds_per_shard": built / S}


def _partial(store: Any, shard_id: str, data: bytes) -> str:
    """A downloaded shard, as the sidecar leaves it for ``publish``: its path."""
    partial = os.path.join(store.partial_dir, shard_id + ".tar")
    with open(partial, "wb") as f:
        f.write(data)
    return partial


def fill(C: int, folder: str) -> dict[str, Any]:
    from ...cache.store import CacheStore

    root = os.path.join(folder, f"cache-{C}")
    shutil.rmtree(root, ignore_errors=True)
    store = CacheStore(root, budget_bytes=1 << 40)
    store.recover()
    data = tar_bytes(1)
    times = []
    try:
        t0 = time.perf_counter()
        for i in range(C):
            partial = _partial(store, f"s{i:06d}", data)
            t = time.perf_counter()
            store.publish(f"s{i:06d}", partial)
            times.append(time.perf_counter() - t)
        total = time.perf_counter() - t0
        tail = times[-max(1, C // 10):]
        manifest = sum(os.path.getsize(os.path.join(root, name)) for name in ("manifest.json", "manifest.log"))
        return {"seconds": total, "last_publish_ms": 1e3 * sum(tail) / len(tail), "manifest_bytes": manifest}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def elastic(N: int, S: int, R: int) -> dict[str, Any]:
    """R ranks' states of an epoch half delivered, loaded by rank 0 of R/2 (4 workers a rank: the replay's cost is
    its samples, not its streams)."""
    workers = 4
    shards = shard_names(S)
    counts = {p: N // S for p in shards}
    states = [_state(EpochPlan.make(shards, epoch=3, seed=0, rank=Rank(r, R), workers=workers), counts,
                     N // R // 2, workers) for r in range(R)]
    new = Rank(0, R // 2)
    t0 = time.perf_counter()
    resume, _ = plan_resume(states, _settings(new, workers), new, shards, False, True)
    seconds = time.perf_counter() - t0
    assert resume is not None
    tracemalloc.start()  # again, for the memory it takes (traced: slower, so not the timed run)
    plan_resume(states, _settings(new, workers), new, shards, False, True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"seconds": seconds, "rss_mib": _rss_mib(), "peak_mib": peak / 2**20,
            "state_bytes": len(json.dumps(states[0]))}


def ranks_over_shards(S: int, R: int, folder: str) -> dict[str, Any]:
    """A loader of rank R-1 of R over a cache of S < R tiny shards, the whole source (complete) or still growing:
    what it does at start."""
    from ...api.staging_loader import StagingLoader
    from ...cache.store import CacheStore
    from ...errors import SettingError

    data = tar_bytes(4)
    out: dict[str, Any] = {}
    for case in ("complete", "growing"):
        root = os.path.join(folder, f"ranks-{case}")
        ids = [f"s{i:06d}" for i in range(S)]
        store = CacheStore(root, 1 << 40, source_ids=frozenset(ids) if case == "complete" else None)
        store.recover()
        for sid in ids:
            store.publish(sid, _partial(store, sid, data))
        try:
            with StagingLoader(cache=root, batch_size=2, workers=1, spec={"bin": ("uint8", (1,))}, wait_timeout=2,
                               rank=Rank(R - 1, R), equal_batches="off") as loader:
                out[case] = f"an epoch of {len(loader)} batches"
        except (SettingError, TimeoutError) as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


def agreement(R: int, state_bytes: int = 64 << 10) -> dict[str, Any]:
    """R real gloo ranks on 127.0.0.1 (``agreement.py``): the loader's group, an epoch's agreement, a state gather."""
    import subprocess

    from ...demo.procs import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "feedline.bench.scale.agreement", str(r), str(R), str(port),
                               str(state_bytes)], stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, text=True) for r in range(R)]
    try:
        out, _ = procs[0].communicate(timeout=300)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return json.loads(out.strip().splitlines()[-1])


POINTS = {"agreement": agreement, "ranks_over_shards": ranks_over_shards, "state": state, "epoch_start": epoch_start,
          "mixture_start": mixture_start, "compressed_start": compressed_start, "index": index,
          "index_builds": index_builds, "fill": fill, "elastic": elastic}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    kwargs = json.loads(argv[1]) if len(argv) > 1 else {}
    print(json.dumps(POINTS[argv[0]](**kwargs)), flush=True)


if __name__ == "__main__":
    main()
