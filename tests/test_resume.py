"""Long runs survive restarts: the loader's state saved in one process and loaded in the next."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import ROOT, id_shards, publish_copy, shard_bytes

from feedline import SettingError, StagingLoader
from feedline.cache.store import CacheStore

SPEC = {"cls": "int64", "bin": ("uint8", (64,))}

# A training loop in its own process: loads saved state(s) if given, reads up to `epochs`, prints the ids of
# every batch as JSON lines, saves loader.state_dict() where `saves` says ("epoch:batches" -> file), and
# stops where `stop` says (as a preempted job would).
SCRIPT = textwrap.dedent("""
    import json, sys
    from feedline import StagingLoader
    a = json.loads(sys.argv[1])
    with StagingLoader(a["shards"], batch_size=8, workers=a["workers"], seed=11,
                       spec={"cls": "int64", "bin": ("uint8", (64,))}) as loader:
        if a.get("states"):
            states = [json.load(open(p)) for p in a["states"]]
            loader.load_state_dict(states if a.get("elastic") else states[0], elastic=a.get("elastic", False))
        for epoch in range(loader.next_epoch, a.get("epochs", 2)):
            for i, batch in enumerate(loader):
                print(json.dumps(batch["cls"].tolist()), flush=True)
                path = a.get("saves", {}).get(f"{epoch}:{i + 1}")
                if path:
                    json.dump(loader.state_dict(), open(path, "w"))
                if a.get("stop") == [epoch, i + 1]:
                    raise SystemExit(0)
""")


def run(tmp_path, env=None, **args):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture
def ids(tmp_path):
    """The `shards` fixture's data as one glob: 6 shards, ids 0..221."""
    id_shards(str(tmp_path / "ids"), shards=6, per_shard=37)
    return str(tmp_path / "ids" / "*.tar")


def test_a_state_saved_after_batch_k_resumes_exactly_in_a_new_process(tmp_path, ids):
    workers = 2  # the shards split between workers; one worker resumes in-process in test_determinism.py
    per_epoch = 29  # 222 ids in batches of 8 (114 and 108 a worker: each reads its part of every shard)
    ks = [0, 13, per_epoch]  # before the first batch, mid-epoch, after the last
    saves = {f"0:{k}": str(tmp_path / f"state-{k}.json") for k in ks if k}
    full = run(tmp_path, shards=ids, workers=workers, saves=saves)
    assert len(full) == 2 * per_epoch and sorted(i for b in full[:per_epoch] for i in b) == list(range(222))
    with StagingLoader(ids, batch_size=8, workers=workers, seed=11, spec=SPEC) as loader:
        iter(loader)  # the epoch began; no batch yet
        (tmp_path / "state-0.json").write_text(json.dumps(loader.state_dict()))
    for k in ks:
        rest = run(tmp_path, shards=ids, workers=workers, states=[str(tmp_path / f"state-{k}.json")])
        assert full[:k] + rest == full, f"resuming after batch {k} changed the batches"


def test_elastic_resume_from_two_workers_to_one_delivers_every_sample_once(tmp_path, ids):
    head = run(tmp_path, shards=ids, workers=2, saves={"0:9": str(tmp_path / "s.json")}, stop=[0, 9])
    rest = run(tmp_path, shards=ids, workers=1, states=[str(tmp_path / "s.json")], elastic=True)
    first_epoch = [i for b in head + rest[: len(rest) - 28] for i in b]
    assert sorted(first_epoch) == list(range(222))
    assert sorted(i for b in rest[-28:] for i in b) == list(range(222))  # the next epoch is whole again


def test_elastic_resume_from_two_ranks_to_one_delivers_every_sample_once(tmp_path, ids):
    taken = []
    for rank, k in ((0, 4), (1, 7)):
        head = run(tmp_path, {"RANK": str(rank), "WORLD_SIZE": "2"}, shards=ids, workers=1,
                   saves={f"0:{k}": str(tmp_path / f"r{rank}.json")}, stop=[0, k])
        taken += [i for b in head for i in b]
    rest = run(tmp_path, {"RANK": "0", "WORLD_SIZE": "1"}, shards=ids, workers=2, epochs=1, elastic=True,
               states=[str(tmp_path / "r0.json"), str(tmp_path / "r1.json")])
    assert sorted(taken + [i for b in rest for i in b]) == list(range(222))


