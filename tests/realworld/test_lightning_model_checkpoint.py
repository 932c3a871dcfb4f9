"""Lightning's Trainer with ModelCheckpoint (Lightning-AI/pytorch-lightning,
src/lightning/pytorch/callbacks/model_checkpoint.py: `epoch=N-step=M.ckpt` per epoch and `last.ckpt`), its
files resumed into the plain module by torchplace.load, as the interop guide says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchplace as tp

L = pytest.importorskip("lightning")


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = net()

    def training_step(self, batch, _):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.Adam(self.parameters(), 1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


def test_model_checkpoint_files_load_into_the_plain_module_and_the_folder_names_one(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=-1)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", callbacks=[saver], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    module = Classifier()
    trainer.fit(module, data)
    assert {"epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"} <= set(os.listdir(tmp_path))
    plain = net()
    opt = torch.optim.Adam(plain.parameters(), 1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    ck = tp.load(tmp_path / "last.ckpt", device="cpu", model=plain, optimizer=opt, scheduler=sched)
    assert ck.tool.startswith("lightning") and ck.extra["global_step"] == 8 and sched.last_epoch == 2
    assert torch.equal(plain[0].weight, module.net[0].weight)
    ck = tp.load(tmp_path / "epoch=0-step=4.ckpt", device="cpu", model=net())
    assert ck.extra["epoch"] == 0
    with pytest.raises(tp.CheckpointError, match=r"(?s)holds no complete torchplace checkpoint.*load it by its name"):
        tp.load(tmp_path, model=plain)
