"""The device path (h2d, transfer_threads) run on this CPU host against the stand-in device (device="standin").

The same code as on a GPU: one copy a slot into a device buffer made for it, events made once, slots given
back once a query says their copy landed — and the training process's budget (DESIGN.md, "The training
process's share"), read from the loader's own counters: device calls on the loop's thread, objects made a
batch, host waits on the device, wake-ups. test_cuda.py runs the same checks on a GPU (scripts/gpu-check).
"""

import time

import pytest
import torch
from helpers import id_shards

from feedline import StagingLoader
from feedline.errors import SettingError
from feedline.loader import loader as loader_module
from feedline.loader.device.standin import StandInGpu

ID_SPEC = {"cls": "int64", "bin": ("uint8", (512,))}
PATHS = [(0, "slot"), (1, "slot"), (2, "slot"), (1, "fields")]


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    """6 shards of 64 samples: ids 0..383, each payload byte the id mod 251."""
    return id_shards(str(tmp_path_factory.mktemp("device") / "ids"), shards=6, per_shard=64, payload=512)


def _intact(batch) -> bool:
    expected = (batch["cls"] % 251).to(torch.uint8)
    return bool(torch.equal(batch["bin"][:, 0], expected) and torch.equal(batch["bin"][:, -1], expected))


def _steady(loader, batches: int, step: float = 0.0):
    """The loader's cost over ``batches`` batches of a loop whose step takes ``step`` seconds, once warm."""
    it = iter(loader)
    for _ in range(8):
        next(it)
    before = loader.cost()
    for _ in range(batches):
        batch = next(it)
        assert _intact(batch)
        deadline = time.perf_counter() + step
        while time.perf_counter() < deadline:  # the step: the loop's thread busy, as a launch-bound one is
            pass
    return loader.cost().since(before)


@pytest.mark.parametrize("threads,h2d", PATHS)
def test_every_sample_arrives_once_and_intact_whatever_the_transfer_setting(ids, threads, h2d):
    with StagingLoader(ids, batch_size=16, workers=2, spec=ID_SPEC, device="standin", transfer_threads=threads,
                       h2d=h2d) as loader:
        for epoch in range(2):
            seen = []
            for batch in loader:
                assert _intact(batch)
                seen += batch["cls"].tolist()
            assert sorted(seen) == list(range(6 * 64)), f"epoch {epoch}"


def test_a_fed_loop_pays_at_most_three_device_calls_and_no_object_sync_or_wake_up_a_batch(ids):
    with StagingLoader(ids, batch_size=16, workers=2, spec=ID_SPEC, device="standin", transfer_threads=0) as loader:
        cost = _steady(loader, 12, step=0.004)
    per = cost.per_batch()
    assert per["device_calls_loop"] <= 3.0, per  # a query, a copy, its event (a timed copy skips the query)
    assert cost.device_calls == cost.device_calls_loop  # no other thread touches the device
    assert cost.device_objects == 0 and cost.host_syncs == 0, per
    assert per["wakeups"] <= 2.0, per  # here none: each batch's result is read when next() comes for it
    assert cost.cpu_seconds["transfer"] == 0.0


def test_with_transfer_threads_the_loop_still_makes_three_calls_and_no_object(ids):
    with StagingLoader(ids, batch_size=16, workers=2, spec=ID_SPEC, device="standin", transfer_threads=1) as loader:
        cost = _steady(loader, 12, step=0.004)
    per = cost.per_batch()
    assert per["device_calls_loop"] <= 3.0 and cost.device_objects == 0 and cost.host_syncs == 0, per
    assert cost.cpu_seconds["transfer"] > 0  # the thread's CPU is counted


def test_the_path_before_it_makes_objects_and_waits_every_batch_which_the_counters_show(ids):
    with StagingLoader(ids, batch_size=16, workers=2, spec=ID_SPEC, device="standin", transfer_threads=1,
                       h2d="fields") as loader:
        cost = _steady(loader, 12, step=0.002)
    per = cost.per_batch()
    assert per["device_objects"] >= 4 and per["host_syncs"] >= 1 and per["device_calls_loop"] > 3, per


