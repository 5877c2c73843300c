"""The loader's statistics funnel: what the loop's next() records, and when it is counted."""

from feedline.loader.stats import STEPS_QUEUED, StatsRecorder


def test_steps_are_counted_by_the_next_reader():
    stats = StatsRecorder()
    stats.step(0.25, None, 100)
    stats.step(0.5, 2.0, 50)
    stats.step(0.125, 1.0)  # an epoch's end: no batch
    assert stats.loop_times() == (0.875, 3.0)
    snap = stats.snapshot({}, {}, {})
    assert snap.batches_total == 2 and snap.bytes_total["transferred"] == 150
    assert snap.data_wait_seconds.count == 3
    assert abs(snap.gpu_starvation_ratio - 0.875 / 3.875) < 1e-9


def test_steps_nobody_reads_are_counted_by_the_loop_itself_before_they_pile_up():
    stats = StatsRecorder()
    for _ in range(3 * STEPS_QUEUED):
        stats.step(0.001, 0.01, 1)
    assert len(stats._steps) < STEPS_QUEUED
    assert stats.snapshot({}, {}, {}).batches_total == 3 * STEPS_QUEUED
