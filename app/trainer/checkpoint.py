"""Training checkpoints (``feedline train --checkpoint DIR``): each one written whole or not at all.

A checkpoint is a directory ``step-<n>`` holding the model's and the optimizer's
state (``torch.save``, loaded back with ``weights_only=True``: tensors and plain
containers, nothing else is unpickled), the loader's state (``loader.json``), every
rank's random generators (``random.json``: torch's CPU and CUDA ones, numpy's,
Python's — dropout and the like draw from them, so a resumed run draws what the
uninterrupted one would have) and the job's position (``meta.json``). It is written under ``.tmp-step-<n>-<pid>``,
every file fsynced, then renamed: a kill during the save leaves a temporary
directory that no reader takes for a checkpoint, and the next save removes it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..formats.files import fsync_dir

log = logging.getLogger("feedline.train")

_NAME = re.compile(r"^step-(\d{9})$")
KEEP = 2  # complete checkpoints kept; older ones are removed after a save


@dataclass
class Checkpoint:
    """What a checkpoint restores."""

    path: str
    step: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    loader: dict[str, Any]
    meta: dict[str, Any]
    randoms: list[dict[str, Any]] | None = None  # per rank; None in one saved before they were kept


class CheckpointDir:
    """The checkpoints of one job in one directory: save the next, find and load the newest complete one."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    def complete(self) -> list[tuple[int, str]]:
        """(step, path) of every complete checkpoint, oldest first."""
        out = []
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m and os.path.isfile(os.path.join(self.directory, name, "meta.json")):
                out.append((int(m.group(1)), os.path.join(self.directory, name)))
        return sorted(out)

    def latest(self) -> Checkpoint | None:
        found = self.complete()
        if not found:
            return None
        step, path = found[-1]
        with open(os.path.join(path, "loader.json")) as f:
            loader = json.load(f)
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        model = torch.load(os.path.join(path, "model.pt"), map_location="cpu", weights_only=True)
        optimizer = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
        randoms = None
        if os.path.exists(os.path.join(path, "random.json")):
            with open(os.path.join(path, "random.json")) as f:
                randoms = json.load(f)["ranks"]
        return Checkpoint(path, step, model, optimizer, loader, meta, randoms)

    def save(self, step: int, model: dict[str, Any], optimizer: dict[str, Any], loader: dict[str, Any],
             meta: dict[str, Any], randoms: list[dict[str, Any]] | None = None) -> str:
        """Write checkpoint ``step`` atomically; remove leftovers of killed saves and all but the newest KEEP."""
        for name in os.listdir(self.directory):
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        final = os.path.join(self.directory, f"step-{step:09d}")
        tmp = os.path.join(self.directory, f".tmp-step-{step:09d}-{os.getpid()}")
        os.makedirs(tmp)
        try:
            torch.save(model, os.path.join(tmp, "model.pt"))
            torch.save(optimizer, os.path.join(tmp, "optimizer.pt"))
            docs = [("loader.json", loader), ("meta.json", {**meta, "step": step})]
            if randoms is not None:
                docs.append(("random.json", {"ranks": randoms}))
            for name, doc in docs:
                with open(os.path.join(tmp, name), "w") as f:
                    json.dump(doc, f)
            for name in os.listdir(tmp):
                with open(os.path.join(tmp, name), "rb") as f:
                    os.fsync(f.fileno())
            fsync_dir(tmp)
            if os.path.exists(final):  # the same step again (a resume saved at once): replace it whole
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for _, old in self.complete()[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s saved", final)
        return final


def random_states() -> dict[str, Any]:
    """This process's random generators as plain JSON data: torch's CPU and (initialised) CUDA ones, numpy's
    global one and Python's ``random``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"torch": torch.get_rng_state().tolist(),
            "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if cuda else [],
            "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
            "random": [version, list(internal), gauss_next]}


def restore_random_states(saved: list[dict[str, Any]] | None, rank: int, world: int) -> None:
    """Put this rank's generators back as they were at the save."""
    if saved is None:
        log.warning("the checkpoint holds no random generator states (saved by an older feedline): dropout and "
                    "other draws of the resumed run differ from an uninterrupted run's")
        return
    if len(saved) != world:
        log.info("the checkpoint has %d rank(s), this job %d: each rank takes rank %d's random states", len(saved),
                 world, rank % len(saved))
    state = saved[rank % len(saved)]
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
        else:
            log.warning("the checkpoint has the CUDA generators of %d GPU(s), this host %d: they start afresh",
                        len(state["cuda"]), torch.cuda.device_count())
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["random"]
    random.setstate((version, tuple(internal), gauss_next))