def test_shards_split_between_workers_resume_exactly_and_elastically(tmp_path):
    few = id_shards(str(tmp_path / "few"), shards=2, per_shard=30)  # 3 workers: each reads a third of each
    with StagingLoader(few, batch_size=4, workers=3, spec=SPEC, seed=3) as loader:
        it = iter(loader)
        head = [int(i) for _ in range(4) for i in next(it)["cls"]]
        state = json.loads(json.dumps(loader.state_dict()))
        tail = [int(i) for b in it for i in b["cls"]]
    with StagingLoader(few, batch_size=4, workers=3, spec=SPEC, seed=3) as loader:
        loader.load_state_dict(state)
        assert [int(i) for b in loader for i in b["cls"]] == tail  # exact: the same batches, in order
    with StagingLoader(few, batch_size=4, workers=1, spec=SPEC, seed=3) as loader:
        loader.load_state_dict(state, elastic=True)
        rest = [int(i) for b in loader for i in b["cls"]]
    assert sorted(head + rest) == list(range(60))


# -- refusals and warnings ------------------------------------------------------------------------------

def _state_after(shards, batches, **kwargs):
    with StagingLoader(shards, batch_size=8, workers=2, spec=SPEC, **kwargs) as loader:
        it = iter(loader)
        for _ in range(batches):
            next(it)
        return json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("change, named", [({"seed": 5}, "seed=0"), ({"batch_size": 4}, "batch_size=8"),
                                           ({"workers": 1}, "workers=2")])
def test_a_state_from_other_settings_is_refused_naming_them(shards, change, named):
    state = _state_after(shards, 3)
    with StagingLoader(shards, spec=SPEC, **{"batch_size": 8, "workers": 2, **change}) as loader:
        with pytest.raises(SettingError, match=f"other settings: .*{named}.*elastic=True"):
            loader.load_state_dict(state)


def test_a_state_over_other_shards_is_refused(shards, tmp_path):
    state = _state_after(shards, 3)
    extra = id_shards(str(tmp_path / "more"), shards=1, per_shard=5)
    with StagingLoader([*shards, *extra], batch_size=8, workers=2, spec=SPEC) as loader:
        with pytest.raises(SettingError, match="shard list changed"):
            loader.load_state_dict(state)


def test_an_elastic_resume_over_a_folder_that_gained_a_shard_goes_on_with_the_epoch_it_saved(tmp_path):
    """A state over a short list keeps its names: the new shard waits for the next epoch, every sample of the
    saved epoch comes once."""
    folder = tmp_path / "grown"
    id_shards(str(folder), shards=4, per_shard=10)
    with StagingLoader(str(folder), batch_size=4, workers=2, spec=SPEC, seed=5) as loader:
        it = iter(loader)
        head = [int(i) for _ in range(3) for i in next(it)["cls"]]
        state = json.loads(json.dumps(loader.state_dict()))
    assert len(state["plan"]["shards"]) == 4
    id_shards(str(tmp_path / "more"), shards=5, per_shard=10)
    os.rename(tmp_path / "more" / "ids-0004.tar", folder / "ids-0004.tar")
    with StagingLoader(str(folder), batch_size=4, workers=2, spec=SPEC, seed=5) as loader:
        loader.load_state_dict(state, elastic=True)
        rest = [int(i) for b in loader for i in b["cls"]]
    assert sorted(head + rest) == list(range(40))


def test_an_elastic_resume_reads_a_shard_its_list_no_longer_names_from_where_the_state_names_it(tmp_path, caplog):
    """Out of the list but still on disk (a list given anew, a compressed shard's plain copy named by a state from
    before plans named the compressed files): the replay reads it, every sample comes once, none is said lost."""
    listed = id_shards(str(tmp_path / "ids"), shards=4, per_shard=10)
    with StagingLoader(listed, batch_size=4, workers=2, spec=SPEC, seed=5) as loader:
        it = iter(loader)
        head = [int(i) for _ in range(3) for i in next(it)["cls"]]
        state = json.loads(json.dumps(loader.state_dict()))
    with caplog.at_level(logging.INFO, logger="feedline"), \
            StagingLoader(listed[:3], batch_size=4, workers=2, spec=SPEC, seed=5) as loader:
        loader.load_state_dict(state, elastic=True)
        rest = [int(i) for b in loader for i in b["cls"]]
    assert sorted(head + rest) == list(range(40))
    assert "lost" not in caplog.text and "ids-0003.tar" in caplog.text  # named: read from where the state says


def test_something_else_than_a_state_is_refused(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=SPEC) as loader:
        with pytest.raises(SettingError, match="not a feedline loader state"):
            loader.load_state_dict({"epoch": 3})


def test_a_resume_against_a_cache_that_lost_shards_warns_naming_them(cache, data, caplog):
    store = CacheStore(cache, budget_bytes=10 * shard_bytes(data))
    store.recover()
    for k in range(4):
        publish_copy(store, data, k)
    spec = {"cls": "int64", "bin": ("uint8", (2048,))}
    with StagingLoader(cache=cache, batch_size=8, workers=2, spec=spec) as loader:
        it = iter(loader)
        got = [i for _ in range(2) for i in next(it)["cls"].tolist()]
        state = loader.state_dict()
    store.evict_oldest(1)  # ids-0000 goes while the job is down
    with caplog.at_level(logging.WARNING, logger="feedline.loader"):
        with StagingLoader(cache=cache, batch_size=8, workers=2, spec=spec) as loader:
            loader.load_state_dict(state)
            got += [i for b in loader for i in b["cls"].tolist()]
    assert any("ids-0000" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)
    assert len(got) == len(set(got))  # nothing twice
    assert set(range(20, 80)) <= set(got)  # every sample of the shards still there


