"""The trainers people use: PyTorch Lightning (DDP, 2 CPU processes) and Hugging Face Accelerate, with the loader as
they get it — no set_epoch, no sampler, their own checkpoints."""

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import ROOT, id_shards

# in one xdist worker of the parallel part (the tests beside the soak, the bench's, fill its three minutes
# already: issue 68)
pytestmark = pytest.mark.xdist_group("trainers")

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

# A LightningModule whose train_dataloader() is a StagingLoader; every rank writes what each step trained.
LIGHTNING = textwrap.dedent("""
    import json, os, sys
    import torch
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from feedline import StagingLoader

    class Model(pl.LightningModule):
        def __init__(self, shards, out):
            super().__init__()
            self.shards, self.out = shards, out
            self.net = torch.nn.Linear(64, 4)

        def train_dataloader(self):  # built here: the process group is up, the loader splits by rank
            return StagingLoader(self.shards, batch_size=4, workers=1, seed=3,
                                 spec={"cls": "int64", "bin": ("uint8", (64,))})

        def training_step(self, batch, i):
            with open(os.path.join(self.out, f"steps.rank{self.global_rank}"), "a") as f:
                f.write(json.dumps([self.current_epoch, i, list(batch["__key__"])]) + "\\n")
            return torch.nn.functional.cross_entropy(self.net(batch["bin"].float() / 255), batch["cls"] % 4)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if __name__ == "__main__":
        shards, out, epochs, ckpt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] or None
        every = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{epoch}-{step}", save_top_k=-1,
                                every_n_train_steps=5)
        ends = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="end-{epoch}", save_top_k=-1,
                               save_on_train_epoch_end=True)
        trainer = pl.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=epochs, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[every, ends])
        trainer.fit(Model(shards, out), ckpt_path=ckpt)
""")


@pytest.fixture
def ids(tmp_path):
    """4 shards of 24: 96 samples, 12 batches of 4 per rank and epoch with 2 ranks."""
    id_shards(str(tmp_path / "ids"), shards=4, per_shard=24)
    return str(tmp_path / "ids" / "*.tar")


def lightning(tmp_path, ids, name, epochs, ckpt=""):
    script = tmp_path / "fit.py"
    script.write_text(LIGHTNING)
    out = tmp_path / name
    out.mkdir()
    run = subprocess.run([sys.executable, str(script), ids, str(out), str(epochs), ckpt], cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT, "PL_DISABLE_FORK": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    steps = {}
    for rank in (0, 1):
        for line in open(out / f"steps.rank{rank}"):
            epoch, i, keys = json.loads(line)
            steps[(rank, epoch, i)] = keys
    return out, steps


def test_lightning_ddp_trains_equal_steps_reshuffles_and_resumes_exactly_from_its_own_checkpoints(tmp_path, ids):
    whole, steps = lightning(tmp_path, ids, "whole", epochs=3)
    everything = sorted(f"s{i:07d}" for i in range(96))
    for epoch in range(3):
        per_rank = [[k for (r, e, i), keys in sorted(steps.items()) if r == rank and e == epoch for k in keys]
                    for rank in (0, 1)]
        assert len(per_rank[0]) == len(per_rank[1]) == 48  # equal steps on both ranks
        assert sorted(per_rank[0] + per_rank[1]) == everything  # every sample once per epoch
    firsts = [steps[(0, e, 0)] for e in range(3)]
    assert firsts[0] != firsts[1] != firsts[2]  # a new order every epoch, nobody called set_epoch

    # mid-epoch: Lightning's checkpoint after step 5 holds the loader's state; the resumed fit trains the rest
    mid = os.path.join(whole, "ckpt", "epoch=0-step=5.ckpt")
    _, resumed = lightning(tmp_path, ids, "mid", epochs=3, ckpt=mid)
    assert resumed == {k: v for k, v in steps.items() if (k[1], k[2]) >= (0, 5)}

    # end of an epoch: the next epoch is the one the uninterrupted run read
    end = glob.glob(os.path.join(whole, "ckpt", "end-epoch=1*.ckpt"))[0]
    _, after_end = lightning(tmp_path, ids, "end", epochs=3, ckpt=end)
    assert after_end == {k: v for k, v in steps.items() if k[1] == 2}


# The Accelerate recipe of docs/distributed.md: prepare the model and optimizer, not the loader; save the loader's
# state (JSON) beside accelerator.save_state().
ACCELERATE = textwrap.dedent("""
    import json, os, sys
    import torch
    from accelerate import Accelerator
    from feedline import StagingLoader

    shards, out, stop_after, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    accelerator = Accelerator(cpu=True)  # first: it starts the process group the loader splits by
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader: it splits and places batches itself
    with StagingLoader(shards, batch_size=4, workers=1, seed=3, spec={"cls": "int64", "bin": ("uint8", (64,))},
                       device=accelerator.device) as loader:
        if resume:
            accelerator.load_state(resume)
            loader.load_state_dict(json.load(open(os.path.join(resume, "loader.json"))))
        step = 0
        for epoch in range(loader.next_epoch, 2):
            for batch in loader:
                loss = torch.nn.functional.cross_entropy(model(batch["bin"].float() / 255), batch["cls"] % 4)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                with open(os.path.join(out, f"keys.rank{accelerator.process_index}"), "a") as f:
                    f.write(" ".join(batch["__key__"]) + "\\n")
                step += 1
                if step == stop_after:
                    state = loader.state_dict()  # on every rank: under torch.distributed it gathers every rank's
                    accelerator.save_state(os.path.join(out, "saved"))
                    if accelerator.is_main_process:
                        json.dump(state, open(os.path.join(out, "saved", "loader.json"), "w"))
                    sys.exit(0)
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(out, "final.pt"))
""")


def accelerate(tmp_path, ids, out, stop_after=0, resume=""):
    script = tmp_path / "acc.py"
    script.write_text(ACCELERATE)
    os.makedirs(out, exist_ok=True)
    from test_distributed import _port

    run = subprocess.run([TORCHRUN, "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={_port()}",
                          str(script), ids, str(out), str(stop_after), resume], cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-4000:]
    return [open(os.path.join(out, f"keys.rank{r}")).read().split("\n") for r in (0, 1)]


def test_accelerate_recipe_resumes_to_the_uninterrupted_runs_batches_and_weights(tmp_path, ids):
    whole = accelerate(tmp_path, ids, tmp_path / "whole")
    cut = tmp_path / "cut"
    first = accelerate(tmp_path, ids, cut, stop_after=17)  # in the second epoch
    second = accelerate(tmp_path, ids, cut, resume=str(cut / "saved"))
    assert second == whole  # the files grew on: the first run's lines, then the resumed run's
    assert first != second and len(whole[0]) == len(whole[1]) == 2 * 12 + 1
    a, b = torch.load(tmp_path / "whole" / "final.pt"), torch.load(cut / "final.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
