"""The memory ceiling of the decode workers (worker_memory), with real worker processes.

A worker starts with about 20 MiB of private resident memory (the interpreter and numpy; the ring and the
shards it maps are shared pages and do not count), so a 320 MiB ceiling leaves room to decode and fails
only on what the transforms below allocate.
"""

import logging
import re
import threading
import time

import numpy as np
import pytest
from helpers import id_shards

from feedline import StagingLoader

MiB = 1 << 20
CEILING = 320 * MiB
ID_SPEC = {"cls": "int64", "bin": ("uint8", (64,))}


def ids_of(loader):
    return [int(i) for b in loader for i in b["cls"]]


def memory_lines(caplog):
    return [r.getMessage() for r in caplog.records if "memory ceiling" in r.getMessage()]


class AllocateOn:
    """On one sample, allocates ``nbytes`` in one C call (every page touched) and holds it, as a runaway
    decode would."""

    def __init__(self, value: int, nbytes: int):
        self.value = value
        self.nbytes = nbytes

    def __call__(self, sample):
        if int(sample["cls"]) == self.value:
            held = np.ones(self.nbytes, np.uint8)
            time.sleep(60)  # the watcher kills it long before
            del held
        return sample


_LEAKED: list = []  # in the worker: grows for the worker's life


class Leak:
    """Keeps ``nbytes`` for every sample it sees, as a cache that never evicts would."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def __call__(self, sample):
        _LEAKED.append(np.ones(self.nbytes, np.uint8))
        return sample


def test_a_sample_that_takes_its_worker_past_the_ceiling_twice_is_skipped_and_counted(shards, caplog, capfd):
    with caplog.at_level(logging.WARNING, logger="feedline.loader"):
        with StagingLoader(shards, batch_size=4, workers=2, spec=ID_SPEC, transform=AllocateOn(40, 1 << 30),
                           worker_memory=CEILING) as loader:
            got = ids_of(loader)
            stats = loader.stats()
    assert sorted(got) == [i for i in range(6 * 37) if i != 40]  # every other sample, each once
    assert stats.worker_restarts == {"crashed": 0, "stalled": 0, "memory": 2}
    assert stats.sample_errors_total["worker_crash"] == 1
    logged = memory_lines(caplog)
    assert len(logged) == 2
    assert all("worker_memory=320 MiB" in m and "ids-0001.tar sample 's0000040'" in m for m in logged), logged
    held = [int(re.search(r"\((\d+) MiB private resident\)", m).group(1)) for m in logged]
    # killed on its way to 1 GiB, before it got there (the watcher reads every 50 ms; the allocation touches
    # its pages at GB/s, so a loaded host lets it go further past the ceiling, never to its end)
    assert all(320 <= h < 1000 for h in held), held  # logged in whole MiB: just over 320 MiB reads 320
    assert "sample 's0000040' crashed a worker twice; skipped" in capfd.readouterr().err  # the worker's log


def test_no_ceiling_starts_no_watcher(shards):
    with StagingLoader(shards, batch_size=4, workers=1, spec=ID_SPEC) as loader:
        next(iter(loader))
        assert "feedline-memory" not in [t.name for t in threading.enumerate()]


def test_the_watcher_runs_with_a_ceiling_and_stops_with_the_loader(shards):
    with StagingLoader(shards, batch_size=4, workers=1, spec=ID_SPEC, worker_memory=CEILING) as loader:
        next(iter(loader))
        assert "feedline-memory" in [t.name for t in threading.enumerate()]
    assert "feedline-memory" not in [t.name for t in threading.enumerate()]


def test_a_worker_whose_memory_creeps_is_replaced_and_no_sample_is_lost_or_skipped(tmp_path, caplog):
    few = id_shards(str(tmp_path / "few"), shards=2, per_shard=20)
    with caplog.at_level(logging.WARNING, logger="feedline.loader"):
        with StagingLoader(few, batch_size=4, workers=1, spec=ID_SPEC, transform=Leak(20 * MiB),
                           worker_memory=CEILING) as loader:
            got = ids_of(loader)
            stats = loader.stats()
    assert sorted(got) == list(range(40))  # the sample in hand at each kill is decoded by the next worker
    assert stats.worker_restarts["memory"] >= 2
    assert stats.worker_restarts["crashed"] == stats.worker_restarts["stalled"] == 0
    assert stats.sample_errors_total["worker_crash"] == 0
    assert len(memory_lines(caplog)) == stats.worker_restarts["memory"]


def test_a_ceiling_too_small_for_a_worker_to_start_is_refused_naming_the_setting(shards):
    from feedline.api.config import Config, ConfigError
    from feedline.errors import SettingError

    with pytest.raises(SettingError, match="worker_memory.*at least 256 MiB, or 0"):
        StagingLoader(shards, spec=ID_SPEC, worker_memory=MiB)
    with pytest.raises(ConfigError, match="FEEDLINE_WORKER_MEMORY.*at least 256MiB, or 0"):
        Config.load(env={"FEEDLINE_WORKER_MEMORY": "1MiB"}).validate()
    assert Config.load(env={"FEEDLINE_WORKER_MEMORY": "2GiB"}).worker_memory == 2 << 30


class CopyLargeValues:
    """Copies 1 MiB values as a worker reading 1 MiB TFRecord features or Parquet cells does (four alive at
    once, then freed), and reports the page faults that took: fresh pages are faulted in and zeroed, reused
    ones are not."""

    def __call__(self, sample):
        import resource

        src = bytearray(MiB)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(50):
            held = [bytes(src) for _ in range(4)]
            del held
        sample["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        return sample


def test_a_worker_reuses_the_buffers_of_large_values_instead_of_faulting_in_fresh_pages(tmp_path):
    # glibc's defaults give and take the pages back for every copy here: 50 x 4 x 256 = 51200 faults a sample
    few = id_shards(str(tmp_path / "ids"), shards=1, per_shard=8)
    with StagingLoader(few, batch_size=4, workers=1, transform=CopyLargeValues(),
                       spec={**ID_SPEC, "faults": "int64"}) as loader:
        faults = [int(f) for b in loader for f in b["faults"]]
    assert faults and sorted(faults)[len(faults) // 2] < 1000
