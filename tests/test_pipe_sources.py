"""webdataset's ``pipe:COMMAND`` sources: the command's stdout is the shard, its exit status checked.

The transport (``feedline.sampler.pipe.fetch_pipe``) directly, then end to end through a real sidecar process.
"""

import hashlib
import os
import shutil
import signal
import threading
import time

import pytest
from helpers import KEPT_FOR_THE_MODULE, Sampler, descendants, gone, id_shards, manifest_ids, wait_for, write_tar

from feedline.cache.manifest import shard_path
from feedline.demo.store import Fault, FileStore
from feedline.sampler.errors import FetchAborted, FetchError
from feedline.sampler.pipe import STDERR_TAIL, fetch_pipe, pipe_command
from feedline.sampler.ratelimit import RateLimiter

NO_CAP = RateLimiter(0)


def fetch(url, dest, max_bytes=1 << 30, stop=None, limiter=NO_CAP, timeout=10.0, min_rate=0.0):
    return fetch_pipe(url, str(dest), max_bytes, stop or threading.Event(), limiter, timeout, min_rate)


def failure(url, dest, **kw) -> FetchError:
    with pytest.raises(FetchError) as info:
        fetch(url, dest, **kw)
    assert not os.path.exists(dest), "a failed fetch left its file"
    assert ours() == set(), "a failed fetch left a process"
    return info.value


def ours() -> set[int]:
    """This test process's descendants, less what the suite itself keeps running (the soak run, multiprocessing's
    resource tracker)."""
    from multiprocessing import resource_tracker

    out = descendants(os.getpid())
    for kept in {*KEPT_FOR_THE_MODULE, getattr(resource_tracker._resource_tracker, "_pid", None)} - {None}:
        out -= {kept} | descendants(kept)
    return out


def running(pid: int, program: str) -> set[int]:
    """Descendants of ``pid`` running ``program`` (its argv[0]'s base name)."""
    out = set()
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode()
        except OSError:
            continue
        if os.path.basename(argv0) == program:
            out.add(p)
    return out


def programs(pid: int, program: str, n: int, timeout: float = 10) -> set[int]:
    """The ``n`` or more descendants of ``pid`` running ``program``, once they run."""
    assert wait_for(lambda: len(running(pid, program)) >= n, timeout), f"{program} never started"
    return running(pid, program)


@pytest.fixture
def blob(tmp_path):
    """3 MiB and a bit of random bytes: several 1 MiB chunks and a partial one."""
    p = tmp_path / "blob.bin"
    p.write_bytes(os.urandom(3 * (1 << 20) + 12345))
    return p


