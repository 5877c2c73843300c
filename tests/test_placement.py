"""CPU placement (issue 69): the training process keeps whole cores for its launching threads, the workers get
the rest, one a core, the GPU's NUMA node first; read from made-up /proc and /sys trees of the hosts it must
handle, and from this host's own /proc in a real run."""

import os

import pytest

from feedline import SettingError
from feedline.loader.cpus.host import Host, format_cpus, gpu_node, parse_cpus
from feedline.loader.cpus.placement import plan


def fake_host(root, cpus: int, threads: int = 1, nodes: int = 1, allowed: str | None = None,
              cpuset: str | None = None, cpu_max: str | None = None, v1_quota: tuple[int, int] | None = None,
              gpu: tuple[str, int] | None = None, cgroup: str = "/") -> str:
    """A /proc and /sys tree of a host with ``cpus`` logical CPUs, ``threads`` a core (Linux numbers siblings
    ``c`` and ``c + cpus / threads``), on ``nodes`` NUMA nodes (contiguous cores each)."""
    root = str(root)

    def write(path, text):
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text + "\n")

    cores = cpus // threads
    write("proc/self/status", f"Name:\tpython\nCpus_allowed_list:\t{allowed or f'0-{cpus - 1}'}\n")
    if cpu_max is not None or cpuset is not None:  # cgroup v2
        write("proc/self/cgroup", f"0::{cgroup}")
        folder = "sys/fs/cgroup" + cgroup.rstrip("/")
        if cpu_max is not None:
            write(f"{folder}/cpu.max", cpu_max)
        if cpuset is not None:
            write(f"{folder}/cpuset.cpus.effective", cpuset)
    elif v1_quota is not None:
        write("proc/self/cgroup", f"4:cpu,cpuacct:{cgroup}\n3:cpuset:/")
        write(f"sys/fs/cgroup/cpu,cpuacct{cgroup.rstrip('/')}/cpu.cfs_quota_us", str(v1_quota[0]))
        write(f"sys/fs/cgroup/cpu,cpuacct{cgroup.rstrip('/')}/cpu.cfs_period_us", str(v1_quota[1]))
    for c in range(cpus):
        core = c % cores
        write(f"sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list",
              format_cpus([core + t * cores for t in range(threads)]))
    per_node = cores // nodes
    for n in range(nodes):
        mine = [core + t * cores for core in range(n * per_node, (n + 1) * per_node) for t in range(threads)]
        write(f"sys/devices/system/node/node{n}/cpulist", format_cpus(mine))
    if gpu is not None:
        write(f"sys/bus/pci/devices/{gpu[0]}/numa_node", str(gpu[1]))
    return root


def placed(root, **kwargs):
    host = Host.read(root)
    return plan(host, **kwargs)


