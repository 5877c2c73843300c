"""The soak run (feedline soak / scripts/soak): its verdict on records made to fail, and one short real run.

The real run is the issue's 3-minute version: every fault of the hour's schedule, the same checks, slopes
loosened because a process's life between two faults is under a minute of samples, and a cache that holds
the whole dataset (the hour-long run evicts; see docs/reliability.md for what that still loses). It runs
beside the rest of the suite, started when the suite starts (background_soak.py); its test checks it.
"""

import json
import os
from pathlib import Path

import pytest
from background_soak import CACHE_PREFIX, SOAK

from feedline.soak.analysis import judge
from feedline.soak.faults import KINDS, schedule
from feedline.soak.run import Record

MiB = 1 << 20


def record(rows, keys_per_second=100.0, minutes=30.0):
    r = Record(settings={"fetch_threads": 2, "minutes": minutes, "interval": 10, "warmup": 60,
                         "worker_warmup": 0}, budget=100 * MiB, largest_shard=MiB,
               shard_of={"a": "s0.tar", "b": "s0.tar"}, shard_samples={"s0.tar": 2})
    r.rows = rows
    r.system = [{"t": float(t), "cache_bytes": 50 * MiB, "keys": int(t * keys_per_second)}
                for t in range(0, int(minutes * 60) + 1, 10)]
    return r


def row(t, pid, rss, role="trainer", fds=20, threads=8):
    return {"t": float(t), "role": role, "pid": pid, "rss": rss, "pss": rss, "anon": rss, "fds": fds,
            "threads": threads}


def one_epoch(tmp_path, keys):
    d = tmp_path / "keys"
    d.mkdir(exist_ok=True)
    (d / "epoch-0.txt").write_text("".join(f"{k}\n" for k in keys))
    (d / "epoch-1.txt").write_text("")  # a later epoch began: epoch 0 was trained to its end
    return str(d)


def test_every_kind_of_fault_happens_even_in_a_three_minute_run():
    kinds = {f.kind for f in schedule(180)}
    assert kinds == set(KINDS)
    assert max(f.seconds for f in schedule(180)) <= 18  # the store's downtime: at most a tenth of the run


