"""The staging loader with real worker processes: order, coverage, faults, shutdown."""

import logging
import os
import signal
import time

import numpy as np
import pytest
import torch
from helpers import Slow, children_of, id_samples, id_shards, jpeg_bytes, write_tar

from feedline import LoaderError, Rank, StagingLoader
from feedline.formats.transforms import RandomResizedCrop

ID_SPEC = {"cls": "int64", "bin": ("uint8", (64,))}


def ids_of(loader):
    return [int(i) for b in loader for i in b["cls"]]


# -- batches ----------------------------------------------------------------------------------

def test_batches_are_dicts_of_tensors_keyed_by_extension(tmp_path):
    path = write_tar(str(tmp_path / "img.tar"), [(f"k{i:03d}", {"jpg": jpeg_bytes(i), "cls": str(i).encode()})
                                                  for i in range(20)])
    with StagingLoader(path, batch_size=8, workers=1) as loader:
        batch = next(iter(loader))
    assert set(batch) == {"jpg", "cls", "__key__"}
    assert batch["jpg"].dtype == torch.uint8 and tuple(batch["jpg"].shape) == (8, 72, 96, 3)  # HWC
    assert batch["cls"].dtype == torch.int64


def test_sample_payload_arrives_intact(shards):
    with StagingLoader(shards, batch_size=10, workers=2, spec=ID_SPEC) as loader:
        for batch in loader:
            for i, row in zip(batch["cls"].tolist(), batch["bin"]):
                assert torch.all(row == i % 251)


def test_a_transform_shapes_the_batch(tmp_path):
    path = write_tar(str(tmp_path / "img.tar"), [(f"k{i:03d}", {"jpg": jpeg_bytes(i), "cls": str(i).encode()})
                                                  for i in range(16)])
    with StagingLoader(path, batch_size=4, workers=1, transform=RandomResizedCrop(32, fields=["jpg"])) as loader:
        shapes = {tuple(b["jpg"].shape) for b in loader}
    assert shapes == {(4, 32, 32, 3)}


def test_variable_length_text_is_padded_with_a_lengths_field(tmp_path):
    texts = ["a", "hello", "ünïcode text", ""]
    path = write_tar(str(tmp_path / "t.tar"), [(f"k{i}", {"txt": t.encode()}) for i, t in enumerate(texts)])
    spec = {"txt": {"dtype": "uint8", "shape": [32], "variable": True}}
    with StagingLoader(path, batch_size=4, workers=1, spec=spec, shuffle=False) as loader:
        batch = next(iter(loader))
    got = [bytes(row[:n].tolist()).decode() for row, n in zip(batch["txt"], batch["txt_len"])]
    assert got == texts
    assert int(batch["txt"][0, 1:].sum()) == 0  # padded with zeros


def test_a_spec_can_rename_a_field(shards):
    spec = {"label": {"dtype": "int64", "source": "cls"}}
    with StagingLoader(shards, batch_size=5, workers=2, spec=spec) as loader:
        assert set(next(iter(loader))) == {"label", "__key__"}