# -- the epoch API -----------------------------------------------------------------------------------------

def test_set_epoch_chooses_the_epoch_as_distributed_sampler_does(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=SPEC) as a, \
            StagingLoader(shards, batch_size=8, workers=2, spec=SPEC) as b:
        a_epochs = [[i for x in a for i in x["cls"].tolist()] for _ in range(3)]
        b.set_epoch(2)
        assert [i for x in b for i in x["cls"].tolist()] == a_epochs[2]
        assert b.epoch == 2 and b.next_epoch == 3


def test_an_iterator_never_read_starts_no_epoch(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=SPEC) as a, \
            StagingLoader(shards, batch_size=8, workers=2, spec=SPEC) as b:
        first = [i for x in a for i in x["cls"].tolist()]
        iter(b)  # made and dropped: nothing starts, nothing counts
        assert b.epoch == -1 and b.next_epoch == 0
        assert [i for x in b for i in x["cls"].tolist()] == first and b.epoch == 0


def test_set_epoch_names_the_epoch_until_it_is_read_to_its_end(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=SPEC) as a, \
            StagingLoader(shards, batch_size=8, workers=2, spec=SPEC) as b:
        reference = [[i for x in a for i in x["cls"].tolist()] for _ in range(2)]
        b.set_epoch(0)
        next(iter(b))  # a peek: epoch 0 starts and is left
        assert [i for x in b for i in x["cls"].tolist()] == reference[0]  # the named epoch again, whole
        assert [i for x in b for i in x["cls"].tolist()] == reference[1]  # read to its end: counting goes on


def test_a_state_taken_at_the_last_batch_goes_on_with_the_next_epoch(shards):
    """Trainers that stop by len() (Lightning) never call next() after the last batch."""
    with StagingLoader(shards, batch_size=8, workers=2, spec=SPEC) as loader:
        it = iter(loader)
        for _ in range(len(loader)):
            next(it)
        state = loader.state_dict()
    assert state["finished"] and state["next_epoch"] == 1


def test_a_state_of_every_rank_resumes_this_ranks_part_or_all_of_them_elastically(caplog):
    from feedline.loader.plan.rank import Rank
    from feedline.loader.plan.resume import RANKS_FORMAT, own_state

    states = [{"format": "feedline.loader/1", "rank": r} for r in range(2)]
    bundle = {"format": RANKS_FORMAT, "ranks": states}
    assert own_state(bundle, Rank(1, 2), elastic=False) == (states[1], False)
    assert own_state([bundle, bundle], Rank(0, 2), elastic=False) == (states[0], False)  # gathered once per rank
    with caplog.at_level(logging.WARNING, logger="feedline"):
        assert own_state(bundle, Rank(0, 3), elastic=False) == (states, True)
    assert "resuming elastically" in caplog.text


@pytest.mark.parametrize("drop_last", [True, False])
def test_len_is_the_number_of_batches_the_epoch_yields(shards, drop_last):
    with StagingLoader(shards, batch_size=8, workers=2, spec=SPEC, drop_last=drop_last) as loader:
        expected = len(loader)
        assert sum(1 for _ in loader) == expected == (27 if drop_last else 29)  # 2 workers: 114 and 108 samples


def test_state_dict_is_cheap(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=SPEC) as loader:
        it = iter(loader)
        next(it)
        t0 = time.perf_counter()
        for _ in range(1000):
            loader.state_dict()
        per_call = (time.perf_counter() - t0) / 1000
    assert per_call < 0.001  # a loose bound on a noisy machine; docs/benchmarks.md has the measured figure


# -- feedline train ------------------------------------------------------------------------------------------

def _train(data, ckpt, keys, *extra):
    return [sys.executable, "-m", "feedline", "train", "--shards", data, "--epochs", "1", "--batch-size", "4",
            "--image-size", "32", "--checkpoint", ckpt, "--trace-keys", keys, "--progress", "false",
            "--metrics-port", "0", *extra]


@pytest.fixture
def jpegs(tmp_path):
    from helpers import jpeg_bytes, write_tar

    d = tmp_path / "jpeg"
    d.mkdir()
    for k in range(4):
        write_tar(str(d / f"j-{k}.tar"), [(f"k{k}{i:03d}", {"jpg": jpeg_bytes(i), "cls": str(i % 3).encode()})
                                          for i in range(30)])
    return str(d / "*.tar")