def test_a_process_whose_memory_grows_two_mib_an_hour_misses_the_target(tmp_path):
    rows = [row(t, 1, 200 * MiB + t * 2 * MiB // 3600) for t in range(0, 1801, 10)]
    v = judge(record(rows), one_epoch(tmp_path, ["a", "b"]), warmup=60, worker_warmup=0)
    assert any(f.startswith("trainer: RSS grows 2.0") for f in v.failures), v.failures


def test_a_restart_is_not_growth_and_a_kill_is_not_a_fall(tmp_path):
    # two lives, each flat; the second starts 300 MiB higher (a restarted trainer loads more), then is killed
    rows = [row(t, 1, 200 * MiB) for t in range(0, 901, 10)] + [row(t, 2, 500 * MiB) for t in range(910, 1801, 10)]
    v = judge(record(rows), one_epoch(tmp_path, ["a", "b"]), warmup=60, worker_warmup=0)
    assert v.ok, v.failures
    assert abs(v.slopes["trainer"]["rss"]) < 0.01


def warming_lives(start_of_second_life, warm_for=300, then_per_hour=0.5):
    """Two trainer lives, each growing 3 MiB in its first ``warm_for`` seconds, then at ``then_per_hour``."""
    def life(pid, t0, t1):
        return [row(t, pid, 200 * MiB + min(t - t0, warm_for) * 3 * MiB // warm_for
                    + int(max(0, t - t0 - warm_for) * then_per_hour * MiB / 3600)) for t in range(t0, t1, 10)]
    return life(1, 0, start_of_second_life) + life(2, start_of_second_life, 3601)


def test_a_restarted_process_warms_up_as_the_first_did_before_its_slope_counts(tmp_path):
    v = judge(record(warming_lives(1200), minutes=60), one_epoch(tmp_path, ["a", "b"]), warmup=600, worker_warmup=60)
    assert v.ok, v.failures
    assert 0.3 < v.slopes["trainer"]["rss"] < 0.7  # the growth after each life's warm-up, not the warm-up


def test_a_restarted_process_still_growing_after_its_warm_up_misses_the_target(tmp_path):
    v = judge(record(warming_lives(1200, then_per_hour=2.0), minutes=60), one_epoch(tmp_path, ["a", "b"]),
              warmup=600, worker_warmup=60)
    assert any(f.startswith("trainer: RSS grows 2.0") for f in v.failures), v.failures


def worker_lives(anon_per_hour, lives=6, minutes=30):
    """Workers killed every few minutes whose mapped cache pages (RSS, fds) swing up within each life."""
    out, span = [], minutes * 60 // lives
    for k in range(lives):
        for t in range(k * span, (k + 1) * span, 10):
            r = row(t, 100 + k, 40 * MiB + (t - k * span) * 8 * MiB // span, role="worker",
                    fds=14 + (t - k * span) * 8 // span)
            r["anon"] = 20 * MiB + t * anon_per_hour * MiB // 3600
            out.append(r)
    return out


def test_workers_mapping_cache_pages_within_short_lives_are_judged_by_their_private_memory(tmp_path):
    rows = [row(t, 1, 200 * MiB) for t in range(0, 1801, 10)] + worker_lives(anon_per_hour=0)
    v = judge(record(rows), one_epoch(tmp_path, ["a", "b"]), warmup=60, worker_warmup=0)
    assert v.slopes["worker"]["rss"] > 10 and v.slopes["worker"]["fds"] > 10  # within each life: up
    assert v.ok, v.failures


def test_a_worker_whose_private_memory_grows_misses_the_target(tmp_path):
    rows = [row(t, 1, 200 * MiB) for t in range(0, 1801, 10)] + worker_lives(anon_per_hour=2)
    v = judge(record(rows), one_epoch(tmp_path, ["a", "b"]), warmup=60, worker_warmup=0)
    assert any(f.startswith("worker: private memory grows 2.0") for f in v.failures), v.failures


def test_workers_holding_more_descriptors_at_the_end_than_after_the_warm_up_miss_the_target(tmp_path):
    workers = worker_lives(anon_per_hour=0)
    for r in workers:
        r["fds"] += int(r["t"]) // 300  # each life starts a little higher: a descriptor leaked per life
    v = judge(record([row(t, 1, 200 * MiB) for t in range(0, 1801, 10)] + workers),
              one_epoch(tmp_path, ["a", "b"]), warmup=60, worker_warmup=0)
    assert any(f.startswith("worker: open descriptors reach") for f in v.failures), v.failures


def test_a_sample_trained_twice_in_an_epoch_fails_the_run(tmp_path):
    rows = [row(t, 1, 200 * MiB) for t in range(0, 1801, 10)]
    v = judge(record(rows), one_epoch(tmp_path, ["a", "b", "a"]), warmup=60, worker_warmup=0)
    assert "epoch 0: 1 sample(s) trained twice" in " ".join(v.failures)


def test_evicted_shards_kept_for_readers_beyond_one_epochs_worth_fail_the_run(tmp_path):
    r = record([row(t, 1, 200 * MiB) for t in range(0, 1801, 10)])
    r.system[50]["retained_bytes"] = 101 * MiB  # an epoch reads at most what the cache held: the budget, 100 MiB
    v = judge(r, one_epoch(tmp_path, ["a", "b"]), warmup=60, worker_warmup=0)
    assert any(f.startswith("/dev/shm: evicted shards kept for readers took") for f in v.failures), v.failures


def test_a_cache_over_its_budget_and_the_downloads_in_flight_fails_the_run(tmp_path):
    r = record([row(t, 1, 200 * MiB) for t in range(0, 1801, 10)])
    r.system[50]["cache_bytes"] = 103 * MiB  # budget 100 MiB, two fetch threads of 1 MiB shards: 102 MiB
    v = judge(r, one_epoch(tmp_path, ["a", "b"]), warmup=60, worker_warmup=0)
    assert any(f.startswith("/dev/shm: the cache's shards took") for f in v.failures), v.failures


def test_an_unexpected_exit_fails_the_run_naming_the_last_line_of_its_log(tmp_path):
    r = record([row(t, 1, 200 * MiB) for t in range(0, 1801, 10)])
    r.exits.append({"t": 165.0, "role": "trainer", "code": 1, "expected": False,
                    "log_tail": "starting\nfeedline.LoaderError: no readable sample in the first shards\n\n"})
    v = judge(r, one_epoch(tmp_path, ["a", "b"]), warmup=60, worker_warmup=0)
    assert ("trainer exited with 1 at 165 s, not by the schedule; its log's last line: feedline.LoaderError: no "
            "readable sample in the first shards") in v.failures


def test_a_process_that_ended_by_itself_leaves_the_end_of_its_log_in_the_record(tmp_path, caplog):
    import sys

    from feedline.soak.run import TAIL_LINES, Soak, _Proc

    code = "import sys\nfor i in range(100): print('line', i)\nsys.exit('the cause')"
    p = _Proc("trainer", lambda: [sys.executable, "-c", code], str(tmp_path))
    p.start()
    p.proc.wait()
    soak = Soak.__new__(Soak)  # only what _watch_exits reads: its processes, the record, the clock
    soak.procs, soak.record, soak.t0 = {"trainer": p}, Record(settings={}), 0.0
    p.start = lambda: None  # (a restart is not what this checks)
    with caplog.at_level("WARNING", logger="feedline.soak"):
        soak._watch_exits()
    [exit_] = soak.record.exits
    assert exit_["code"] == 1 and not exit_["expected"]
    tail = exit_["log_tail"].splitlines()
    assert len(tail) == TAIL_LINES and tail[-1] == "the cause" and tail[0] == f"line {100 - TAIL_LINES + 1}"
    assert "the cause" in caplog.text and p.log_path in caplog.text


@pytest.mark.soak
def test_three_minutes_under_every_fault_meet_the_targets_and_leave_nothing():
    code = SOAK.wait()  # started beside the suite as it began (background_soak.py), with background_soak.ARGS
    assert code == 0, SOAK.output()[-6000:]
    out = Path(SOAK.out)
    result = json.loads((out / "soak.json").read_text())
    verdict, events = result["verdict"], result["record"]["events"]
    assert {e["kind"] for e in events} >= set(KINDS)
    assert len(verdict["epochs"]) >= 2 and all(not e["twice"] and not e["partial_shards"] for e in verdict["epochs"])
    assert result["record"]["leftovers"] == []
    assert any("evicted" in line for line in (out / "logs" / "sidecar-1.log").read_text().splitlines())
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(CACHE_PREFIX)]  # its cache is gone
    assert (out / "soak.png").stat().st_size > 10_000 and "every target met" in (out / "soak.md").read_text()