def test_the_dispatcher_is_not_woken_for_batches_on_a_cpu_host(ids):
    with StagingLoader(ids, batch_size=16, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        cost = _steady(loader, 12, step=0.004)
    assert cost.per_batch()["wakeups"] <= 2.0
    assert cost.cpu_seconds["dispatcher"] < cost.cpu_seconds["loop"]  # it wakes for its tick only



def _dispatcher_waits(seconds: float) -> int:
    """The times the loader's dispatcher thread blocked (its voluntary context switches) over ``seconds``."""
    import threading

    tid = next(t.native_id for t in threading.enumerate() if t.name == "feedline-dispatcher")

    def switches() -> int:
        with open(f"/proc/self/task/{tid}/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("voluntary_ctxt_switches")))

    before = switches()
    time.sleep(seconds)
    return switches() - before


def test_a_dispatcher_nobody_listens_to_wakes_about_once_a_second(ids):
    """Each wake-up of an idle dispatcher costs the training process CPU with nothing to push (issue 68): with no
    sink its tick is a second, not a quarter."""
    with StagingLoader(ids, batch_size=16, workers=2, spec=ID_SPEC, zero_copy=True) as loader:
        it = iter(loader)
        next(it)  # the ring fills behind the batch the loop holds; then nothing moves
        time.sleep(0.5)
        waits = _dispatcher_waits(3.0)
    assert 2 <= waits <= 5, waits


def test_a_dispatcher_with_a_sink_ticks_four_times_a_second(ids):
    from feedline.metrics.catalog import LOADER
    from feedline.metrics.sink import PrometheusSink

    with StagingLoader(ids, batch_size=16, workers=2, spec=ID_SPEC, zero_copy=True,
                       sink=PrometheusSink(LOADER)) as loader:
        it = iter(loader)
        next(it)
        time.sleep(0.5)
        waits = _dispatcher_waits(3.0)
    assert 10 <= waits <= 16, waits

class _Slow(StandInGpu):
    """A stand-in whose copies land 5 ms after they are issued; it records each slot given back and whether its
    copy had landed then."""

    def __init__(self, cost):
        super().__init__(cost, lag=0.005)


@pytest.mark.parametrize("threads", [0, 1])
def test_a_slot_goes_back_to_the_workers_only_once_its_copy_landed(ids, monkeypatch, threads):
    monkeypatch.setattr(loader_module, "StandInGpu", _Slow)
    early = []
    with StagingLoader(ids, batch_size=16, workers=2, spec=ID_SPEC, device="standin",
                       transfer_threads=threads) as loader:
        pool, slots = loader._pipeline.pool, loader._pipeline.slots
        release = pool.release

        def watched(slot):
            if not slots.copied[slot].done():
                early.append(slot)
            release(slot)

        pool.release = watched
        seen = [c for b in loader for c in b["cls"].tolist()]
    assert sorted(seen) == list(range(6 * 64))
    assert early == []


@pytest.mark.parametrize("threads", [0, 1])
def test_batches_the_loop_keeps_keep_their_values_and_are_counted(ids, threads):
    with StagingLoader(ids, batch_size=16, workers=2, spec=ID_SPEC, device="standin",
                       transfer_threads=threads) as loader:
        kept = list(loader)  # every batch held: no device buffer may be copied into again under them
        assert all(_intact(b) for b in kept)
        assert sorted(c for b in kept for c in b["cls"].tolist()) == list(range(6 * 64))
        assert loader.stats().kept_batches_copied_total > 0  # their slots got new buffers


def test_copies_are_timed_one_batch_in_sixteen(ids):
    with StagingLoader(ids, batch_size=8, workers=2, spec=ID_SPEC, device="standin") as loader:
        for _ in range(2):
            for _ in loader:
                time.sleep(0.001)
        s = loader.stats()
    assert s.batches_total == 2 * 48
    assert 1 <= s.h2d_seconds.count <= s.batches_total // 16 + 1


def test_fields_needs_a_transfer_thread_and_the_setting_is_named(ids):
    with pytest.raises(SettingError, match="h2d.*transfer_threads"):
        StagingLoader(ids, spec=ID_SPEC, device="standin", transfer_threads=0, h2d="fields")
    with pytest.raises(SettingError, match="h2d"):
        StagingLoader(ids, spec=ID_SPEC, device="standin", h2d="pages")


def test_feedlines_cpu_in_the_training_process_is_exported_by_thread(ids):
    from feedline.metrics.catalog import LOADER
    from feedline.metrics.sink import PrometheusSink

    sink = PrometheusSink(LOADER)
    with StagingLoader(ids, batch_size=16, workers=2, spec=ID_SPEC, device="standin", transfer_threads=1,
                       sink=sink) as loader:
        for _ in range(2):
            for _ in loader:
                pass
        time.sleep(0.6)  # two ticks of the dispatcher
    assert sink.value("trainer_cpu_seconds_total", thread="loop") > 0
    assert sink.value("trainer_cpu_seconds_total", thread="transfer") > 0
    assert 0 < sink.value("trainer_cpu_per_batch_seconds") < 1
