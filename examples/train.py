"""Your training under the appliance: the shape of a script that feedline feeds.

    feedline run -- python examples/train.py                               # one process
    feedline run -- torchrun --nproc-per-node 8 examples/train.py          # DDP, a process per GPU

The loader is set up from the same FEEDLINE_* settings the compose file and the Kubernetes
manifests pass (FEEDLINE_CACHE: the sidecar's cache; batch size, workers, device, metrics port);
the script brings what only it knows: the fields it wants, their transform, the model. Under
torchrun every rank reads its own part of the cache, DDP averages the gradients, and all ranks
stop at the same step. With --checkpoint DIR (FEEDLINE_CHECKPOINT) it saves the model, the
optimizer and every rank's loader state every --checkpoint-every steps, on SIGTERM (Kubernetes'
eviction, `docker stop`) and at the end, and starts from the newest checkpoint there: a
restarted job goes on mid-epoch with the samples it had not trained on, on any number of ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

from feedline import StagingLoader
from feedline.formats.transforms import RandomResizedCrop

log = logging.getLogger("train")


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=int(os.environ.get("FEEDLINE_EPOCHS", 2)))
    p.add_argument("--image-size", type=int, default=int(os.environ.get("FEEDLINE_IMAGE_SIZE", 64)))
    p.add_argument("--classes", type=int, default=int(os.environ.get("FEEDLINE_CLASSES", 10)))
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint", default=os.environ.get("FEEDLINE_CHECKPOINT", ""),
                   help="a directory on a volume that outlives the container (empty: no checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=int(os.environ.get("FEEDLINE_CHECKPOINT_EVERY", 0)))
    return p.parse_args()


def model_for(classes: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


class Checkpoints:
    """step-<n>: rank 0's model.pt and optimizer.pt, every rank's loader-<rank>.json; `latest` commits it."""

    def __init__(self, directory: str, rank: int, world: int):
        self.dir, self.rank, self.world = directory, rank, world

    def _write(self, path: str, write) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # whole or not at all

    def _text(self, path: str, text: str) -> None:
        def write(p: str) -> None:
            with open(p, "w") as f:
                f.write(text)
        self._write(path, write)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, loader: StagingLoader) -> None:
        where = os.path.join(self.dir, f"step-{step:09d}")
        os.makedirs(where, exist_ok=True)
        state = json.dumps(loader.state_dict())  # plain JSON, never pickled
        self._text(os.path.join(where, f"loader-{self.rank}.json"), state)
        if self.world > 1:
            dist.barrier()  # every rank's loader state is on disk before the checkpoint is committed
        if self.rank == 0:
            self._write(os.path.join(where, "model.pt"), lambda p: torch.save(model.state_dict(), p))
            self._write(os.path.join(where, "optimizer.pt"), lambda p: torch.save(optimizer.state_dict(), p))
            self._text(os.path.join(self.dir, "latest"), f"{step} {self.world}\n")
        if self.world > 1:
            dist.barrier()

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: StagingLoader) -> int:
        """The step to go on from (0: none saved yet)."""
        try:
            with open(os.path.join(self.dir, "latest")) as f:
                step, world = map(int, f.read().split())
        except FileNotFoundError:
            return 0
        where = os.path.join(self.dir, f"step-{step:09d}")
        model.load_state_dict(torch.load(os.path.join(where, "model.pt"), map_location="cpu", weights_only=True))
        optimizer.load_state_dict(torch.load(os.path.join(where, "optimizer.pt"), weights_only=True))
        states = [json.loads(open(os.path.join(where, f"loader-{r}.json")).read()) for r in range(world)]
        if world == self.world:
            loader.load_state_dict(states[self.rank])
        else:  # another number of ranks: every old rank's state; each sample of the epoch still once
            loader.load_state_dict(states, elastic=True)
        log.info("resumed from %s (saved by %d rank(s))", where, world)
        return step


def main() -> None:
    args = arguments()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    distributed = "RANK" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))  # finish the step, save, exit 0

    try:
        train(args, distributed, rank, world, stopping)
    finally:
        if distributed:
            dist.destroy_process_group()


def train(args: argparse.Namespace, distributed: bool, rank: int, world: int, stopping: list[bool]) -> None:
    size = args.image_size
    with StagingLoader.from_env(spec={"jpg": ("uint8", (size, size, 3)), "cls": "int64"},
                                transform=RandomResizedCrop(size, fields=["jpg"])) as loader:
        device = loader.device
        model = model_for(args.classes).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        checkpoints = Checkpoints(args.checkpoint, rank, world) if args.checkpoint else None
        step = checkpoints.load(model, optimizer, loader) if checkpoints else 0
        ids = [device.index] if device.type == "cuda" else None
        net = nn.parallel.DistributedDataParallel(model, device_ids=ids) if distributed else model
        for epoch in range(loader.next_epoch, args.epochs):
            loader.set_epoch(epoch)
            seen, loss = 0, torch.zeros(())
            for batch in loader:
                images = batch["jpg"].permute(0, 3, 1, 2).float().div_(255)  # NHWC uint8 -> NCHW float
                loss = nn.functional.cross_entropy(net(images), batch["cls"] % args.classes)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                seen += len(batch["cls"])
                stop = bool(stopping)
                if distributed:  # one rank told to stop: all stop at this step
                    flag = torch.tensor([int(stop)], device=device if device.type == "cuda" else "cpu")
                    dist.all_reduce(flag)
                    stop = bool(flag.item())
                if checkpoints and (stop or (args.checkpoint_every and step % args.checkpoint_every == 0)):
                    checkpoints.save(step, model, optimizer, loader)
                if stop:
                    log.info("rank %d: stopped at step %d on SIGTERM%s", rank, step, "; saved" if checkpoints else "")
                    return
            log.info("rank %d: epoch %d: %d samples, loss %.3f, step %d", rank, epoch, seen, loss.item(), step)
        if checkpoints:
            checkpoints.save(step, model, optimizer, loader)


if __name__ == "__main__":
    main()
