"""pytorch/examples imagenet/main.py ported: its resume reads a checkpoint.pth.tar that plain torch.save
wrote before the port (checkpoint['epoch'], ['best_acc1'], ['state_dict'] with DataParallel's 'module.'
keys, ['optimizer'], ['scheduler']), and its save_checkpoint(state, is_best) keeps writing
checkpoint.pth.tar and model_best.pth.tar, which the pre-port code still reads. A tiny model on random
images, on the CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchplace as tp


def make_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 5))


def train_epochs(root: Path, start: int, epochs: int, resume: str | None, ported: bool) -> dict:
    """The shape of imagenet/main.py's main_worker: build, resume, train, validate, save_checkpoint."""
    torch.manual_seed(0)
    model = nn.DataParallel(make_model())  # the original wraps before it resumes
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    best_acc1, start_epoch = 0.0, start
    if resume:
        checkpoint = tp.load(resume, device="cpu") if ported else torch.load(resume, map_location="cpu")
        start_epoch = checkpoint["epoch"]
        best_acc1 = float(checkpoint["best_acc1"])
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    data = TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,)))
    loader = tp.DeviceLoader(DataLoader(data, batch_size=8), "cpu") if ported else DataLoader(data, batch_size=8)
    for epoch in range(start_epoch, start_epoch + epochs):
        for images, target in loader:
            loss = nn.functional.cross_entropy(model(images), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
        acc1 = 10.0 * (epoch + 1)
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        state = {"epoch": epoch + 1, "arch": "tiny", "state_dict": model.state_dict(), "best_acc1": best_acc1,
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        filename = root / "checkpoint.pth.tar"
        if ported:
            tp.save(filename, **state, rng_state=False)  # save_checkpoint(state, is_best), ported
        else:
            torch.save(state, filename)
        if is_best:
            shutil.copyfile(filename, root / "model_best.pth.tar")
    return {"epoch": start_epoch + epochs, "weights": model.module[0].weight.detach().clone()}


def test_the_port_resumes_the_pre_port_file_and_writes_what_the_old_code_reads(tmp_path: Path) -> None:
    train_epochs(tmp_path, 0, 1, None, ported=False)  # before the port: plain torch.save
    ported = train_epochs(tmp_path, 0, 1, str(tmp_path / "checkpoint.pth.tar"), ported=True)
    assert ported["epoch"] == 2
    old = torch.load(tmp_path / "checkpoint.pth.tar")  # the pre-port reader, on the port's file
    assert old["epoch"] == 2 and old["arch"] == "tiny" and list(old["state_dict"])[0] == "module.0.weight"
    assert torch.equal(old["state_dict"]["module.0.weight"], ported["weights"])
    plain = train_epochs(tmp_path, 0, 1, str(tmp_path / "model_best.pth.tar"), ported=False)
    assert plain["epoch"] == 3  # and the pre-port program resumes the port's best model
