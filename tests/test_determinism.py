"""Augmentations follow the sample, not the history: the same batch has the same pixels however it was reached."""

import hashlib
import os
import random
import signal

import numpy as np
import pytest
import torch
from helpers import jpeg_bytes, write_tar

from feedline import DeviceDecode, StagingLoader
from feedline.formats.transforms import Compose, RandomResizedCrop

# in one xdist worker: its reference runs (module fixtures) run once
pytestmark = pytest.mark.xdist_group("determinism")

SPEC = {"jpg": ("uint8", (16, 16, 3)), "cls": "int64", "noise": ("float64", (3,))}


class Jitter:
    """Draws from all three generators a transform may use: Python's, numpy's and torch's."""

    def __call__(self, sample):
        sample["noise"] = np.array([random.random(), np.random.random(), float(torch.rand(()))])
        return sample


def augment():
    return Compose(RandomResizedCrop(16, fields=["jpg"]), Jitter())


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """4 shards of 24 JPEGs: 96 samples, 24 batches of 4 an epoch."""
    d = tmp_path_factory.mktemp("images")
    for s in range(4):
        write_tar(str(d / f"img-{s}.tar"),
                  [(f"k{s}{i:02d}", {"jpg": jpeg_bytes(s * 24 + i, (40, 32)), "cls": str(i).encode()})
                   for i in range(24)])
    return str(d / "img-*.tar")


POINTS = {(0, 9), (0, 23), (1, 14)}  # (epoch, batch) after which the reference run's state is taken


@pytest.fixture(scope="module")
def reference(images):
    """The uninterrupted run, 2 epochs: every batch's digest, each epoch's samples, states taken at POINTS."""
    states, batches, samples = {}, [], []
    with loader(images) as whole:
        for epoch in range(2):
            samples.append({})
            for i, batch in enumerate(whole):
                if (epoch, i) in POINTS:
                    states[(epoch, i)] = whole.state_dict()
                batches.append(digest(batch))
                samples[epoch].update(per_sample(batch))
    return batches, samples, states


def loader(images, **kw):
    kw = {"batch_size": 4, "workers": 2, "seed": 5, "spec": SPEC, "transform": augment(), **kw}
    return StagingLoader(images, **kw)


def digest(batch):
    """What the loop saw of a batch: its keys and a hash of every pixel and draw."""
    h = hashlib.sha256()
    for name in sorted(k for k in batch if not k.startswith("__")):
        h.update(batch[name].contiguous().numpy().tobytes())
    return tuple(batch["__key__"]), h.hexdigest()


def per_sample(batch):
    """Each sample's pixels and draws, by key (an elastic resume changes the batches, not the samples)."""
    return {key: (batch["jpg"][i].numpy().tobytes(), batch["noise"][i].numpy().tobytes())
            for i, key in enumerate(batch["__key__"])}


def test_a_loader_resumed_at_any_batch_yields_the_uninterrupted_runs_pixels(images, reference):
    batches, _, states = reference
    for (epoch, i), state in sorted(states.items()):
        with loader(images) as resumed:
            resumed.load_state_dict(state)
            got = [digest(b) for _ in range(resumed.next_epoch, 2) for b in resumed]
        assert got == batches[epoch * 24 + i + 1:], f"resumed after epoch {epoch}, batch {i}"


def test_the_next_epoch_draws_other_augmentations(reference):
    _, epochs, _ = reference
    assert epochs[0].keys() == epochs[1].keys()
    assert all(epochs[0][k][1] != epochs[1][k][1] for k in epochs[0])


def test_a_worker_killed_mid_epoch_is_replaced_without_changing_a_pixel(images, reference):
    with loader(images) as hit:
        got = []
        for i, batch in enumerate(hit):
            got.append(digest(batch))
            if i == 5:
                os.kill(hit._pipeline.pool.worker_pids()[1], signal.SIGKILL)
        assert hit.stats().worker_restarts_total == 1
    assert got == reference[0][:24]


