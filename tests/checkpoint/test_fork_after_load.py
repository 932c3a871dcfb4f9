"""Forked DataLoader workers of a process that already loaded or saved checkpoints: a worker's own load runs
on new reader threads (the parent's kept pool has no threads in the child: it hung there once), and
workers forked after a save_async serve every epoch. Real files, real fork-started workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import torchplace as tp

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")

# 64 MiB: the load runs on several readers (a small file is read inline, without the kept pool)
STATE = {f"w{i}": torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024) + i for i in range(64)}


class Loads(Dataset):
    """Each item loads the checkpoint in the worker and returns one tensor's sum."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return tp.load(self.path, device="cpu")["model"][f"w{i}"].sum()


def _epochs(dataset: Dataset) -> list[list[torch.Tensor]]:
    loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context="fork",
                        timeout=120)  # only a hang reaches the bound
    return [list(loader) for _ in range(2)]


def test_workers_forked_after_a_load_load_again(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    tp.save(path, model=STATE)
    assert torch.equal(tp.load(path, device="cpu")["model"]["w3"], STATE["w3"])  # the parent's readers start
    sums = [STATE[f"w{i}"].sum() for i in range(4)]
    expected = [torch.stack(sums[:2]), torch.stack(sums[2:])]
    for epoch in _epochs(Loads(path)):
        assert all(torch.equal(a, b) for a, b in zip(epoch, expected, strict=True))


def test_workers_forked_after_a_save_async_serve_two_epochs(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 4)
    tp.save_async(tmp_path / "a.safetensors", model=model, keep_last=2).result()
    path = tmp_path / "m.safetensors"
    tp.save(path, model=STATE)
    epochs = _epochs(Loads(path))
    assert [len(e) for e in epochs] == [2, 2]
