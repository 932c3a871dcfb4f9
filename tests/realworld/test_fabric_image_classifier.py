"""Lightning Fabric's image classifier (Lightning-AI/pytorch-lightning,
examples/fabric/image_classifier/train_fabric.py) ported piece by piece: Fabric keeps the loop, the
process and its own setup; torchplace moves the batches (DeviceLoader over Fabric's loader, its sampler
reachable), and its checkpoint, saved under Fabric's .ckpt name, is read back by fabric.load. Random
28x28 images, a tiny CNN, on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchplace as tp


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch) -> None:
    """Importing lightning sets PYTORCH_NVML_BASED_CUDA_CHECK; put it back after the test."""
    for name in ("PYTORCH_NVML_BASED_CUDA_CHECK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything's too
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def make_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 13 * 13, 10))


def test_fabric_loop_with_torchplace_batches_and_checkpoint(tmp_path: Path) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(42)
    data = TensorDataset(torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)))
    train_loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True), move_to_device=False)
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.Adadelta(net.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    loader = tp.DeviceLoader(train_loader, fabric.device)
    assert len(loader.dataset) == 32 and loader.batch_size == 8  # the loader's attributes, through the wrapper
    for _ in range(2):
        model.train()
        for data_, target in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(data_), target)
            fabric.backward(loss)
            optimizer.step()
        scheduler.step()
    path = tp.save(tmp_path / "mnist_cnn.ckpt", model=model, optimizer=optimizer, scheduler=scheduler, epoch=2)
    fresh = fabric.setup(make_net())
    fresh_opt = fabric.setup_optimizers(torch.optim.Adadelta(fresh.parameters(), lr=1.0))
    rest = fabric.load(path, {"model": fresh, "optimizer": fresh_opt})  # Fabric's own reader
    assert rest["epoch"] == 2
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    again = make_net()
    ck = tp.load(path, model=again)  # and torchplace's
    assert ck["epoch"] == 2 and torch.equal(again[0].weight, model.module[0].weight)
