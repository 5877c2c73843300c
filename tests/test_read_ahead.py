"""A CPU host's loop slower than its workers: one next() reads the filled batches after its own, the next ones
hand them out without calling into the pool (device/handoff.py, DirectHandOff.get)."""

import time

import pytest
import torch

from feedline import LoaderError, StagingLoader
from feedline.loader.device.handoff import AHEAD, READ_AHEAD_MEMORY, cpu_ring_slots
from feedline.loader.settings import default_ring_slots

ID_SPEC = {"cls": "int64", "bin": ("uint8", (64,))}


def _counting_takes(loader):
    """The pool's take, counted: a batch read ahead is handed out with none."""
    pool = loader._pipeline.pool
    calls = [0]
    take = pool.take

    def counted(*args, **kwargs):
        calls[0] += 1
        return take(*args, **kwargs)

    pool.take = counted
    return calls


def _read_ahead(it, loader):
    """next() until one reads ahead: once the batches read before are handed out, the ring is full after the
    pause, and the next() that takes from the pool reads ahead."""
    for _ in range(AHEAD + 1):
        time.sleep(0.1)
        next(it)
        if loader._pipeline.queue.depth() > 0:
            return
    raise AssertionError("no next() read ahead")


def _slow_epoch(it, step=0.02):
    """One epoch read by a loop whose step gives the workers time to fill the ring."""
    out = []
    for batch in it:
        out.append({k: (v.clone() if isinstance(v, torch.Tensor) else list(v)) for k, v in batch.items()})
        time.sleep(step)
    return out


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_slow_loop_gets_every_sample_once_with_fewer_takes_than_batches(shards, zero_copy):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=zero_copy) as loader:
        takes = _counting_takes(loader)
        batches = _slow_epoch(iter(loader))
    ids = [int(i) for b in batches for i in b["cls"]]
    assert sorted(ids) == list(range(6 * 37))
    for b in batches:  # each batch's payload is its own, read ahead or not
        for i, row in zip(b["cls"].tolist(), b["bin"]):
            assert torch.all(row == i % 251)
        assert b["__key__"] == [f"s{i:07d}" for i in b["cls"].tolist()]
    assert takes[0] < len(batches) // 2  # most batches came read ahead (a loaded CI host fills fewer a read)


def test_batches_read_ahead_come_in_the_order_a_fast_loop_gets(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True, shuffle=False) as loader:
        fast = [b["cls"].tolist() for b in loader]
        slow = [b["cls"].tolist() for b in _slow_epoch(iter(loader))]
    assert slow == fast


def test_a_zero_copy_batch_handed_out_from_those_read_ahead_is_released_at_the_next_next(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        it = iter(loader)
        _read_ahead(it, loader)
        kept = next(it)  # handed out from those read ahead
        next(it)
        with pytest.raises(LoaderError, match="clone\\(\\) what you keep"):
            kept["bin"].sum()


def test_an_epoch_left_with_batches_read_ahead_gives_their_slots_back(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        _read_ahead(iter(loader), loader)
        for _ in range(3):  # later epochs, each whole: no slot stayed with the one left
            ids = [int(i) for b in _slow_epoch(iter(loader), 0.002) for i in b["cls"]]
            assert sorted(ids) == list(range(6 * 37))


def test_a_batch_handed_out_from_those_read_ahead_takes_no_lock_and_is_counted(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        it = iter(loader)
        _read_ahead(it, loader)
        pool = loader._pipeline.pool
        lock = pool._cv
        locks = [0]

        class Counted:  # the pool's lock, its acquisitions counted (the dispatcher's too: none in this short span)
            def acquire(self, *args, **kwargs):
                locks[0] += 1
                return lock.acquire(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(lock, name)

        takes = _counting_takes(loader)
        before = loader.cost()
        pool._cv = Counted()
        try:
            batch = next(it)  # handed out from those read ahead
        finally:
            pool._cv = lock
        after = loader.cost()
        assert batch["bin"].shape == (8, 64)
    assert takes[0] == 0 and locks[0] == 0
    assert after.batches == before.batches + 1
    assert after.cpu_seconds["loop"] > before.cpu_seconds["loop"]  # timed by the wall clock: it cannot block


def test_batches_read_ahead_count_as_decoded_on_a_cpu_host_which_has_no_device_queue(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        it = iter(loader)
        _read_ahead(it, loader)
        held = loader._pipeline.queue.depth()
        depth = loader.stats().queue_depth
    assert depth["device"] == 0 and depth["decoded"] >= held > 0


def test_a_loop_stepping_every_few_milliseconds_reads_ahead_too(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        it = iter(loader)
        first = next(it)["cls"].tolist()
        time.sleep(0.2)  # the workers fill the ring
        takes = _counting_takes(loader)
        batches = _slow_epoch(it, 0.003)
    assert takes[0] < len(batches) // 2
    ids = first + [int(i) for b in batches for i in b["cls"]]
    assert sorted(ids) == list(range(6 * 37))  # every sample once, read ahead or not
    for b in batches:
        for i, row in zip(b["cls"].tolist(), b["bin"]):
            assert torch.all(row == i % 251)


def test_a_cpu_hosts_default_ring_has_room_for_one_next_to_read_ahead_in_full(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        assert AHEAD == 8
        assert loader.ring_slots == loader._pipeline.ring.slots == 17  # 2 x 8 + 1: 8 read ahead, 8 going back
        it, handoff = iter(loader), loader._pipeline.queue
        next(it)
        while handoff.depth():  # hand out what the first next() read ahead
            next(it)
        time.sleep(0.3)  # the workers fill every other slot
        next(it)
        assert handoff.depth() == 7  # the batches after the one it returned


def test_a_ring_slots_set_or_a_device_path_keeps_the_ring_it_asked_for(shards):
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, ring_slots=7) as loader:
        assert loader._pipeline.ring.slots == 7
    with StagingLoader(shards, batch_size=8, workers=2, spec=ID_SPEC, device="standin", transfer_threads=1) as loader:
        assert loader._pipeline.ring.slots == default_ring_slots(2, 1)


def test_a_large_batch_grows_the_default_ring_by_what_the_read_ahead_memory_holds():
    assert cpu_ring_slots(7, 1 << 20) == 17
    assert cpu_ring_slots(7, READ_AHEAD_MEMORY // 2) == 9
    assert cpu_ring_slots(7, READ_AHEAD_MEMORY + 1) == 7
    assert cpu_ring_slots(27, 1 << 20) == 27  # twelve workers' ring has the room already
