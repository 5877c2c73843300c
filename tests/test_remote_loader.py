"""Remote URLs straight into the loader: ``StagingLoader(URL)`` starts, owns and stops a sidecar (issue 51)."""

import os
import subprocess
import sys
import time

import pytest

from feedline import StagingLoader
from feedline.api.owned_sidecar import OwnedSidecar, default_cache
from feedline.errors import SettingError
from helpers import N_SHARDS, descendants, gone, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = {"bin": ("uint8", (2048,)), "cls": "int64"}


def ids_of(loader) -> list[int]:
    return sorted(int(i) for batch in loader for i in batch["cls"].tolist())


def urls(remote) -> str:
    return f"{remote.url}/ids-{{0000..{N_SHARDS - 1:04d}}}.tar"


def test_a_remote_url_is_read_whole_through_a_sidecar_the_loader_owns_and_removes(remote):
    source = urls(remote)
    with StagingLoader(source, batch_size=10, workers=1, spec=SPEC,
                       cache_budget="64MiB", min_shards=N_SHARDS) as loader:
        sidecar = loader.sidecar
        assert sidecar is not None and sidecar.cache == default_cache(source)
        assert sidecar.cache.startswith("/dev/shm/feedline-") and os.path.isdir(sidecar.cache)
        assert ids_of(loader) == list(range(N_SHARDS * 20))
        pid = sidecar.proc.pid
    assert gone([pid]) and not os.path.exists(sidecar.cache)


def test_keep_cache_leaves_the_cache_for_the_next_run_and_a_given_cache_is_used(remote, tmp_path):
    cache = str(tmp_path / "kept")
    with StagingLoader(urls(remote), batch_size=10, workers=1, spec=SPEC,
                       cache=cache, keep_cache=True, min_shards=N_SHARDS) as loader:
        assert ids_of(loader) == list(range(N_SHARDS * 20))
        pid = loader.sidecar.proc.pid
    assert gone([pid])
    assert len([n for n in os.listdir(os.path.join(cache, "shards")) if n.endswith(".tar")]) == N_SHARDS


def test_a_source_the_sidecar_refuses_fails_the_loader_with_the_sidecars_reason(remote):
    with pytest.raises(SettingError) as err:
        StagingLoader(f"{remote.url}/nothing-{{0000..0003}}.tar", batch_size=10, workers=1, spec=SPEC,
                      wait_timeout=60)
    assert err.value.setting == "shards" and "exited with status" in str(err.value)
    assert "source" in str(err.value) and "404" in str(err.value)
    assert not os.path.exists(default_cache(f"{remote.url}/nothing-{{0000..0003}}.tar"))


def test_remote_and_local_shards_in_one_list_are_refused_by_name(remote, shards):
    with pytest.raises(SettingError, match="mixes remote shards"):
        StagingLoader([f"{remote.url}/ids-0000.tar", shards[0]], spec=SPEC)


def test_cache_budget_without_remote_shards_is_refused(shards):
    with pytest.raises(ValueError, match="cache_budget and keep_cache are for remote shards"):
        StagingLoader(shards, cache_budget="1GiB", spec=SPEC)


def test_an_exception_in_the_loop_stops_the_sidecar_and_removes_its_cache(remote):
    source = urls(remote)
    with pytest.raises(RuntimeError, match="the user's bug"):
        with StagingLoader(source, batch_size=10, workers=1, spec=SPEC) as loader:
            pid = loader.sidecar.proc.pid
            next(iter(loader))
            raise RuntimeError("the user's bug")
    assert gone([pid]) and not os.path.exists(default_cache(source))


