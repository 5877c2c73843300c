"""workers="auto" and transfer_threads="auto": picked from the host at start-up, with the reasons logged."""

import logging
import os

import pytest

from app import StagingLoader
from app.config import Config, ConfigError
from app.loader import autotune


def test_a_cgroup_quota_is_read_in_cpus(tmp_path):
    (tmp_path / "limited").write_text("150000 100000\n")
    (tmp_path / "unlimited").write_text("max 100000\n")
    assert autotune.cgroup_cpus(str(tmp_path / "limited")) == 1.5
    assert autotune.cgroup_cpus(str(tmp_path / "unlimited")) is None
    assert autotune.cgroup_cpus(str(tmp_path / "absent")) is None


def test_auto_leaves_one_cpu_to_the_training_loop(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cpus, _ = autotune.usable_cpus()
    assert autotune.choose("cpu").workers == max(1, cpus - 1)
    monkeypatch.setattr(autotune, "usable_cpus", lambda: (1, "1 CPU"))
    assert autotune.choose("cpu").workers == 1


def test_auto_shares_the_cpus_among_the_ranks_on_the_node(monkeypatch):
    monkeypatch.setattr(autotune, "usable_cpus", lambda: (16, "16 CPUs"))
    assert autotune.choose("cuda", ranks_on_node=1).workers == 15
    assert autotune.choose("cuda", ranks_on_node=4).workers == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert autotune.choose("cuda").workers == 1


def test_auto_transfer_threads_are_two_with_cuda_and_one_on_a_cpu_host():
    assert autotune.choose("cuda").transfer_threads == 2
    assert autotune.choose("cpu").transfer_threads == 1


def test_a_loader_with_auto_workers_starts_with_a_number_and_says_why(shards, caplog):
    with caplog.at_level(logging.INFO, logger="feedline.loader"):
        with StagingLoader(shards, batch_size=8, workers="auto", transfer_threads="auto",
                           spec={"cls": "int64"}) as loader:
            assert isinstance(loader.workers, int) and 1 <= loader.workers <= max(1, (os.cpu_count() or 1) - 1)
            assert sum(len(b["cls"]) for b in loader) == 6 * 37
    assert any("(auto: " in r.getMessage() for r in caplog.records)


def test_feedline_train_defaults_to_auto_and_refuses_anything_else_that_is_not_a_count():
    assert Config.load(env={}).workers == "auto"
    assert Config.load(env={"FEEDLINE_WORKERS": "3"}).workers == 3
    for bad in ("0", "many"):
        with pytest.raises(ConfigError, match="workers"):
            Config.load(env={"FEEDLINE_WORKERS": bad})