class Running:
    """``fetch_pipe`` in a thread, as a fetch thread of the sidecar runs it."""

    def __init__(self, url, dest, timeout=60.0, max_bytes=1 << 30):
        self.stop = threading.Event()
        self.error = None
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(url, dest, timeout, max_bytes))
        self.thread.start()

    def _run(self, url, dest, timeout, max_bytes):
        try:
            self.result = fetch(url, dest, max_bytes=max_bytes, stop=self.stop, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc


# -- the command ---------------------------------------------------------------------------------------

def test_the_command_is_what_follows_pipe_stripped_and_an_empty_one_is_refused():
    assert pipe_command("pipe:  curl -sL https://h/a.tar \n") == "curl -sL https://h/a.tar"
    for bad in ("pipe:", "pipe:   ", "https://h/a.tar"):
        with pytest.raises(ValueError):
            pipe_command(bad)


def test_stdout_becomes_the_shard_byte_for_byte(tmp_path, blob):
    dest = tmp_path / "out.tar"
    n = fetch(f"pipe:cat {blob}", dest)
    assert n == blob.stat().st_size
    assert dest.read_bytes() == blob.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o600
    assert ours() == set()


def test_a_shell_pipeline_runs_under_sh(tmp_path, blob):
    dest = tmp_path / "out.tar"
    fetch(f"pipe:cat {blob} | cat | dd bs=7000 status=none", dest)
    assert dest.read_bytes() == blob.read_bytes()


def test_dest_is_a_new_file_never_one_written_through_a_link(tmp_path, blob):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    dest = tmp_path / "out.tar"
    os.symlink(victim, dest)
    fetch(f"pipe:cat {blob}", dest)
    assert victim.read_bytes() == b"keep me"
    assert not os.path.islink(dest) and dest.read_bytes() == blob.read_bytes()


def test_stdin_is_dev_null_so_a_command_reading_it_ends_rather_than_hangs(tmp_path):
    t0 = time.monotonic()
    e = failure("pipe:cat", tmp_path / "out.tar", timeout=30)
    assert e.reason == "truncated" and e.retry and "nothing" in str(e)
    assert time.monotonic() - t0 < 5


# -- failures -----------------------------------------------------------------------------------------

def test_a_failing_command_is_an_error_naming_its_status(tmp_path):
    e = failure("pipe:false", tmp_path / "out.tar")
    assert e.reason == "connection" and e.retry
    assert "false" in str(e) and "status 1" in str(e)


def test_a_failing_command_quotes_its_stderr_tail(tmp_path):
    e = failure("pipe:sh -c 'echo boom >&2; exit 3'", tmp_path / "out.tar")
    assert e.reason == "connection" and e.retry
    assert "status 3" in str(e) and "boom" in str(e)


def test_output_written_before_a_failure_is_not_kept(tmp_path, blob):
    e = failure(f"pipe:cat {blob}; echo partial >&2; exit 7", tmp_path / "out.tar")
    assert "status 7" in str(e) and "partial" in str(e)


def test_a_command_killed_by_a_signal_says_which(tmp_path):
    e = failure("pipe:printf abc; kill -TERM $$", tmp_path / "out.tar")
    assert e.reason == "connection" and "SIGTERM" in str(e)


def test_a_command_not_found_is_a_clear_error(tmp_path):
    e = failure("pipe:no-such-command-feedline-xyz /a/b.tar", tmp_path / "out.tar")
    assert "status 127" in str(e) and "not found" in str(e)


def test_exit_0_with_nothing_written_is_truncated(tmp_path):
    e = failure("pipe:true", tmp_path / "out.tar")
    assert e.reason == "truncated" and e.retry


def test_a_flood_on_stderr_neither_blocks_the_command_nor_grows_the_error(tmp_path, blob):
    # 1 MB of stderr beside the shard: a command whose stderr were not read would block on the full pipe
    dest = tmp_path / "out.tar"
    cmd = f"pipe:head -c 1000000 /dev/zero | tr '\\0' e >&2; cat {blob}; echo THE-END >&2; exit 4"
    t0 = time.monotonic()
    e = failure(cmd, dest, timeout=10)
    assert time.monotonic() - t0 < 8
    assert e.reason == "connection" and "status 4" in str(e) and "THE-END" in str(e)
    assert len(str(e)) < STDERR_TAIL + 500
    # and a command that succeeds with stderr flooded still gives its stdout whole
    fetch(f"pipe:head -c 1000000 /dev/zero >&2; cat {blob}", dest)
    assert dest.read_bytes() == blob.read_bytes()


def test_a_presigned_url_in_the_command_or_its_stderr_is_redacted(tmp_path):
    url = "https://store.example/b/shard-0001.tar?X-Amz-Credential=AKIA5&X-Amz-Signature=5ecre7"
    cmd = f"pipe:echo 'curl: (22) error for {url}' >&2; exit 22 # {url}"
    e = failure(cmd, tmp_path / "out.tar")
    assert "status 22" in str(e)
    assert "5ecre7" not in str(e) and "AKIA5" not in str(e)
    assert "store.example/b/shard-0001.tar?X-Amz-Credential=REDACTED" in str(e)


def test_output_larger_than_the_budget_is_killed_and_refused(tmp_path):
    t0 = time.monotonic()
    e = failure("pipe:cat /dev/zero", tmp_path / "out.tar", max_bytes=3 << 20)  # endless
    assert e.reason == "too_large" and not e.retry
    assert "--budget" in str(e) and "FEEDLINE_BUDGET" in str(e)
    assert time.monotonic() - t0 < 10


def test_exactly_the_budget_is_accepted(tmp_path, blob):
    assert fetch(f"pipe:cat {blob}", tmp_path / "out.tar", max_bytes=blob.stat().st_size) == blob.stat().st_size


# -- stop, timeouts, the rate cap, processes ------------------------------------------------------------

def test_stop_kills_a_command_that_hangs_promptly_and_leaves_no_process(tmp_path):
    dest = tmp_path / "out.tar"
    r = Running("pipe:sleep 60 & sleep 60", dest)
    pids = programs(os.getpid(), "sleep", 2)
    t0 = time.monotonic()
    r.stop.set()
    r.thread.join(10)
    assert not r.thread.is_alive() and time.monotonic() - t0 < 3
    assert isinstance(r.error, FetchAborted)
    assert gone(pids, 5) and ours() == set()
    assert not dest.exists()


def test_stop_kills_a_command_that_ignores_sigterm_within_seconds(tmp_path):
    dest = tmp_path / "out.tar"
    r = Running("pipe:trap '' TERM; sleep 60", dest)
    pids = programs(os.getpid(), "sleep", 1)  # the trap is set
    t0 = time.monotonic()
    r.stop.set()
    r.thread.join(15)
    assert not r.thread.is_alive() and time.monotonic() - t0 < 6
    assert isinstance(r.error, FetchAborted)
    assert gone(pids, 5) and ours() == set()
    assert not dest.exists()


def test_stop_mid_stream_discards_the_partial_file(tmp_path, blob):
    dest = tmp_path / "out.tar"
    r = Running(f"pipe:cat {blob}; sleep 60", dest)
    assert wait_for(lambda: dest.exists() and dest.stat().st_size > 0, 10)
    r.stop.set()
    r.thread.join(10)
    assert isinstance(r.error, FetchAborted) and not dest.exists()
    assert ours() == set()


def test_a_stop_already_set_runs_nothing(tmp_path):
    stop = threading.Event()
    stop.set()
    with pytest.raises(FetchAborted):
        fetch(f"pipe:touch {tmp_path / 'ran'}", tmp_path / "out.tar", stop=stop)
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out.tar").exists()


def test_a_silent_command_times_out(tmp_path):
    t0 = time.monotonic()
    e = failure("pipe:sleep 20", tmp_path / "out.tar", timeout=0.5)
    assert e.reason == "timeout" and e.retry and "0.5 s" in str(e)
    assert time.monotonic() - t0 < 5


def test_a_command_that_stalls_mid_shard_times_out(tmp_path, blob):
    e = failure(f"pipe:cat {blob}; sleep 20", tmp_path / "out.tar", timeout=0.5)
    assert e.reason == "timeout" and "no data" in str(e)


def test_a_command_that_closes_its_output_but_never_exits_times_out(tmp_path):
    e = failure("pipe:printf abc; exec >&-; sleep 20", tmp_path / "out.tar", timeout=0.5)
    assert e.reason == "timeout" and "did not exit" in str(e)


def test_a_command_slower_than_the_speed_floor_is_abandoned(tmp_path):
    t0 = time.monotonic()
    drip = "i=0; while [ $i -lt 200 ]; do printf x; sleep 0.05; i=$((i+1)); done"  # ~20 B/s for ~10 s
    e = failure(f"pipe:{drip}", tmp_path / "out.tar", timeout=0.5,
                min_rate=100_000)
    assert e.reason == "timeout" and "too slow" in str(e) and "fetch_min_mbps" in str(e)
    assert time.monotonic() - t0 < 5


def test_the_rate_cap_is_taken_for_every_byte(tmp_path, blob):
    size = blob.stat().st_size  # ~3.2 MB at 2 MB/s: at least ~1.6 s
    t0 = time.monotonic()
    fetch(f"pipe:cat {blob}", tmp_path / "out.tar", limiter=RateLimiter(2e6))
    assert time.monotonic() - t0 >= 0.8 * size / 2e6


def test_what_a_command_leaves_in_the_background_is_killed_too(tmp_path, blob):
    dest = tmp_path / "out.tar"
    pid_file = tmp_path / "pid"
    fetch(f"pipe:sleep 60 </dev/null >/dev/null 2>&1 & echo $! >{pid_file}; cat {blob}", dest)
    assert dest.read_bytes() == blob.read_bytes()
    assert gone([int(pid_file.read_text())], 5)  # orphaned when its shell exited: no longer our descendant


class Interrupting:
    """A rate cap whose wait is interrupted (Ctrl-C reaching the fetch thread)."""

    rate = 0

    def take(self, n, stop):
        raise KeyboardInterrupt


def test_an_interrupt_mid_stream_kills_the_command_and_removes_the_file(tmp_path):
    dest = tmp_path / "out.tar"
    with pytest.raises(KeyboardInterrupt):
        fetch("pipe:cat /dev/zero", dest, limiter=Interrupting())
    assert not dest.exists()
    assert ours() == set()


# -- end to end: the sidecar ----------------------------------------------------------------------------

def sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def ids_dir(tmp_path):
    d = tmp_path / "ids"
    id_shards(str(d), shards=4, per_shard=20, payload=2048)
    return d


def sampler(cache, source, *args):
    return Sampler(None, cache, "--policy", "fill", "--budget", "64MiB", *args, source=source)


def test_a_pipe_source_expands_its_braces_and_caches_each_commands_output(ids_dir, cache, samplers):
    s = sampler(cache, f"pipe:cat {ids_dir}/ids-{{0000..0003}}.tar", "--min-shards", "4")
    samplers.append(s)
    s.wait_ready(60)
    assert sorted(manifest_ids(cache)) == [f"ids-{k:04d}" for k in range(4)]
    for k in range(4):
        assert sha(shard_path(cache, f"ids-{k:04d}")) == sha(ids_dir / f"ids-{k:04d}.tar")
    assert s.stop() is not None and s.proc.returncode == 0
    assert os.listdir(os.path.join(cache, "shards", ".partial")) == []


def test_a_failing_command_is_counted_with_its_status_and_stderr_and_the_others_arrive(ids_dir, cache, samplers):
    (ids_dir / "ids-0002.tar").unlink()
    source = f"pipe:cat {ids_dir}/ids-{{0000..0003}}.tar::pipe:echo boom >&2; exit 3 # bad-0000.tar"
    s = sampler(cache, source, "--min-shards", "3")
    samplers.append(s)
    s.wait_ready(60)
    assert wait_for(lambda: s.metric("feedline_fetch_errors_total", reason="connection") >= 4, 30)
    assert sorted(manifest_ids(cache)) == ["ids-0000", "ids-0001", "ids-0003"]
    out = s.stop()
    assert "exited with status 1" in out and "No such file" in out
    assert "exited with status 3" in out and "boom" in out
    assert os.listdir(os.path.join(cache, "shards", ".partial")) == []


def test_a_command_writing_more_than_the_budget_is_killed_and_counted(tmp_path, cache, samplers):
    big = tmp_path / "big"
    big.mkdir()
    write_tar(str(big / "big-0.tar"), [("k0", {"bin": os.urandom(4 << 20)})])
    s = Sampler(None, cache, "--policy", "fill", "--budget", "2MiB", source=f"pipe:cat {big}/big-{{0..0}}.tar")
    samplers.append(s)
    assert wait_for(lambda: s.metric("feedline_fetch_errors_total", reason="too_large") >= 1, 60)
    assert manifest_ids(cache) == [] and os.listdir(os.path.join(cache, "shards", ".partial")) == []
    assert wait_for(lambda: running(s.proc.pid, "cat") == set(), 10)
    out = s.stop()
    assert "--budget" in out


def test_sigterm_kills_commands_that_hang_and_the_sidecar_exits_within_seconds(ids_dir, cache, samplers):
    s = sampler(cache, f"pipe:sleep 60; cat {ids_dir}/ids-{{0000..0003}}.tar", "--fetch-threads", "2")
    samplers.append(s)
    partial = os.path.join(cache, "shards", ".partial")
    pids = programs(s.proc.pid, "sleep", 2, 60) | running(s.proc.pid, "sh")  # two commands running
    t0 = time.monotonic()
    s.stop(signal.SIGTERM)
    assert time.monotonic() - t0 < 5
    assert s.proc.returncode == 0
    assert gone(pids, 5)
    assert os.listdir(partial) == []


def test_a_silent_command_times_out_and_is_counted(ids_dir, cache, samplers):
    s = sampler(cache, f"pipe:sleep 60; cat {ids_dir}/ids-{{0000..0000}}.tar", "--fetch-timeout", "1")
    samplers.append(s)
    first = programs(s.proc.pid, "sleep", 1, 60)
    assert wait_for(lambda: s.metric("feedline_fetch_errors_total", reason="timeout") >= 1, 60)
    assert manifest_ids(cache) == []
    assert gone(first, 5)  # the command that timed out was killed
    out = s.stop()
    assert "no data for 1 s" in out
    assert os.listdir(os.path.join(cache, "shards", ".partial")) == []


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_a_pipe_running_curl_against_a_real_store(ids_dir, cache, samplers):
    with FileStore(str(ids_dir)) as store:
        store.faults["ids-0003.tar"] = Fault(status=404)
        secret = f"'{store.url}/ids-0003.tar?X-Amz-Signature=5ecre7'"
        source = f"pipe:curl -sS -f {store.url}/ids-{{0000..0002}}.tar::pipe:curl -sS -f {secret}"
        s = sampler(cache, source, "--min-shards", "3")
        samplers.append(s)
        s.wait_ready(60)
        assert sorted(manifest_ids(cache)) == [f"ids-{k:04d}" for k in range(3)]
        for k in range(3):
            assert sha(shard_path(cache, f"ids-{k:04d}")) == sha(ids_dir / f"ids-{k:04d}.tar")
        assert wait_for(lambda: s.metric("feedline_fetch_errors_total", reason="connection") >= 1, 30)
        out = s.stop()
    assert "exited with status 22" in out and "404" in out
    assert "5ecre7" not in out and "X-Amz-Signature=REDACTED" in out
