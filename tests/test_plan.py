"""The epoch plan and the scheduler, on their own: no processes, no ring."""

from feedline.loader.workers.messages import DONE, END, BatchResult
from feedline.loader.plan.epoch_plan import EpochPlan, WorkerPlan
from feedline.loader.plan.rank import Rank
from feedline.loader.workers.scheduler import EpochEnd, ReadyBatch, Scheduler

SHARDS = [f"/data/s-{i:03d}.tar" for i in range(13)]


def test_ranks_and_workers_split_the_shards_disjointly_and_completely():
    parts = [a for r in range(3) for a in EpochPlan.make(SHARDS, epoch=2, seed=5, rank=Rank(r, 3), workers=2,
                                                           shuffle=True).assignment]
    flat = [s for part in parts for s in part]
    assert sorted(flat) == sorted(SHARDS) and len(flat) == len(set(flat))


def test_the_plan_depends_on_seed_and_epoch_only():
    plan = EpochPlan.make(list(reversed(SHARDS)), epoch=1, seed=7, rank=Rank(0, 1), workers=3)
    assert plan == EpochPlan.make(SHARDS, epoch=1, seed=7, rank=Rank(0, 1), workers=3)
    assert plan != EpochPlan.make(SHARDS, epoch=2, seed=7, rank=Rank(0, 1), workers=3)
    assert plan != EpochPlan.make(SHARDS, epoch=1, seed=8, rank=Rank(0, 1), workers=3)


def test_a_plan_round_trips_through_its_plain_state():
    plan = EpochPlan.make(SHARDS, epoch=4, seed=1, rank=Rank(1, 2), workers=3, shuffle=False)
    assert EpochPlan.from_state(plan.get_state()) == plan
    assert "epoch 4, rank 1 of 2: 6 of 13 shards, workers read 2/2/2" in plan.describe()


def test_a_worker_plan_travels_as_json():
    wp = EpochPlan.make(SHARDS, epoch=0, seed=3, rank=Rank(0, 1), workers=2).for_worker(1, resume=17, poison=[9, 4])
    assert WorkerPlan.from_json(wp.to_json()) == wp
    assert wp.poison == (4, 9) and wp.resume == 17


def test_fewer_shards_than_workers_are_split_so_every_worker_reads_the_same_share_of_each():
    plan = EpochPlan.make(SHARDS[:3], epoch=0, seed=1, rank=Rank(0, 1), workers=8)
    assert [len(a) for a in plan.assignment] == [3] * 8  # an eighth of each of the 3 shards
    pieces = [(path, part) for a, ps in zip(plan.assignment, plan.parts) for path, part in zip(a, ps)]
    assert sorted(pieces) == sorted((path, (k, 8)) for path in SHARDS[:3] for k in range(8))
    assert "3 of 3 shards, each shard in 8 parts" in plan.describe()
    wp = plan.for_worker(5)
    assert wp.parts == {0: (5, 8), 1: (5, 8), 2: (5, 8)} and WorkerPlan.from_json(wp.to_json()) == wp


def test_enough_shards_are_never_split():
    plan = EpochPlan.make(SHARDS[:4], epoch=0, seed=1, rank=Rank(0, 1), workers=4)
    assert all(part == (0, 1) for ps in plan.parts for part in ps) and plan.for_worker(0).parts == {}


def _result(kind, epoch, slot, batch, samples=4, pos=0):
    return BatchResult(kind, epoch, slot, batch, samples, pos, 0, 0, 0, (0,) * 7)


def test_slots_go_out_in_delivery_order_and_batches_come_back_in_it():
    s = Scheduler(slots=3, workers=2)
    s.start_epoch(0)
    fills = [s.next_fill() for _ in range(3)]
    assert fills == [(0, 0, 0), (1, 1, 0), (0, 2, 1)] and s.next_fill() is None  # (worker, slot, j)
    s.on_result(1, _result(DONE, 0, 1, 0))  # worker 1 answers first
    assert s.take() is None  # batch (0, worker 0) comes first
    s.on_result(0, _result(DONE, 0, 0, 0))
    assert s.take() == ReadyBatch(0, 0, 0, 4, 0, 0, 0) and s.take() == ReadyBatch(0, 1, 1, 4, 1, 0, 0)
    s.release(0)
    assert s.next_fill() == (1, 0, 1)


def test_the_epoch_ends_when_every_worker_ran_out():
    s = Scheduler(slots=2, workers=2)
    s.start_epoch(3)
    s.next_fill(), s.next_fill()
    s.on_result(0, _result(END, 3, 0, 0, samples=0))
    s.on_result(1, _result(DONE, 3, 1, 0, pos=4))
    assert s.take() == ReadyBatch(3, 0, 1, 4, 1, 0, 4)
    s.next_fill()  # worker 1's next batch
    s.on_result(1, _result(END, 3, 0, 1, samples=0, pos=4))
    assert s.take() == EpochEnd(3, 1)
    assert s.progress().delivered == (0, 4) and s.progress().ended == (True, True)


def test_answers_of_an_abandoned_epoch_only_return_their_slots():
    s = Scheduler(slots=2, workers=1)
    s.start_epoch(0)
    s.next_fill()
    s.start_epoch(1)
    assert s.on_result(0, _result(DONE, 0, 0, 0)) is False
    assert s.depths() == {"free": 2, "decoded": 0}


def test_a_resumed_epoch_goes_on_from_each_workers_next_batch_in_the_same_order():
    s = Scheduler(slots=4, workers=3)
    s.start_epoch(0, first=[3, 3, 2], delivered=[30, 31, 20])  # the loop had (0..2, w0), (0..2, w1), (0..1, w2)
    fills = [s.next_fill() for _ in range(4)]
    assert [(w, j) for w, _, j in fills] == [(2, 2), (0, 3), (1, 3), (2, 3)]
    assert s.delivered(0) == 30 and s.progress().delivered == (30, 31, 20)


def test_an_epoch_restarted_over_more_workers_keeps_its_failure_count_and_drops_the_old_answers():
    s = Scheduler(slots=4, workers=1)
    s.start_epoch(0)
    s.next_fill()
    s.on_result(0, _result(DONE, 0, 0, 0))
    s.add_errors("corrupt", 3)
    s.start_epoch(1, workers=3, restart=True)  # run 1: the rest of epoch 0 over three workers
    assert s.errors == 3 and s.samples == 4 and s.workers == 3
    assert [w for w, _, _ in (s.next_fill() for _ in range(3))] == [0, 1, 2]
    s.start_epoch(2)  # a new epoch starts its count anew
    assert s.errors == 0 and s.samples == 0
