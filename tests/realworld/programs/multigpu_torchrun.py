"""The DDP tutorial's multigpu_torchrun.py, ported to torchplace with its idioms kept.

The original: pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py. Kept: a Trainer
that loads `snapshot.pt` if it exists, saves it from rank 0 alone every `save_every` epochs, calls
`self.train_data.sampler.set_epoch(epoch)` on its (wrapped) loader, and torchrun restarting the job after
a worker dies. Here rank 1 SIGKILLs itself in epoch KILL_AT of the first attempt.

Usage: multigpu_torchrun.py TOTAL_EPOCHS SAVE_EVERY KILL_AT
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import torchplace as tp


class Trainer:
    def __init__(self, rt: tp.Runtime, model: torch.nn.Module, train_data: tp.DeviceLoader,
                 optimizer: torch.optim.Optimizer, save_every: int, snapshot_path: str) -> None:
        self.rt = rt
        self.model = model.to(rt.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print(f"[rank {rt.rank}] Loading snapshot", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = self.rt.load(snapshot_path)  # was torch.load: the same keys, read safely
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.rt.rank}] Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _run_epoch(self, epoch: int) -> None:
        self.train_data.sampler.set_epoch(epoch)  # through the DeviceLoader, as on the DataLoader
        if epoch == KILL_AT and self.rt.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        for source, targets in self.train_data:  # already on rt.device
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(source), targets)
            loss.backward()
            self.optimizer.step()

    def _save_snapshot(self, epoch: int) -> None:
        tp.save(self.snapshot_path, MODEL_STATE=self.model.module.state_dict(), EPOCHS_RUN=epoch)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rt.rank == 0 and epoch % self.save_every == 0:  # rank 0 alone, as in the original
                self._save_snapshot(epoch)


total_epochs, save_every, KILL_AT = (int(a) for a in sys.argv[1:4])
rt = tp.setup()
torch.manual_seed(0)
dataset = TensorDataset(torch.randn(64, 20), torch.randn(64, 1))
loader = rt.loader(DataLoader(dataset, batch_size=8, shuffle=False, sampler=DistributedSampler(dataset)))
model = torch.nn.Linear(20, 1)
trainer = Trainer(rt, model, loader, torch.optim.SGD(model.parameters(), lr=1e-3), save_every, "snapshot.pt")
trainer.train(total_epochs)
print(f"[rank {rt.rank}] finished {total_epochs} epochs, {len(loader.dataset)} samples", flush=True)
rt.close()