def test_cpu_lists_read_and_write_as_linux_writes_them():
    assert parse_cpus("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert format_cpus([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    with pytest.raises(ValueError):
        parse_cpus("3-1")


def test_two_cpus_give_one_to_the_training_process_and_one_to_the_workers(tmp_path):
    p = placed(fake_host(tmp_path, 2))
    assert p.trainer == (0,) and p.worker_cores == ((1,),)
    assert p.worker(0) == (1,) and p.worker(3) == (1,)  # a worker past the cores: all the workers' CPUs
    assert len(p.worker_cpus) == 1


def test_sixteen_vcpus_as_eight_cores_keep_two_whole_cores_for_the_training_process(tmp_path):
    host = Host.read(fake_host(tmp_path, 16, threads=2))
    assert host.cores[0] == (0, 8) and len(host.cores) == 8 and host.siblings == 2
    p = plan(host)
    assert p.trainer == (0, 1, 8, 9)  # both hyperthreads of cores 0 and 1: no worker on a launching core's sibling
    assert p.worker_cores == ((2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (7, 15))
    assert p.worker(0) == (2, 10) and len(p.worker_cpus) == 12
    assert "the training process on CPUs 0-1,8-9" in p.describe() and "2 threads a core" in p.describe()


def test_a_setting_keeps_as_many_cores_for_the_training_process_as_it_names(tmp_path):
    p = placed(fake_host(tmp_path, 16, threads=2), trainer_cores=3)
    assert p.trainer == (0, 1, 2, 8, 9, 10) and len(p.worker_cores) == 5


def test_two_numa_nodes_put_the_training_process_and_the_first_workers_on_the_gpus_node(tmp_path):
    root = fake_host(tmp_path, 16, nodes=2, gpu=("0000:3b:00.0", 1))
    node = gpu_node(root, "0000:3b:00.0")
    assert node == 1
    p = placed(root, gpu_node=node)
    assert p.trainer == (8, 9)  # node 1's first cores
    assert [c[0] for c in p.worker_cores] == [10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7]
    assert placed(root).trainer == (0, 1)  # no GPU: node 0 first
    assert "the GPU's NUMA node 1 first" in placed(root, gpu_node=node).describe()


def test_a_plain_cuda_device_is_the_current_gpu_whose_node_placement_looks_up():
    import torch

    from feedline.loader.device.gpu import cuda_index

    assert cuda_index(torch.device("cuda:3")) == 3
    assert cuda_index(torch.device("cuda"), current=lambda: 5) == 5  # torch's current device
    assert cuda_index(torch.device("cpu")) is None


def test_a_cpuset_of_six_counts_six(tmp_path):
    root = fake_host(tmp_path, 64, allowed="10-15", cpuset="10-15", cpu_max="max 100000")
    p = placed(root)
    assert p.trainer == (10,) and p.worker_cpus == (11, 12, 13, 14, 15)  # workers="auto": 5


def test_a_quota_of_two_and_a_half_cpus_over_sixteen_pins_nothing_and_says_why(tmp_path):
    """docker --cpus, a Kubernetes limit without a cpuset: other containers run on these CPUs too."""
    p = placed(fake_host(tmp_path, 16, cpu_max="250000 100000"))
    assert Host.read(str(tmp_path)).quota == 2.5
    assert not p.placed and "a CPU quota of 2.5 CPUs over the 16" in p.why_not and p.worker(0) == ()
    from feedline.loader.tune.autotune import usable_cpus

    assert usable_cpus(str(tmp_path), allowed=set(range(16))) == (2, "a cgroup CPU quota of 2.5")  # not 16


def test_a_cpuset_of_its_own_with_a_quota_as_large_places(tmp_path):
    p = placed(fake_host(tmp_path, 64, allowed="8-15", cpuset="8-15", cpu_max="800000 100000"))
    assert p.trainer == (8, 9) and p.worker_cpus == tuple(range(10, 16))  # 8 cores: 2 kept


def test_a_quota_of_six_cpus_over_sixty_four_counts_six(tmp_path):
    from feedline.loader.tune.autotune import usable_cpus

    root = fake_host(tmp_path, 64, cpu_max="600000 100000")
    assert usable_cpus(root, allowed=set(range(64)))[0] == 6
    assert usable_cpus(root, allowed=set(range(4)))[0] == 4  # a quota above the CPUs it may use caps nothing


def test_a_cgroup_v1_quota_is_read_as_well(tmp_path):
    from feedline.loader.tune.autotune import usable_cpus

    root = fake_host(tmp_path, 8, v1_quota=(400000, 100000), cgroup="/kubepods/pod1")
    assert Host.read(root).quota == 4 and usable_cpus(root, allowed=set(range(8)))[0] == 4


def test_one_core_places_nothing_and_says_why(tmp_path):
    one = placed(fake_host(tmp_path / "one", 1))
    assert not one.placed and "1 CPU" in one.describe() and one.worker(0) == ()


def test_eight_local_ranks_each_get_a_share_of_their_own(tmp_path):
    root = fake_host(tmp_path, 64, threads=2, nodes=2)
    plans = [placed(root, local_rank=r, local_world=8) for r in range(8)]
    cpus = [set(p.trainer) | set(p.worker_cpus) for p in plans]
    assert all(len(c) == 8 for c in cpus)  # 32 cores / 8 ranks: 4 cores, 8 logical CPUs each
    assert len(set().union(*cpus)) == 64  # never overlapping, every CPU given
    assert all(len(p.trainer) == 2 for p in plans)  # 4 cores: one kept for the training process


def test_ranks_already_bound_to_their_numa_node_split_only_what_they_were_given(tmp_path):
    """torchrun --numa-binding: ranks 0-3 on node 0's CPUs, 4-7 on node 1's (the cpuset is the whole host)."""
    shares = []
    for rank in range(8):
        node = rank // 4
        root = fake_host(tmp_path / str(rank), 32, nodes=2, allowed=f"{16 * node}-{16 * node + 15}", cpuset="0-31",
                         cpu_max="max 100000")
        p = placed(root, local_rank=rank, local_world=8)
        shares.append(set(p.trainer) | set(p.worker_cpus))
    assert all(len(s) == 4 for s in shares) and len(set().union(*shares)) == 32


def test_explicit_lists_are_taken_as_written_and_checked(tmp_path):
    root = fake_host(tmp_path, 16)
    p = placed(root, setting="trainer=0-1;workers=2-15")
    assert p.trainer == (0, 1) and p.worker_cpus == tuple(range(2, 16))
    for bad, says in (("trainer=0-1", "name both sides"), ("trainer=0-3;workers=3-15", "on both sides"),
                      ("trainer=0;workers=1-40", "not among those"), ("fast", "give 'auto', 'off'")):
        with pytest.raises(SettingError, match=says) as exc:
            placed(root, setting=bad)
        assert exc.value.setting == "cpu_placement"


def test_off_pins_nothing(tmp_path):
    p = placed(fake_host(tmp_path, 16), setting="off")
    assert not p.placed and p.describe() == "CPU placement: off" and p.worker_cpus == ()


def test_this_hosts_own_tree_reads(tmp_path):
    host = Host.read("/")
    assert set(host.allowed) == os.sched_getaffinity(0)
    assert sorted(c for core in host.cores for c in core) == list(host.allowed)


PINS = """
import os, sys, threading, time
from feedline.loader.cpus.pinning import ProcessPins

def masks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            out[int(tid)] = next(l.split()[1] for l in f if l.startswith("Cpus_allowed_list"))
    return out

stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
before = masks()
from feedline.loader.cpus.pinning import claim
from feedline.loader.cpus.placement import Placement
plan = Placement((0,), ((1,),), claims=tuple(claim((0,))))
assert ProcessPins.hold(plan) and ProcessPins.hold(Placement((0,), ((1,),)))  # two loaders in one process
late = threading.Thread(target=stop.wait); late.start()  # started while pinned: inherits the pin
pinned = masks()
ProcessPins.release()
still = masks()
ProcessPins.release()
after = masks()
stop.set(); early.join(); late.join()
print(sorted(set(before.values())), sorted(set(pinned.values())), sorted(set(still.values())), sorted(set(after.values())))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_the_training_process_threads_are_pinned_while_a_loader_holds_them_and_given_back_after():
    import subprocess
    import sys

    from helpers import ROOT

    out = subprocess.run([sys.executable, "-c", PINS], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    everything = format_cpus(sorted(os.sched_getaffinity(0)))
    assert out.stdout.split("] [") == [f"['{everything}'", "'0'", "'0'", f"'{everything}']\n"]


def masks_of(pid: int | str, threads: bool = False) -> set[str]:
    """The Cpus_allowed_list of a process (each of its threads' with ``threads``), read from /proc."""
    tids = os.listdir(f"/proc/{pid}/task") if threads else [None]
    out = set()
    for tid in tids:
        path = f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status"
        try:
            with open(path) as f:
                out.add(next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list")))
        except (FileNotFoundError, ProcessLookupError):
            if not tid:
                raise
            continue  # a thread that ended between the listing and the read (CI saw one) has no mask left
    return out


RUN = """
import json, logging, os, re, subprocess, sys, urllib.request
import torch
from feedline import StagingLoader
sys.path.insert(0, {tests!r})
from test_placement import masks_of

logging.basicConfig(level=logging.INFO, filename={log!r})  # a script that keeps the start-up log
threads = torch.get_num_threads()
with StagingLoader({shards!r}, batch_size=4, workers={workers!r}, spec={{"cls": "int64"}}, metrics_port=0,
                   cpu_placement={setting!r}, device="standin") as loader:  # a device's loader: auto places it
    it = iter(loader)
    next(it)
    kids = [int(p) for p in subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True,
                                            text=True).stdout.split()]
    with urllib.request.urlopen(f"http://127.0.0.1:{{loader.metrics.port}}/metrics") as r:
        metric = {{m[1]: float(m[2]) for m in re.finditer(r'^feedline_placed_cpus{{[^}}]*side="(\\w+)"[^}}]*}} (\\S+)',
                                                        r.read().decode(), re.M)}}
    during = {{"trainer": sorted(masks_of(os.getpid(), threads=True)), "workers": [sorted(masks_of(k)) for k in kids],
              "placed": loader.placement.placed, "describe": loader.placement.describe(), "count": loader.workers,
              "torch_threads": [threads, torch.get_num_threads()], "metric": metric}}
    if {hold!r}:
        print("HELD " + json.dumps(during), flush=True)
        sys.stdin.readline()
print("RESULT " + json.dumps({{**during, "after": sorted(masks_of(os.getpid(), threads=True)),
                              "torch_threads_after": torch.get_num_threads()}}), flush=True)
"""


def _run(tmp_path, shards, setting="auto", workers="auto", hold=False, log=os.devnull):
    import subprocess
    import sys

    from helpers import ROOT

    code = RUN.format(tests=os.path.dirname(__file__), shards=shards, workers=workers, setting=setting, hold=hold,
                      log=log)
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc, tag="RESULT"):
    import json

    for line in proc.stdout:
        if line.startswith(tag + " "):
            return json.loads(line.split(" ", 1)[1])
    raise AssertionError(proc.stderr.read()[-3000:])


@pytest.mark.serial  # placed loaders of other tests claim the CPUs it would take
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_real_run_pins_the_training_process_and_its_workers_apart_and_gives_the_masks_back(tmp_path):
    from helpers import id_shards

    shards = id_shards(str(tmp_path / "ids"), shards=4, per_shard=16)
    proc = _run(tmp_path, shards, workers=2, log=str(tmp_path / "log"))
    got = _result(proc)
    proc.wait(timeout=60)
    log = (tmp_path / "log").read_text()
    cpus = sorted(os.sched_getaffinity(0))
    assert got["placed"], got["describe"]
    (trainer,) = got["trainer"]  # every thread of the training process on its CPUs
    trainer_cpus = parse_cpus(trainer)
    worker_cpus = {c for w in got["workers"] for mask in w for c in parse_cpus(mask)}
    assert len(got["workers"]) == 2 and not worker_cpus & set(trainer_cpus)  # no worker on a trainer's CPU
    assert set(trainer_cpus) | worker_cpus == set(cpus)
    assert log.count("CPU placement: the training process on") == 1 and got["describe"] in log  # once, at start
    assert got["metric"] == {"trainer": len(trainer_cpus), "workers": len(worker_cpus)}  # feedline_placed_cpus
    assert got["after"] == [format_cpus(cpus)]  # the masks given back when the loader closed
    before, during = got["torch_threads"]  # torch's pool cut to the pinned cores (its threads would take turns)
    assert during == min(len(trainer_cpus), before) and got["torch_threads_after"] == before  # then given back


@pytest.mark.serial
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_second_process_places_itself_on_what_the_first_left_or_nowhere_and_says_so(tmp_path):
    from helpers import id_shards

    shards = id_shards(str(tmp_path / "ids"), shards=4, per_shard=16)
    first = _run(tmp_path, shards, hold=True)
    try:
        held = _result(first, "HELD")
        assert held["placed"]
        second = _run(tmp_path, shards)
        got = _result(second)
        second.wait(timeout=60)
        # 2 CPUs: the one left is not enough to place on (on a larger host it would place itself there)
        assert not got["placed"] and "the training processes' of other processes" in got["describe"], got
        assert got["trainer"] == [format_cpus(sorted(os.sched_getaffinity(0)))]  # left where it was
    finally:
        first.stdin.write("\n")
        first.stdin.flush()
        first.wait(timeout=60)


def test_workers_auto_counts_only_the_cpus_left_to_the_workers():
    from feedline.loader.tune.autotune import choose

    placed = choose("cuda", placed_cpus=12)  # 16 vCPUs, 2 cores (4 vCPUs) kept for the training process
    assert placed.most == 12 and "placed: 12 CPU(s)" in placed.reason and "one left" not in placed.reason
    assert choose("cuda", placed_cpus=12, threads_per_worker=3).most == 4  # workers x decode threads fit


def test_a_loader_whose_batches_stay_on_the_cpu_is_left_where_it_is():
    from feedline.loader.cpus.placement import for_this_process

    p = for_this_process("auto", None, on_device=False)
    assert not p.placed and "the batches stay on the CPU" in p.why_not


@pytest.mark.serial  # CPU claims are the machine's: a loader placed by another test at the same time holds them too
def test_a_cpu_another_process_claimed_is_seen_taken_and_free_again_once_it_ends():
    import subprocess
    import sys

    from feedline.loader.cpus.pinning import claim, taken_elsewhere

    holder = subprocess.Popen([sys.executable, "-c", "import socket, sys; s = socket.socket(socket.AF_UNIX); "
                               "s.bind('\\0feedline-cpu-0'); print('up', flush=True); sys.stdin.readline()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        assert taken_elsewhere((0, 1)) == {0} and claim((0,)) is None
    finally:
        holder.communicate("\n", timeout=10)
    mine = claim((0,))
    assert mine is not None and len(mine) == 1
    mine[0].close()


TWO_LOADERS = """
import json, os, subprocess, sys
import torch
from feedline import StagingLoader
sys.path.insert(0, {tests!r})
from test_placement import masks_of

threads = torch.get_num_threads()
with StagingLoader({shards!r}, batch_size=4, workers=1, spec={{"cls": "int64"}}, device="standin") as train:
    next(iter(train))
    with StagingLoader({shards!r}, batch_size=4, workers=1, spec={{"cls": "int64"}}) as val:  # a CPU one, after
        next(iter(val))
        kids = [int(p) for p in subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True,
                                                text=True).stdout.split()]
        print("RESULT " + json.dumps({{"same": val.placement is train.placement, "trainer": list(train.placement.trainer),
                                       "workers": [sorted(masks_of(k)) for k in kids]}}), flush=True)
"""


@pytest.mark.serial
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_second_loader_in_the_process_shares_the_first_ones_plan_and_keeps_off_its_launching_cores(tmp_path):
    import subprocess
    import sys

    from helpers import ROOT, id_shards

    shards = id_shards(str(tmp_path / "ids"), shards=4, per_shard=16)
    code = TWO_LOADERS.format(tests=os.path.dirname(__file__), shards=shards)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    got = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert got is not None, out.stderr[-3000:]
    import json

    got = json.loads(got.split(" ", 1)[1])
    assert got["same"] and got["trainer"]
    workers = {c for w in got["workers"] for mask in w for c in parse_cpus(mask)}
    assert len(got["workers"]) == 2 and not workers & set(got["trainer"])  # neither loader's on the launching core


def test_a_bad_placement_setting_is_refused_at_start_naming_the_setting_and_its_value_once():
    import subprocess
    import sys

    from helpers import ROOT

    out = subprocess.run([sys.executable, "-m", "feedline", "doctor"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "FEEDLINE_CPU_PLACEMENT": "trainer=0-1"}, timeout=60)
    said = out.stdout + out.stderr
    assert out.returncode == 2 and "FEEDLINE_CPU_PLACEMENT" in said, said
    assert said.count("'trainer=0-1'") == 1 and "name both sides" in said, said


def _doctor_row(args: list[str], name: str = "CPU placement") -> tuple[str, str]:
    """``feedline doctor``'s row ``name``: its status and its detail, the table's wrapped lines joined."""
    import subprocess
    import sys

    from helpers import ROOT

    out = subprocess.run([sys.executable, "-m", "feedline", "doctor", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    lines = [line.split("│")[1:-1] for line in out.stderr.splitlines() if line.startswith("│")]
    start = next((i for i, cells in enumerate(lines) if cells[0].strip() == name), None)
    assert start is not None, f"no {name!r} row (exit {out.returncode}): {out.stderr[-3000:]}"
    end = next((i for i in range(start + 1, len(lines)) if lines[i][0].strip()), len(lines))
    return lines[start][1].strip(), " ".join(cells[2].strip() for cells in lines[start:end])


@pytest.mark.serial  # it claims the CPUs for a moment
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_doctor_prints_the_placement_the_flag_asks_for_and_the_cpus_this_process_may_use():
    first, second = sorted(os.sched_getaffinity(0))[:2]
    status, detail = _doctor_row(["--cpu-placement", f"trainer={first};workers={second}"])
    assert status == "ok"
    assert f"the training process on CPU {first}, the workers on CPU {second}" in detail, detail
    assert f"this process may use {len(os.sched_getaffinity(0))} CPUs" in detail and "a core" in detail, detail


@pytest.mark.serial
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_doctor_shows_what_auto_places_for_a_gpu_and_that_a_cpu_step_is_left_alone():
    status, detail = _doctor_row(["--device", "cuda"])  # no GPU here: the plan a GPU's loader would get
    assert status == "ok" and "the training process on CPU" in detail, detail
    status, detail = _doctor_row(["--device", "cpu"])
    assert status == "skip" and "the batches stay on the CPU" in detail, detail