def _resume_trains_every_sample_once(jpegs, ckpt, keys):
    """`--resume` to the epoch's end: the trace then holds every sample of the epoch exactly once."""
    resumed = subprocess.run(_train(jpegs, ckpt, keys, "--resume"), cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr
    everything = open(keys).read().split()
    assert sorted(everything) == sorted(f"k{k}{i:03d}" for k in range(4) for i in range(30))  # once each


def test_sigterm_checkpoints_and_resume_trains_every_sample_exactly_once(tmp_path, jpegs):
    ckpt, keys = str(tmp_path / "ckpt"), str(tmp_path / "keys.txt")
    proc = subprocess.Popen(_train(jpegs, ckpt, keys, "--step-ms", "100"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while (not os.path.exists(keys) or len(open(keys).read().split()) < 20) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what Kubernetes sends before evicting the pod
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "stopping at step" in out
    trained = open(keys).read().split()
    assert 20 <= len(trained) < 120
    _resume_trains_every_sample_once(jpegs, ckpt, keys)


def test_a_sigkill_between_checkpoints_resumes_with_every_sample_in_the_trace_once(tmp_path, jpegs):
    # the steps after the last checkpoint are lost with the process and trained again: the trace, cut back to
    # the checkpoint on resume, holds them once, as the model does
    ckpt, keys = str(tmp_path / "ckpt"), str(tmp_path / "keys.txt")
    proc = subprocess.Popen(_train(jpegs, ckpt, keys, "--step-ms", "100", "--checkpoint-every", "4"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while (not os.path.exists(keys) or len(open(keys).read().split()) < 30) and time.monotonic() < deadline:
        time.sleep(0.05)
    while len(open(keys).read().split()) % 16 == 0:  # not just after a checkpoint: something for the resume to cut
        time.sleep(0.02)
    proc.kill()
    proc.wait(timeout=30)
    before = open(keys).read().split()
    assert 30 <= len(before) < 120 and len(set(before)) == len(before)
    _resume_trains_every_sample_once(jpegs, ckpt, keys)


def test_a_trace_rewound_to_a_position_drops_what_came_after_it(tmp_path):
    from feedline.trainer.keytrace import KeyTrace

    path = str(tmp_path / "keys" / "epoch-{epoch}.txt")
    with KeyTrace(path) as trace:
        trace.write(0, ["a", "b"])
        saved = trace.position()
        trace.write(0, ["c"])
        trace.write(1, ["d"])
    with KeyTrace(path) as again:
        again.rewind(saved)
        again.write(0, ["c2"])
    assert open(path.format(epoch=0)).read().split() == ["a", "b", "c2"]
    assert not os.path.exists(path.format(epoch=1))


def test_a_save_killed_midway_leaves_the_previous_checkpoint_in_use(tmp_path, jpegs):
    ckpt, keys = str(tmp_path / "ckpt"), str(tmp_path / "keys.txt")
    first = subprocess.run(_train(jpegs, ckpt, keys, "--max-steps", "5"), cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    saved = sorted(os.listdir(ckpt))
    torn = os.path.join(ckpt, ".tmp-step-000000099-4242")  # what a SIGKILL during a save leaves
    os.makedirs(torn)
    open(os.path.join(torn, "model.pt"), "wb").write(b"half a mod")
    again = subprocess.run(_train(jpegs, ckpt, keys, "--resume", "--epochs", "2", "--max-steps", "5"), cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"resuming from {os.path.join(ckpt, saved[-1])}" in again.stderr
    assert not os.path.exists(torn)  # the next save swept it


def test_resume_without_a_checkpoint_directory_is_refused():
    out = subprocess.run([sys.executable, "-m", "feedline", "train", "--shards", "x", "--resume",
                          "--metrics-port", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "checkpoint" in out.stderr


def test_the_demo_jobs_optimizer_steps_and_saves_as_torch_optim_sgd_does_and_loads_its_checkpoints():
    import copy

    import torch

    from feedline.trainer.sgd import MomentumSGD

    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    theirs = copy.deepcopy(ours)
    opts = [MomentumSGD(ours.parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)]
    for _ in range(4):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))  # bit for bit
    mine, torchs = opts[0].state_dict(), opts[1].state_dict()
    assert mine["param_groups"] == torchs["param_groups"]
    assert all(torch.equal(mine["state"][i]["momentum_buffer"], torchs["state"][i]["momentum_buffer"])
               for i in torchs["state"])
    fresh = MomentumSGD(copy.deepcopy(theirs).parameters(), lr=1.0, momentum=0.0)
    fresh.load_state_dict(torchs)  # a checkpoint an earlier version (torch.optim) wrote
    assert (fresh.lr, fresh.momentum) == (0.05, 0.9) and torch.equal(fresh.buffers[0], torchs["state"][0]["momentum_buffer"])
