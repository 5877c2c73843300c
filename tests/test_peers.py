"""The benchmark's peer loaders (Mosaic Streaming, LitData, tf.data, Hugging Face datasets): their formats hold every
sample of the tar shards, their loaders deliver them with the bench's per-sample work, and their venv leaves .venv
alone (issues 35 and 36)."""

import argparse
import os
import subprocess
import sys

import pytest

from helpers import jpeg_bytes, write_tar

# one xdist worker runs them all: the module's fixture runs the peers once (two workers each running Mosaic at once
# raced for its shared memory's fixed names: "File exists: '/000000_epoch_shape'")
pytestmark = pytest.mark.xdist_group("peers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_PY = os.path.join(ROOT, ".venv-peers", "bin", "python")

EVERY = ["mosaic", "litdata", "tfdata", "hf"]


@pytest.fixture(scope="module")
def peers_run(tmp_path_factory):
    """Each peer's format written as the bench writes them (all, in one process), then each peer run as a bench
    contender from .venv-peers, reporting its first epoch: every label, the samples' shapes, its versions."""
    from concurrent.futures import ThreadPoolExecutor

    from feedline.bench import contend

    d = tmp_path_factory.mktemp("peers")
    for k in range(2):
        write_tar(str(d / f"p-{k}.tar"), [(f"k{k}{i:03d}", {"jpg": jpeg_bytes(k * 100 + i, (48, 40)),
                                                            "cls": str(k * 100 + i).encode()}) for i in range(20)])
    contend._peer_formats(str(d), "jpeg", PEERS_PY)
    args = argparse.Namespace(workers=1, batch_size=8, seconds=0.5, sample_size="1MiB")
    with ThreadPoolExecutor(2) as pool:  # side by side: each is mostly its imports
        got = list(pool.map(lambda peer: contend._peer_contender(peer, "jpeg", str(d), args, PEERS_PY, None,
                                                                "--image-size", "32", "--report-epoch"), EVERY))
    return {"root": d, **dict(zip(EVERY, got))}


def _minor(version):
    return tuple(int(x) for x in version.split(".")[:2])


LABELS = sorted(k * 100 + i for k in range(2) for i in range(20))


@pytest.mark.parametrize("peer", EVERY)
def test_a_peer_loader_delivers_every_sample_of_the_tar_shards_once_at_the_crop_size(peers_run, peer):
    got = peers_run[peer]["first_epoch"]
    assert (peers_run["root"] / peer / "complete").exists()  # the format's write finished
    assert got["complete"] and got["labels"] == LABELS
    assert got["shapes"] == [[32, 32, 3, "torch.uint8"]]


@pytest.mark.parametrize("peer, pattern", [("tfdata", "*.tfrecord"), ("hf", "*.parquet")])
def test_feedline_reads_every_sample_of_the_files_tensorflow_and_hugging_face_wrote_for_the_bench(peers_run, peer,
                                                                                                     pattern):
    from feedline import StagingLoader
    from feedline.formats.transforms import RandomResizedCrop

    files = str(peers_run["root"] / peer / pattern)
    with StagingLoader(files, batch_size=8, workers=1, spec={"jpg": ("uint8", (32, 32, 3)), "cls": "int64"},
                       transform=RandomResizedCrop(32, fields=["jpg"])) as loader:
        assert sorted(i for b in loader for i in b["cls"].tolist()) == LABELS


def test_the_peers_venv_keeps_its_own_pins_and_leaves_the_projects_alone(peers_run):
    import numpy
    import PIL
    import torch

    for peer, want in (("mosaic", "0.13.0"), ("litdata", "0.2.76"), ("tfdata", "2.21.0"), ("hf", "5.0.1")):
        got = peers_run[peer]
        assert got["versions"][peer] == want and got["pil"] == PIL.__version__
        assert _minor(got["versions"]["numpy"]) < (2, 2) and got["versions"]["torch"] == torch.__version__
    assert _minor(numpy.__version__) >= (2, 2) and PIL.__version__.endswith(".post0")  # .venv: untouched
    site = os.path.join(os.path.dirname(sys.executable), "..", "lib", "python3.11", "site-packages")
    assert not os.path.exists(os.path.join(site, "streaming")) and not os.path.exists(os.path.join(site, "litdata"))


def test_each_peer_runs_as_a_bench_contender_from_its_own_venv(peers_run):
    assert [peers_run[peer]["loader"] for peer in EVERY] == EVERY
    assert all(peers_run[peer]["samples_per_s"] > 0 for peer in EVERY)


def test_the_peer_targets_are_feedlines_ratios_to_each_peer_row():
    from feedline.bench.report import targets

    def row(rate):
        return {"samples_per_s": rate, "mb_per_s": rate, "main_cpu_pct": 1.0}

    jpeg = {"feedline (zero-copy)": row(300), "DataLoader + stock Pillow": row(100),
            "DataLoader + pillow-simd": row(150), "1 core, draft": row(150),
            "Mosaic Streaming + DataLoader": row(200), "LitData StreamingDataLoader": row(200)}
    got = {t["target"]: t for t in targets({"workloads": {"jpeg": jpeg}}, 2)}
    assert got["JPEG: >= 1.8x Mosaic Streaming + DataLoader samples/s"]["met"] is False  # 1.5x
    assert got["JPEG: >= 1.4x LitData StreamingDataLoader samples/s"]["met"] is True
    assert got["JPEG: >= 1.4x LitData StreamingDataLoader samples/s"]["value"] == "1.50x"


def test_bench_refuses_peers_on_without_their_venv(tmp_path):
    run = subprocess.run([sys.executable, "-c", "import sys, argparse; from feedline.bench import contend; "
                                                "contend.PEERS_VENV = sys.argv[1]; "
                                                "contend._peers_python(argparse.Namespace(peers='on'))", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "run ./scripts/setup-peers" in run.stderr


def test_the_bench_removes_the_shared_memory_a_contenders_dead_workers_left():
    from feedline.bench import shm

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    orphan, alive = f"/dev/shm/torch_{dead}_1_1", f"/dev/shm/torch_{os.getpid()}_1_1"
    before = shm.torch_shm()
    try:
        for path in (orphan, alive):
            open(path, "wb").close()
        shm.remove_orphaned_torch_shm(before, "litdata")
        assert not os.path.exists(orphan) and os.path.exists(alive)  # a live process's stays: it may be in use
    finally:
        for path in (orphan, alive):
            if os.path.exists(path):
                os.unlink(path)
