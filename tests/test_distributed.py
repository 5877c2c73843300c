"""feedline train as a real DDP job under torchrun (gloo on 127.0.0.1), and two nodes simulated on one machine."""

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import ROOT, descendants, gone, jpeg_bytes, write_tar

# in one xdist worker: its module fixtures' torchrun jobs run once
pytestmark = pytest.mark.xdist_group("distributed")

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def jpeg_shards(directory, sizes, image=(32, 24)):
    os.makedirs(directory, exist_ok=True)
    for k, n in enumerate(sizes):
        write_tar(os.path.join(directory, f"j-{k}.tar"),
                  [(f"k{k}{i:03d}", {"jpg": jpeg_bytes(k * 1000 + i, image), "cls": str(i % 3).encode()})
                   for i in range(n)])
    return os.path.join(directory, "*.tar")


def torchrun(*args, env=None, timeout=300):
    return subprocess.run([TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={_port()}",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _port():
    from feedline.demo.procs import free_port

    return free_port()


TRAIN = ["-m", "feedline", "train", "--batch-size", "4", "--image-size", "16", "--workers", "1", "--progress",
         "false", "--metrics-port", "0", "--dist-timeout", "60"]


def test_two_nodes_on_one_machine_train_every_sample_once_in_step_with_identical_models(tmp_path):
    data = jpeg_shards(str(tmp_path / "data"), [12] * 8)
    out = tmp_path / "out"
    env = {**os.environ, "FEEDLINE_EPOCHS": "1", "FEEDLINE_BATCH_SIZE": "4", "FEEDLINE_IMAGE_SIZE": "16",
           "FEEDLINE_WORKERS": "1", "FEEDLINE_DIST_TIMEOUT": "60", "FEEDLINE_MIN_SHARDS": "4"}
    run = subprocess.run([os.path.join(ROOT, "scripts", "two-nodes"), os.path.dirname(data), str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads((out / "summary.json").read_text())
    keys = [k for p in sorted(glob.glob(str(out / "keys.rank*"))) for k in open(p).read().split()]
    assert len(glob.glob(str(out / "keys.rank*"))) == 4
    assert sorted(keys) == sorted(f"k{k}{i:03d}" for k in range(8) for i in range(12))  # each once, 4 ranks
    assert doc["ranks"] == 4 and len(set(doc["steps_per_rank"])) == 1
    assert len(set(doc["parameter_checksum_per_rank"])) == 1  # DDP really synchronised the models
    assert not glob.glob("/dev/shm/feedline-node*")  # the caches are gone


UNEVEN = [19, 20, 18, 21, 17, 22, 20, 19, 18, 21, 10]  # 205 samples in 11 shards


@pytest.mark.parametrize("mode, pick, sizes, epochs", [("pad", max, [30, 8, 8], 1), ("drop", min, UNEVEN, 2)],
                         ids=["pad", "drop"])
def test_equal_batches_gives_every_rank_the_largest_or_the_smallest_count_in_step_and_no_hang(tmp_path, mode, pick,
                                                                                             sizes, epochs):
    """Shards that never split evenly between 2 ranks: each rank takes the agreed count of steps every epoch, and
    DDP keeps the models identical (the default, drop, over two epochs of 11 uneven shards)."""
    from feedline.loader.plan.epoch_plan import EpochPlan
    from feedline.loader.plan.rank import Rank

    data = jpeg_shards(str(tmp_path / "data"), sizes)
    shards = sorted(glob.glob(data))
    counts = [[EpochPlan.make(shards, epoch=e, seed=0, rank=Rank(r, 2), workers=1).batches(4, False) for r in (0, 1)]
              for e in range(epochs)]
    assert any(c[0] != c[1] for c in counts)
    summary = tmp_path / "s.json"
    run = torchrun(*TRAIN, "--shards", data, "--epochs", str(epochs), "--equal-batches", mode, "--summary-json",
                   str(summary))
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(summary.read_text())
    assert doc["steps_per_rank"] == [sum(pick(c) for c in counts)] * 2
    assert len(set(doc["parameter_checksum_per_rank"])) == 1


HEADER = """
import json, sys
import torch
import torch.distributed as dist
from feedline import StagingLoader
"""

EPOCHS = textwrap.dedent("""
    def epochs_of(path, modes):
        rank = dist.get_rank()
        out = {}
        for mode in modes:
            with StagingLoader(path, batch_size=4, workers=1, spec={"cls": "int64"}) as loader:
                if mode == "disagree":
                    loader.set_epoch(3 if rank == 0 else 0)
                epochs = []
                for epoch in range(3):
                    if mode == "peek":
                        loader.set_epoch(epoch)
                        if rank == 0:
                            iter(loader)  # an iterator never read, on one rank
                            next(iter(loader))  # a look at a batch before the loop, on one rank
                    keys = []
                    for batch in loader:
                        keys += batch["__key__"]
                        dist.all_reduce(torch.ones(1))  # what a DDP step does: a collective every rank must join
                    epochs.append(keys)
                out[mode] = {"epochs": epochs, "last": loader.epoch}
        return out
""")

LENGTH = textwrap.dedent("""
    def lengths_of(path, modes):
        out = {}
        for mode in modes:
            settings = dict(batch_size=4, workers=1, spec={"cls": "int64"}, equal_batches=mode)
            with StagingLoader(path, **settings) as loader:
                seen = []
                for epoch in range(2):
                    before = len(loader)  # what a trainer sizing its epoch asks first
                    n = 0
                    for batch in loader:
                        n += 1
                        during = len(loader)
                        if epoch == 1 and n == 1:
                            state = loader.state_dict()  # every rank's, as a trainer saves it, mid-epoch
                    seen.append([before, during, n])
            with StagingLoader(path, **settings) as again:
                again.load_state_dict(state)
                resumed = len(again)  # a resumed trainer sizes the rest of its epoch the same way
                seen.append([resumed, resumed, 1 + sum(1 for _ in again)])
            out[mode] = seen
        return out
""")


CACHED = textwrap.dedent("""
    def cached(cache):
        with StagingLoader(cache=cache, batch_size=4, workers=1, spec={"cls": "int64"}) as loader:
            it = iter(loader)
            before = [int(i) for _ in range(2) for i in next(it)["cls"]]
            state = loader.state_dict()  # a growing cache's list: kept once, not in each rank's part
        with StagingLoader(cache=cache, batch_size=4, workers=1, spec={"cls": "int64"}) as again:
            again.load_state_dict(json.loads(json.dumps(state)))
            after = [int(i) for b in again for i in b["cls"]]
        return {"before": before, "after": after, "lists": len(state.get("shards", {})),
                "in_ranks": sum("shards" in r["plan"] for r in state["ranks"]), "bytes": len(json.dumps(state))}
""")


def _main(call: str) -> str:
    """A torchrun script's end: the process group around ``call``, one RESULT line per rank (both ranks share
    torchrun's unbuffered stdout: one write each)."""
    return textwrap.dedent(f"""
        dist.init_process_group("gloo")
        try:
            sys.stdout.write("RESULT " + json.dumps({call}) + "\\n")
        finally:
            dist.destroy_process_group()
    """)


def _results(run) -> list:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in run.stdout.splitlines() if "RESULT " in line]


def _epochs_run(tmp_path, *modes):
    data = jpeg_shards(str(tmp_path / "data"), [8, 8, 8, 8])
    script = tmp_path / "epochs.py"
    script.write_text(HEADER + EPOCHS + _main("epochs_of(sys.argv[1], sys.argv[2:])"))
    return torchrun(str(script), data, *modes, env={"PYTHONPATH": ROOT}, timeout=120)


@pytest.fixture(scope="module")
def one_job(tmp_path_factory):
    """One torchrun job (its start is most of its time) for the module's fixtures: three epochs read as a plain
    loop and then with a peek on one rank, on 4 shards; then both equal_batches modes on 3 uneven shards."""
    tmp_path = tmp_path_factory.mktemp("job")
    epochs_data = jpeg_shards(str(tmp_path / "epochs"), [8, 8, 8, 8])
    length_data = jpeg_shards(str(tmp_path / "length"), [30, 8, 8])  # 3 shards for 2 ranks: never an even split
    cache = _growing_cache(tmp_path / "cache", tmp_path / "ids")
    script = tmp_path / "job.py"
    script.write_text(HEADER + EPOCHS + LENGTH + CACHED + _main(
        '{"epochs": epochs_of(sys.argv[1], ["plain", "peek"]), "length": lengths_of(sys.argv[2], ["drop", "pad"]), '
        '"cached": cached(sys.argv[3])}'))
    run = torchrun(str(script), epochs_data, length_data, cache, env={"PYTHONPATH": ROOT}, timeout=180)
    return run, length_data


def _growing_cache(cache, data) -> str:
    """A sidecar's cache of 6 shards of 10 ids (0..59), not complete: a growing source."""
    from helpers import id_shards, publish_copy

    from feedline.cache.store import CacheStore

    id_shards(str(data), shards=6, per_shard=10)
    store = CacheStore(str(cache), budget_bytes=1 << 30)
    store.recover()
    for k in range(6):
        publish_copy(store, data, k)
    return str(cache)


def test_a_gathered_state_of_a_growing_cache_keeps_its_shard_list_once_and_resumes_every_sample_once(one_job):
    run, _ = one_job
    assert run.returncode == 0, run.stderr[-3000:]
    results = [r["cached"] for r in _results(run)]
    assert [(r["lists"], r["in_ranks"]) for r in results] == [(1, 0), (1, 0)]
    ids = [i for r in results for i in r["before"] + r["after"]]
    assert sorted(ids) == list(range(60))


@pytest.fixture(scope="module")
def counted_epochs(one_job):
    """Each rank's keys per epoch, a plain loop's and a peeking one's."""
    run, _ = one_job
    assert run.returncode == 0, run.stderr[-3000:]
    return [r["epochs"] for r in _results(run)]


def _assert_epochs_count_up(results, mode):
    results = [r[mode] for r in results]
    assert len(results) == 2 and all(r["last"] == 2 for r in results)
    everything = sorted(f"k{k}{i:03d}" for k in range(4) for i in range(8))
    orders = []
    for epoch in range(3):
        assert sorted(k for r in results for k in r["epochs"][epoch]) == everything  # once each, across the ranks
        orders.append([r["epochs"][epoch] for r in results])
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch, no set_epoch called


def test_epochs_count_up_under_torch_distributed_without_set_epoch(counted_epochs):
    _assert_epochs_count_up(counted_epochs, "plain")


def test_an_unread_iterator_and_a_peek_on_one_rank_neither_desync_nor_hang_the_ranks(counted_epochs):
    _assert_epochs_count_up(counted_epochs, "peek")


def test_ranks_that_name_different_epochs_get_one_clear_error_naming_both(tmp_path):
    run = _epochs_run(tmp_path, "disagree")
    assert run.returncode != 0
    assert "rank 0: 3, rank 1: 0" in run.stderr and "set_epoch" in run.stderr


@pytest.fixture(scope="module")
def lengths(one_job):
    """Both equal_batches modes: the shards' per-rank batch counts and what len() and the loop said on each rank."""
    from feedline.loader.plan.epoch_plan import EpochPlan
    from feedline.loader.plan.rank import Rank

    run, data = one_job
    assert run.returncode == 0, run.stderr[-3000:]
    shards = sorted(glob.glob(data))
    counts = {e: [EpochPlan.make(shards, epoch=e, seed=0, rank=Rank(r, 2), workers=1).batches(4, False)
                  for r in (0, 1)] for e in (0, 1)}
    return counts, [r["length"] for r in _results(run)]


@pytest.mark.parametrize("mode, pick", [("drop", min), ("pad", max)])
def test_len_under_torch_distributed_is_the_batch_count_the_ranks_agreed_on(lengths, mode, pick):
    counts, results = lengths
    assert counts[0][0] != counts[0][1]
    assert len(results) == 2
    for epoch, read in ((0, 0), (1, 1), (1, 2)):  # read 2: epoch 1 again, resumed from a state after 1 batch
        agreed = pick(counts[epoch])
        assert [r[mode][read] for r in results] == [[agreed, agreed, agreed]] * 2  # len() == what the loop yields


def test_a_rank_that_dies_ends_the_job_with_an_error_instead_of_a_hang(tmp_path):
    data = jpeg_shards(str(tmp_path / "data"), [40] * 4)
    proc = subprocess.Popen([TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={_port()}",
                             *TRAIN, "--shards", data, "--epochs", "50", "--step-ms", "50"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        ranks = []
        while len(ranks) < 2 and time.monotonic() < deadline:  # the two trainer processes, once training
            ranks = [p for p in descendants(proc.pid) if "feedline" in _cmdline(p) and "train" in _cmdline(p)]
            time.sleep(0.5)
        time.sleep(3)
        os.kill(max(ranks), signal.SIGKILL)  # a rank dies: a GPU fault, an OOM kill
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert time.monotonic() - t0 < 90
        assert "SIGKILL" in out or "Signal 9" in out or "failed" in out.lower()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert gone(descendants(proc.pid))


def _cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


def test_world_size_without_torchrun_is_refused_with_the_fix_named():
    out = subprocess.run([sys.executable, "-m", "feedline", "train", "--shards", "x", "--metrics-port", "0"],
                         cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "WORLD_SIZE": "4"})
    assert out.returncode == 2
    assert "WORLD_SIZE=4 but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set" in out.stderr
    assert "torchrun" in out.stderr


def test_a_ddp_job_stopped_by_sigterm_resumes_and_trains_every_sample_once(tmp_path):
    data = jpeg_shards(str(tmp_path / "data"), [24] * 4)
    ckpt, keys = str(tmp_path / "ckpt"), str(tmp_path / "keys")
    args = [*TRAIN, "--shards", data, "--epochs", "1", "--checkpoint", ckpt, "--trace-keys", keys]
    proc = subprocess.Popen([TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={_port()}",
                             *args, "--step-ms", "150"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sum(len(open(p).read().split()) for p in glob.glob(keys + ".rank*")) < 16:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks, as Kubernetes' eviction does
    out, _ = proc.communicate(timeout=120)
    assert "stopping at step" in out and "checkpoint" in out, out[-3000:]  # torchrun itself exits 1 on SIGTERM
    again = torchrun(*args, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    trained = [k for p in glob.glob(keys + ".rank*") for k in open(p).read().split()]
    assert sorted(trained) == sorted(f"k{k}{i:03d}" for k in range(4) for i in range(24))


AUTO = textwrap.dedent("""
    import json, logging, sys
    import torch.distributed as dist
    from feedline import StagingLoader
    from sleepy import Sleepy

    logging.basicConfig(level=logging.INFO)
    dist.init_process_group("gloo")
    try:
        with StagingLoader(sys.argv[1], batch_size=4, workers="auto", max_workers=2, spec={"cls": "int64"},
                           transform=Sleepy()) as loader:
            out = {"workers": [], "keys": []}
            for epoch in range(2):
                loader.set_epoch(epoch)
                out["keys"].append([k for b in loader for k in b["__key__"]])
                out["workers"].append(loader.workers)
            print("RESULT", json.dumps(out), flush=True)
    finally:
        dist.destroy_process_group()
""")


SLEEPY = textwrap.dedent("""
    import time

    class Sleepy:  # a decode that waits: more workers would help, and the CPUs stay idle
        def __call__(self, sample):
            time.sleep(0.004)
            return sample
""")


@pytest.mark.idle_cpus  # it grows workers into idle CPUs: run last, with nothing else of the suite beside it
def test_auto_under_torch_distributed_grows_at_the_next_epoch_keeping_the_ranks_batch_counts(tmp_path):
    data = jpeg_shards(str(tmp_path / "data"), [500] * 4, image=(8, 8))
    script = tmp_path / "auto.py"
    script.write_text(AUTO)
    (tmp_path / "sleepy.py").write_text(SLEEPY)
    run = torchrun(str(script), data, env={"PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in run.stdout.splitlines() if "RESULT " in line]
    assert len(results) == 2
    for r in results:
        assert r["workers"][0] in (1, 2) and r["workers"][1] == 2  # grown, and used from the second epoch
    for epoch in range(2):
        keys = [k for r in results for k in r["keys"][epoch]]
        assert len(keys) == len(set(keys)) == 2000  # every sample once across the ranks, each epoch
    assert "from the next epoch on" in run.stderr