def test_a_trainer_killed_with_sigkill_leaves_no_sidecar_running_and_no_cache(remote, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, time\n"
        "from feedline import StagingLoader\n"
        f"loader = StagingLoader(sys.argv[1], batch_size=10, workers=1, spec={SPEC!r})\n"
        "print(loader.sidecar.proc.pid, loader.sidecar.cache, flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script), urls(remote)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline().split()
    pid, cache = int(line[0]), line[1]
    try:
        assert os.path.isdir(cache)
        proc.kill()
        proc.wait()
        assert gone([pid]), "the sidecar outlived its trainer"
        assert not os.path.exists(cache), "the cache outlived its trainer and sidecar"  # the sidecar removed it
    finally:
        proc.stdout.close()
        subprocess.run(["rm", "-rf", cache])


def test_local_ranks_share_the_sidecar_of_local_rank_0(remote):
    source = urls(remote)
    with OwnedSidecar(source, budget=64 << 20, min_shards=N_SHARDS, local_rank=0) as owner:
        owner.wait(N_SHARDS, 60)
        follower = OwnedSidecar(source, local_rank=1)
        assert follower.proc is None and follower.cache == owner.cache
        follower.wait(N_SHARDS, 10)  # reads what local rank 0's sidecar cached
        assert set(descendants(os.getpid())) == {owner.proc.pid}  # one sidecar for the node


def test_feedline_train_takes_a_remote_url_for_shards(tmp_path):
    import json

    from feedline.demo.datasets import make_dataset
    from feedline.demo.store import FileStore

    src = tmp_path / "jpeg"
    make_dataset("jpeg", str(src), 48, 64 << 10, str(tmp_path / "c"), 0)
    names = sorted(n for n in os.listdir(src) if n.endswith(".tar"))
    summary = tmp_path / "summary.json"
    with FileStore(str(src)) as store:
        out = subprocess.run([sys.executable, "-m", "feedline", "train", "--shards",
                              "::".join(f"{store.url}/{n}" for n in names), "--min-shards", str(len(names)),
                              "--epochs", "1", "--batch-size", "8", "--image-size", "32", "--progress", "false",
                              "--summary-json", str(summary), "--metrics-port", "0"],
                             capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [e["samples"] for e in json.loads(summary.read_text())["epochs"]] == [48]


TWO_RANKS = """
import json, os, sys
import torch.distributed as dist
from feedline import StagingLoader

dist.init_process_group("gloo")
rank = dist.get_rank()
with StagingLoader(sys.argv[1], batch_size=5, workers=1, spec={spec!r}, min_shards={n}) as loader:
    sidecar = loader.sidecar
    epochs = [sorted(int(i) for b in loader for i in b["cls"].tolist()) for _ in range(2)]
    dist.barrier()  # both ranks read both epochs before local rank 0 stops the sidecar
with open(os.path.join(sys.argv[2], f"rank{{rank}}.json"), "w") as f:
    json.dump({{"epochs": epochs, "cache": sidecar.cache, "pid": sidecar.proc.pid if sidecar.proc else None}}, f)
dist.destroy_process_group()
"""


def test_two_ranks_under_torchrun_share_one_sidecar_and_read_every_sample_once_an_epoch(remote, tmp_path):
    import json

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS.format(spec=SPEC, n=N_SHARDS))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    from feedline.demo.procs import free_port

    run = subprocess.run([torchrun, "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
                          str(script), urls(remote), str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for epoch in (0, 1):  # the ranks split each epoch: every sample once between them
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert sorted(a + b) == list(range(N_SHARDS * 20)) and len(a) == len(b)
    assert ranks[0]["pid"] is not None and ranks[1]["pid"] is None  # local rank 0 started the node's one sidecar
    assert ranks[0]["cache"] == ranks[1]["cache"] and ranks[0]["cache"].startswith("/dev/shm/feedline-")
    assert gone([ranks[0]["pid"]]) and not os.path.exists(ranks[0]["cache"])  # stopped and removed with the job


READER = """
import os, sys, time
from feedline.cache.manifest import read_manifest
from feedline.cache.readers import remove_reader, write_reader

cache, hold = sys.argv[1], float(sys.argv[2])
write_reader(cache, 1, 0, 0, [])  # local rank 1 starts an epoch on the cache
if hold < 0:
    os._exit(0)  # killed: its file stays, its process is gone
time.sleep(hold)  # ... and reads on while local rank 0 closes
shards = read_manifest(cache).shards
intact = all(os.path.getsize(os.path.join(cache, "shards", f"{s.id}.tar")) > 0 for s in shards)
remove_reader(cache, 1)
sys.exit(0 if shards and intact else 3)
"""


def _rank_1_reading(cache, hold):
    reader = subprocess.Popen([sys.executable, "-c", READER, cache, str(hold)], cwd=ROOT)
    assert wait_for(lambda: os.path.exists(os.path.join(cache, "readers", "1.json")) or reader.poll() is not None, 30)
    return reader


def test_local_rank_0_stops_its_sidecar_only_once_the_other_local_ranks_stop_reading(remote, tmp_path):
    cache = str(tmp_path / "cache")
    with OwnedSidecar(urls(remote), cache=cache, budget=64 << 20, min_shards=N_SHARDS, local_rank=0) as sidecar:
        sidecar.wait(N_SHARDS, 60)
        reader = _rank_1_reading(cache, 2.0)
        t0 = time.monotonic()
        sidecar.close()
        waited = time.monotonic() - t0
    assert reader.wait(10) == 0  # every shard was still there when it finished reading
    assert waited >= 1.5 and gone([sidecar.proc.pid]) and not os.path.exists(cache)


def test_a_rank_that_died_without_closing_is_not_waited_for(remote, tmp_path):
    cache = str(tmp_path / "cache")
    with OwnedSidecar(urls(remote), cache=cache, budget=64 << 20, min_shards=N_SHARDS, local_rank=0) as sidecar:
        sidecar.wait(N_SHARDS, 60)
        assert _rank_1_reading(cache, -1).wait(10) == 0 and os.path.exists(os.path.join(cache, "readers", "1.json"))
        t0 = time.monotonic()
        sidecar.close()
        assert time.monotonic() - t0 < 5
    assert gone([sidecar.proc.pid]) and not os.path.exists(cache)