def test_zero_copy_batches_are_views_into_the_ring(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        seen = []
        for batch in loader:
            seen.extend(batch["cls"].tolist())  # valid until the next next()
        assert sorted(seen) == list(range(6 * 37))



def test_a_zero_copy_batch_kept_past_the_next_batch_raises_on_use_instead_of_changing(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        it = iter(loader)
        kept = next(it)
        names = [k for k, v in kept.items() if isinstance(v, torch.Tensor)]
        for _ in range(4):  # more batches than the ring has slots: the kept one's slot is reused
            next(it)
        for name in names:
            with pytest.raises(LoaderError, match="clone\\(\\) what you keep"):
                kept[name].sum()
            with pytest.raises(LoaderError):
                torch.stack([kept[name], kept[name]])  # inside a list too
        assert len(kept["__key__"]) == 8  # side fields are plain lists, never views of the ring


def test_a_zero_copy_batch_held_past_the_loaders_close_raises_instead_of_reading_freed_memory(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        it = iter(loader)
        batch = next(it)
    with pytest.raises(LoaderError, match="clone"):
        batch["bin"].sum()  # the ring is unmapped: a plain view here would crash the process


def test_a_slot_gets_as_many_views_made_ahead_as_it_handed_out_since_the_last_tick_and_none_twice(tmp_path):
    from feedline.loader.device.handoff import MAX_STOCK, STOCK

    many = id_shards(str(tmp_path / "many"), shards=4, per_shard=250)
    # 7 slots: 70 batches a round hand out about 10 views a slot, past the floor of 8
    with StagingLoader(many, batch_size=4, workers=2, spec=ID_SPEC, zero_copy=True, ring_slots=7) as loader:
        it = iter(loader)
        handoff = loader._pipeline.queue
        handed, seen, peak = [], set(), 0
        for _ in range(3):  # a step far faster than a tick: slots hand out views the tick has not made yet
            for _ in range(70):
                batch = next(it)
                assert id(batch["bin"]) not in seen  # a view is never handed out twice (a kept one must raise)
                seen.add(id(batch["bin"]))
                handed.append(batch)  # kept alive: no id is reused
            counts = list(handoff._handed)
            peak = max(peak, *counts)
            handoff.restock()  # the dispatcher's tick, now
            for slot, stock in enumerate(handoff._stock):
                if handoff._slots[slot] is not None:
                    assert len(stock) >= min(MAX_STOCK, max(STOCK, counts[slot] + counts[slot] // 4))
        assert peak > STOCK  # the test's own premise: some slot handed out more than the floor
        assert all(n == 0 for n in handoff._handed)
        with pytest.raises(LoaderError, match="clone"):
            handed[-2]["bin"].sum()  # made ahead or not, a view let go raises


def test_a_zero_copy_batch_is_intact_until_the_next_batch_is_taken(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True, shuffle=False) as loader:
        for batch in loader:
            time.sleep(0.01)  # the workers run ahead and fill every other slot meanwhile
            for i, row in zip(batch["cls"].tolist(), batch["bin"]):
                assert torch.all(row == i % 251)

# -- coverage and order -----------------------------------------------------------------------

def test_every_sample_exactly_once_per_epoch_across_ranks_and_workers(shards):
    world = 3
    seen = []
    for rank in range(world):
        with StagingLoader(shards, batch_size=7, workers=2, spec=ID_SPEC, rank=Rank(rank, world)) as loader:
            seen.extend(ids_of(loader))
    assert sorted(seen) == list(range(6 * 37))


def test_each_epoch_covers_every_sample_once(shards):
    with StagingLoader(shards, batch_size=16, workers=2, spec=ID_SPEC) as loader:
        for _ in range(3):
            assert sorted(ids_of(loader)) == list(range(6 * 37))


def test_drop_last_drops_only_partial_batches(shards):
    with StagingLoader(shards, batch_size=16, workers=2, spec=ID_SPEC, drop_last=True) as loader:
        sizes = [len(b["cls"]) for b in loader]
    assert set(sizes) == {16}
    assert 6 * 37 - 2 * 15 <= sum(sizes) <= 6 * 37


def test_same_seed_gives_the_same_order(shards):
    orders = []
    for _ in range(2):
        with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, seed=7) as loader:
            orders.append(ids_of(loader))
    assert orders[0] == orders[1]


def test_different_epochs_and_seeds_give_different_orders(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, seed=7) as loader:
        first, second = ids_of(loader), ids_of(loader)
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, seed=8) as loader:
        other_seed = ids_of(loader)
    assert first != second
    assert first != other_seed


def test_shuffle_mixes_samples_beyond_shard_order(tmp_path):
    shards = id_shards(str(tmp_path / "ids"), shards=4, per_shard=100)
    with StagingLoader(shards, batch_size=10, workers=1, spec=ID_SPEC, shuffle_buffer=200) as loader:
        order = ids_of(loader)
    steps = np.diff(order)
    assert np.mean(steps == 1) < 0.1  # not read off in sequence
    # a batch draws from more than one shard
    shards_per_batch = [len({i // 100 for i in order[k:k + 10]}) for k in range(0, 400, 10)]
    assert np.mean(shards_per_batch) > 1.5
    assert abs(np.corrcoef(np.arange(len(order)), order)[0, 1]) < 0.9


def test_in_order_false_still_delivers_everything(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, in_order=False, transfer_threads=2) as loader:
        assert sorted(ids_of(loader)) == list(range(6 * 37))


def test_breaking_out_of_an_epoch_then_the_next_epoch_is_whole(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC) as loader:
        for i, _ in enumerate(loader):
            if i == 2:
                break
        assert sorted(ids_of(loader)) == list(range(6 * 37))


def test_new_shards_are_seen_at_the_next_epoch(tmp_path):
    d = str(tmp_path / "grow")
    id_shards(d, shards=2, per_shard=10)
    with StagingLoader(os.path.join(d, "*.tar"), batch_size=4, workers=2, spec=ID_SPEC) as loader:
        assert len(ids_of(loader)) == 20
        write_tar(os.path.join(d, "ids-9999.tar"), id_samples(1000, 10))
        assert len(ids_of(loader)) == 30


# -- bad input -------------------------------------------------------------------------------------

def test_corrupt_sample_is_skipped_and_counted(tmp_path):
    samples = [(f"k{i:03d}", {"jpg": jpeg_bytes(i), "cls": str(i).encode()}) for i in range(12)]
    samples[5] = ("k005", {"jpg": jpeg_bytes(5)[:200], "cls": b"5"})  # truncated JPEG
    samples[7] = ("k007", {"jpg": b"garbage", "cls": b"7"})
    path = write_tar(str(tmp_path / "c.tar"), samples)
    with StagingLoader(path, batch_size=4, workers=1, max_sample_errors=5) as loader:
        got = sorted(ids_of(loader))
        stats = loader.stats()
    assert got == [i for i in range(12) if i not in (5, 7)]
    assert stats.sample_errors_total["corrupt"] == 2


def test_sample_missing_a_field_is_skipped_and_counted(shards, tmp_path):
    path = write_tar(str(tmp_path / "m.tar"), id_samples(5000, 5) + [("nofield", {"txt": b"x"})])
    with StagingLoader([*shards, path], batch_size=8, workers=2, spec=ID_SPEC, max_sample_errors=3) as loader:
        assert len(ids_of(loader)) == 6 * 37 + 5
        assert loader.stats().sample_errors_total["missing_field"] == 1


def test_sample_too_large_for_its_slot_is_skipped_and_counted(tmp_path):
    samples = [(f"k{i}", {"txt": b"x" * (10 if i != 3 else 100)}) for i in range(6)]
    path = write_tar(str(tmp_path / "t.tar"), samples)
    spec = {"txt": {"dtype": "uint8", "shape": [16], "variable": True}}
    with StagingLoader(path, batch_size=2, workers=1, spec=spec, max_sample_errors=2) as loader:
        assert sum(len(b["txt"]) for b in loader) == 5
        assert loader.stats().sample_errors_total["too_large"] == 1


def test_sustained_corruption_exceeds_the_failure_budget(tmp_path):
    samples = [(f"k{i:03d}", {"jpg": b"not a jpeg" if i % 2 else jpeg_bytes(i), "cls": b"1"}) for i in range(40)]
    path = write_tar(str(tmp_path / "bad.tar"), samples)
    with StagingLoader(path, batch_size=4, workers=1, max_sample_errors=5) as loader:
        with pytest.raises(LoaderError, match="max_sample_errors"):
            ids_of(loader)


def test_truncated_shard_is_skipped_and_other_shards_still_load(shards):
    with open(shards[0], "r+b") as f:
        f.truncate(os.path.getsize(shards[0]) // 2)
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC) as loader:
        got = ids_of(loader)
        assert sorted(got) == list(range(37, 6 * 37))
        assert loader.stats().sample_errors_total["bad_shard"] == 1


def test_killed_worker_is_replaced_and_no_sample_is_lost(shards):
    with StagingLoader(shards, batch_size=4, workers=2, spec=ID_SPEC, transform=Slow(0.01)) as loader:
        seen = []
        for i, batch in enumerate(loader):
            seen.extend(batch["cls"].tolist())
            if i == 3:
                os.kill(loader._pipeline.pool.worker_pids()[1], signal.SIGKILL)
        assert sorted(seen) == list(range(6 * 37))
        assert loader.stats().worker_restarts_total == 1


class _CrashOn:
    """Kills its worker process (as a segfaulting decoder would) on one sample."""

    def __init__(self, value):
        self.value = value

    def __call__(self, sample):
        if int(sample["cls"]) == self.value:
            os.kill(os.getpid(), signal.SIGSEGV)
        return sample


def test_a_sample_that_crashes_its_worker_twice_is_skipped(shards):
    with StagingLoader(shards, batch_size=4, workers=2, spec=ID_SPEC, transform=_CrashOn(40)) as loader:
        got = sorted(ids_of(loader))
        stats = loader.stats()
    assert got == [i for i in range(6 * 37) if i != 40]
    assert stats.worker_restarts_total == 2
    assert stats.sample_errors_total["worker_crash"] == 1


# -- misconfiguration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, setting", [
    ({"batch_size": 0}, "batch_size"),
    ({"workers": 0}, "workers"),
    ({"rank": Rank(0, 7)}, "shards"),  # more ranks than the 6 shards: one would get none
    ({"ring_slots": 1}, "ring_slots"),
    ({"device": "cuda:0"} if not torch.cuda.is_available() else {"device": "tpu"}, "device"),
    ({"start_method": "fork"}, "start_method"),
])
def test_misconfiguration_is_refused_naming_the_setting(shards, kwargs, setting):
    with pytest.raises(ValueError, match=setting):
        StagingLoader(shards, spec=ID_SPEC, **kwargs)


def test_a_spec_that_does_not_match_the_data_is_refused(shards):
    with pytest.raises(ValueError, match="spec"):
        StagingLoader(shards, spec={"cls": "int64", "bin": ("uint8", (128,))})
    with pytest.raises(ValueError, match="'jpg'"):
        StagingLoader(shards, spec={"jpg": ("uint8", (8, 8, 3))})


def test_a_ring_larger_than_memory_is_refused(shards):
    from feedline.preflight import memory_budget

    per_slot = memory_budget().available // 8  # 16 slots: twice the memory left
    with pytest.raises(ValueError, match="ring_slots"):
        StagingLoader(shards, spec=ID_SPEC, batch_size=per_slot // 72 + 1, ring_slots=16).close()


def test_no_matching_shards_is_refused(tmp_path):
    with pytest.raises(ValueError, match="shards"):
        StagingLoader(str(tmp_path / "*.tar"))


# -- accounting ---------------------------------------------------------------------------------------

def test_slow_step_means_no_starvation(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, starvation_window=0.5) as loader:
        ids_of(loader)  # warm: the first batches wait for the workers to start
        for batch in loader:
            time.sleep(0.05)
        stats = loader.stats()
    assert stats.gpu_starvation_ratio < 0.2
    assert stats.step_seconds_total >= 0.05 * 20


def test_instant_step_with_slow_decoding_means_starvation(shards):
    with StagingLoader(shards, batch_size=8, workers=1, spec=ID_SPEC, transform=Slow(0.005)) as loader:
        ids_of(loader)
        stats = loader.stats()
    assert stats.gpu_starvation_ratio > 0.8
    assert stats.data_wait_seconds_total > 0.5


def test_stats_report_queues_samples_and_bytes(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, ring_slots=6) as loader:
        n = len(ids_of(loader))
        deadline = time.monotonic() + 5  # slots handed out past a worker's end come back asynchronously
        while loader.stats().queue_depth["free"] < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        s = loader.stats()
    assert s.samples_total == n == 6 * 37
    assert s.bytes_total["decoded"] == n * (64 + 8 + len("s0000000"))  # bin, cls, and the key
    assert s.bytes_total["transferred"] == s.bytes_total["decoded"]
    assert s.queue_capacity["free"] == 6
    assert s.queue_depth["free"] == 6  # all slots back at the end of the epoch
    assert s.workers == {"busy": 0, "idle": 2}
    assert s.data_wait_seconds.count == s.batches_total + 1  # the final next() that ends the epoch


# -- shutdown --------------------------------------------------------------------------------------------

def test_close_stops_every_worker(shards):
    loader = StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC)
    next(iter(loader))
    assert len(children_of(os.getpid())) >= 2
    loader.close()
    assert children_of(os.getpid()) == []


def test_an_exception_in_the_training_loop_leaves_nothing_running(shards):
    with pytest.raises(RuntimeError, match="boom"):
        with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC) as loader:
            for _ in loader:
                raise RuntimeError("boom")
    assert children_of(os.getpid()) == []


class _NumpyJitter:
    """A transform drawing from np.random, as user code does."""

    def __call__(self, sample):
        sample["noise"] = np.random.random(4).astype(np.float32)
        return sample


def test_the_same_seed_gives_the_same_augmentations(tmp_path):
    path = write_tar(str(tmp_path / "img.tar"), [(f"k{i:03d}", {"jpg": jpeg_bytes(i), "cls": str(i).encode()})
                                                  for i in range(24)])
    from feedline.formats.transforms import Compose

    runs = []
    for _ in range(2):
        with StagingLoader(path, batch_size=8, workers=1, seed=3,
                           transform=Compose(RandomResizedCrop(32, fields=["jpg"]), _NumpyJitter())) as loader:
            runs.append([(b["jpg"].clone(), b["noise"].clone()) for b in loader])
    for (a_img, a_noise), (b_img, b_noise) in zip(*runs):
        assert torch.equal(a_img, b_img) and torch.equal(a_noise, b_noise)


# -- stalled workers -----------------------------------------------------------------------------------

class _HangOn:
    """Hangs its worker forever on one sample, as a deadlocked decoder or a hung filesystem read would."""

    def __init__(self, value):
        self.value = value

    def __call__(self, sample):
        if int(sample["cls"]) == self.value:
            time.sleep(3600)
        return sample


def test_a_stopped_worker_is_replaced_with_its_stack_logged_and_no_sample_lost(shards, caplog):
    with caplog.at_level(logging.WARNING, logger="feedline.loader"):
        with StagingLoader(shards, batch_size=4, workers=2, spec=ID_SPEC, transform=Slow(0.01),
                           worker_timeout=1.0) as loader:
            seen = []
            for i, batch in enumerate(loader):
                seen.extend(batch["cls"].tolist())
                if i == 3:
                    os.kill(loader._pipeline.pool.worker_pids()[1], signal.SIGSTOP)
            stats = loader.stats()
    assert sorted(seen) == list(range(6 * 37))
    assert stats.worker_restarts == {"crashed": 0, "stalled": 1, "memory": 0}
    logged = [r.getMessage() for r in caplog.records if "no progress for" in r.getMessage()]
    assert len(logged) == 1
    assert "worker 1 stalled" in logged[0]
    assert "its stack:" in logged[0] and 'File "' in logged[0]  # faulthandler's dump of the worker


def test_a_sample_that_hangs_its_worker_twice_is_skipped_and_counted_naming_shard_and_key(shards, caplog):
    with caplog.at_level(logging.WARNING, logger="feedline.loader"):
        with StagingLoader(shards, batch_size=4, workers=2, spec=ID_SPEC, transform=_HangOn(40),
                           worker_timeout=1.0) as loader:
            got = sorted(ids_of(loader))
            stats = loader.stats()
    assert got == [i for i in range(6 * 37) if i != 40]
    assert stats.worker_restarts == {"crashed": 0, "stalled": 2, "memory": 0}
    assert stats.sample_errors_total["worker_crash"] == 1
    logged = [r.getMessage() for r in caplog.records if "no progress for" in r.getMessage()]
    assert len(logged) == 2 and all("ids-0001.tar sample 's0000040'" in m for m in logged)
    assert all("in __call__" in m for m in logged)  # the stack shows where: the transform's time.sleep


def test_a_slow_but_progressing_worker_is_not_taken_for_stalled(tmp_path):
    few = id_shards(str(tmp_path / "few"), shards=2, per_shard=6)
    with StagingLoader(few, batch_size=4, workers=1, spec=ID_SPEC, transform=Slow(0.25),
                       worker_timeout=0.5) as loader:  # every batch takes twice the timeout; every sample half
        assert len(ids_of(loader)) == 12
        assert loader.stats().worker_restarts_total == 0


class _Counting:
    """A transform that remembers being called, as one that loads a model on first use would."""

    def __init__(self):
        self.calls = 0

    def __call__(self, sample):
        self.calls += 1
        return sample


def test_building_a_loader_never_calls_the_users_transform_nor_moves_its_random_streams(shards):
    import random

    transform = _Counting()
    random.seed(5)
    np.random.seed(5)
    expected = (random.random(), np.random.random())
    random.seed(5)
    np.random.seed(5)
    with StagingLoader(shards, batch_size=8, workers=1, spec=ID_SPEC, transform=transform) as loader:
        assert (random.random(), np.random.random()) == expected
        assert len(ids_of(loader)) == 6 * 37
    assert transform.calls == 0  # the probe and the workers ran copies


class _WithTable:
    """A transform that carries a large lookup table to every worker."""

    def __init__(self):
        self.table = np.arange(2_000_000, dtype=np.int64)  # 16 MB pickled

    def __call__(self, sample):
        sample["cls"] = int(self.table[int(sample["cls"])])
        return sample


def test_more_workers_than_shards_read_every_sample_once_and_all_take_part(tmp_path):
    few = id_shards(str(tmp_path / "few"), shards=2, per_shard=30)
    with StagingLoader(few, batch_size=4, workers=3, spec=ID_SPEC, drop_last=False) as loader:
        assert len(loader) == 3 * 5  # each worker: 10 samples of each shard's thirds -> 20 -> 5 batches
        ids = ids_of(loader)
        busy = {w for w, (batches, _) in enumerate(loader.state_dict()["per_worker"]) if batches}
    assert sorted(ids) == list(range(60)) and busy == {0, 1, 2}


def test_a_transform_of_many_megabytes_reaches_every_worker(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, transform=_WithTable()) as loader:
        assert sorted(ids_of(loader)) == list(range(6 * 37))


# -- copy mode: batches the loop keeps ------------------------------------------------------------

class _Kept:
    """A real ring and KeptBatches over it, the loop's part played by the test (no workers)."""

    def __init__(self, spare=2, slots=4):
        from feedline.loader.ring.kept import KeptBatches
        from feedline.loader.ring.batch_ring import BatchRing, RingLayout
        from feedline.loader.layout.spec import Spec

        self.ring = BatchRing(RingLayout(Spec.parse({"x": ("float32", (3,))}), 4), slots, 1)
        self.released = []
        self.kept = KeptBatches(self.ring, self.released.append, spare)

    def take(self, slot, value, samples=4):
        """Fill ``slot`` as a worker would (through the ring's own mapping) and hand it out."""
        self.ring.slot(slot)["x"][:] = value
        batch = {"x": torch.from_numpy(self.kept.views(slot)["x"][:samples])}
        self.kept.hold(slot, batch)
        return batch

    def close(self):
        self.kept.close()
        self.ring.close()


@pytest.fixture
def kept():
    k = _Kept()
    yield k
    k.close()


def test_a_slot_goes_back_once_its_batch_is_let_go(kept):
    batch = kept.take(0, 1.0)
    kept.kept.collect()
    assert kept.released == []
    del batch
    kept.kept.collect()
    assert kept.released == [0] and kept.kept.moved_out == 0


def test_a_slot_still_seen_through_a_view_or_a_numpy_array_stays_out(kept):
    row, arr = kept.take(0, 1.0)["x"][1], kept.take(1, 2.0)["x"].numpy()
    kept.kept.collect()
    assert kept.released == []
    del row, arr
    kept.kept.collect()
    assert sorted(kept.released) == [0, 1]


def test_a_batch_saved_by_autograd_for_backward_stays_out_until_backward(kept):
    w = torch.ones(3, requires_grad=True)
    loss = (kept.take(0, 3.0)["x"] * w).sum()  # mul saves x for w's gradient
    kept.kept.collect()
    assert kept.released == []
    loss.backward()
    del loss
    kept.kept.collect()
    assert kept.released == [0] and torch.equal(w.grad, torch.full((3,), 12.0))


def test_past_the_spare_the_oldest_kept_batch_is_copied_out_and_keeps_its_values(kept):
    first = kept.take(0, 1.0)
    view = first["x"][2:]  # a view taken before the move: it moves too
    second, third = kept.take(1, 2.0, samples=2), kept.take(2, 3.0)
    kept.kept.collect()  # three held, two allowed: the oldest is moved out, its slot given back
    assert kept.released == [0] and kept.kept.moved_out == 1
    kept.ring.slot(0)["x"][:] = 9.0  # a worker fills the slot again
    assert torch.equal(first["x"], torch.ones(4, 3)) and torch.equal(view, torch.ones(2, 3))
    again = kept.take(0, 4.0)  # the slot works as before, in a new frame
    assert torch.equal(again["x"], torch.full((4, 3), 4.0)) and torch.equal(first["x"], torch.ones(4, 3))
    assert torch.equal(second["x"], torch.full((2, 3), 2.0)) and torch.equal(third["x"], torch.full((4, 3), 3.0))


def test_batches_held_at_close_are_copied_out_and_stay_valid():
    k = _Kept()
    batch = k.take(0, 5.0)
    k.close()  # the ring's memory is gone: the batch lives in memory of its own
    assert torch.equal(batch["x"], torch.full((4, 3), 5.0)) and k.kept.moved_out == 1


def test_copy_mode_copies_nothing_for_a_loop_that_keeps_nothing(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC) as loader:
        for _ in range(2):
            for batch in loader:
                assert batch["bin"].sum() >= 0  # used, then let go
        assert loader.stats().kept_batches_copied_total == 0


def test_copy_mode_batches_kept_by_the_loop_never_change(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC) as loader:
        kept = [b for _ in range(2) for b in loader]  # every batch of two epochs, no clone
        assert loader.stats().kept_batches_copied_total >= len(kept) - loader.ring_slots
    for batch in kept:  # the keys travel beside the ring, as lists: a changed tensor shows
        assert batch["cls"].tolist() == [int(k[1:]) for k in batch["__key__"]]
        for i, row in zip(batch["cls"].tolist(), batch["bin"]):
            assert torch.all(row == i % 251)
