"""Training checkpoints (``feedline train --checkpoint DIR``): each one written whole or not at all.

A checkpoint is a directory ``step-<n>`` holding the model's and the optimizer's
state (``torch.save``, loaded back with ``weights_only=True``: tensors and plain
containers, nothing else is unpickled), the loader's state (``loader.json``) and
the job's position (``meta.json``). It is written under ``.tmp-step-<n>-<pid>``,
every file fsynced, then renamed: a kill during the save leaves a temporary
directory that no reader takes for a checkpoint, and the next save removes it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from .formats.files import fsync_dir

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
        return Checkpoint(path, step, model, optimizer, loader, meta)

    def save(self, step: int, model: dict[str, Any], optimizer: dict[str, Any], loader: dict[str, Any],
             meta: dict[str, Any]) -> str:
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
            for name, doc in (("loader.json", loader), ("meta.json", {**meta, "step": step})):
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