def test_a_stalled_worker_is_replaced_without_changing_a_pixel(images, reference):
    with loader(images, worker_timeout=1.0) as stalled:
        got = []
        for i, batch in enumerate(stalled):
            got.append(digest(batch))
            if i == 5:
                os.kill(stalled._pipeline.pool.worker_pids()[0], signal.SIGSTOP)
        restarts = stalled.stats().worker_restarts
        assert restarts["crashed"] == 0 and restarts["stalled"] >= 1  # (a loaded machine may stall another too)
    assert got == reference[0][:24]


def test_an_elastic_resume_gives_every_remaining_sample_its_uninterrupted_pixels(images, reference):
    _, samples, states = reference
    with loader(images, workers=1) as fewer:  # another split: other batches, the same samples
        fewer.load_state_dict(states[(0, 9)], elastic=True)
        rest = {k: v for b in fewer for k, v in per_sample(b).items()}
    assert len(rest) == 96 - 10 * 4
    assert all(rest[k] == samples[0][k] for k in rest)


def test_device_decode_crops_follow_the_sample_into_another_split(images):
    kw = {"transform": None, "spec": None, "fields": ["jpg", "cls"], "device_decode": DeviceDecode(("jpg",), 16)}

    def crops(batches):
        return {k: b["jpg"][i].numpy().tobytes() for b in batches for i, k in enumerate(b["__key__"])}

    with loader(images, **kw) as whole:
        reference = crops(whole)
    with loader(images, **kw) as first:
        it = iter(first)
        seen = crops(next(it) for _ in range(6))
        state = first.state_dict()
    with loader(images, workers=1, **kw) as fewer:  # the rest of the epoch in other batches
        fewer.load_state_dict(state, elastic=True)
        rest = crops(fewer)
    assert len(rest) + len(seen) == 96
    assert all(rest[k] == reference[k] for k in rest) and all(seen[k] == reference[k] for k in seen)


class RandomOnlyJitter(Jitter):
    """Jitter's draws, from a class that says it draws from ``random`` only: a worker seeds nothing else for it
    (here it draws from the others all the same, to show they were left alone)."""

    generators = ("random",)


def _seeded(key, shard, draw):
    """What ``draw`` gives after the generators are seeded from this sample of the first epoch (seed 5)."""
    from feedline.loader.plan.seeding import reseed, sample_seed

    reseed(sample_seed(5, 0, shard, key))
    return draw()


def test_a_transform_that_declares_its_generators_gets_only_those_seeded_for_each_sample(images, reference):
    _, samples, _ = reference  # Jitter declares nothing: all three seeded from each sample
    shard = {f"k{s}": images.replace("*", str(s)) for s in range(4)}
    with loader(images, transform=Compose(RandomResizedCrop(16, fields=["jpg"]), RandomOnlyJitter())) as declared:
        got = {k: v for b in declared for k, v in per_sample(b).items()}
    assert got.keys() == samples[0].keys()
    left_alone = 0
    for key, (pixels, noise) in got.items():
        full = np.frombuffer(samples[0][key][1])
        mine = np.frombuffer(noise)
        assert full[1] == _seeded(key, shard[key[:2]], np.random.random)  # the undeclared run: numpy seeded
        assert pixels == samples[0][key][0] and mine[0] == full[0]  # random: seeded as before, the same crops
        left_alone += mine[1] != full[1] and mine[2] != full[2]
    assert left_alone == len(got)  # numpy and torch: each sample's draw goes on from the last, unseeded


def test_a_transform_class_that_declares_a_generator_no_worker_seeds_is_refused_at_start(images):
    class Cupy(Jitter):
        generators = ("random", "cupy")

    with pytest.raises(ValueError, match=r"Cupy.generators names \['cupy'\].*\['numpy', 'random', 'torch'\]"):
        loader(images, transform=Cupy())


def test_a_subclass_that_declares_nothing_gets_every_generator_seeded():
    from feedline.formats.transforms import GENERATORS, generators_of

    class Mine(RandomResizedCrop):  # may draw from numpy in a __call__ of its own
        pass

    assert generators_of(RandomResizedCrop(8)) == {"random"} and generators_of(Mine(8)) == GENERATORS
    assert generators_of(Compose(RandomResizedCrop(8))) == {"random"}
    assert generators_of(Compose(RandomResizedCrop(8), Jitter())) == GENERATORS and generators_of(None) == set()
