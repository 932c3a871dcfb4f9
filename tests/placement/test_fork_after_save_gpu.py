"""A training loop as users write it: checkpoints on the GPU at each epoch's end, then the next epoch's
DataLoader workers forked from a process whose CUDA context is up (issue 28: they aborted with
`CUDA error: initialization error` from ~TensorImpl once a save_async had run)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import torchplace as tp

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]
EPOCHS = 5


class Pairs(Dataset):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> dict:
        x = torch.full((32,), float(i % 7)) / 7
        return {"x": x, "y": torch.tensor(i % 3), "tags": [torch.tensor([i]), torch.tensor([i, i])]}


@pytest.mark.parametrize("pin_memory", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_five_epochs_of_workers_after_save_and_save_async_each_epoch(tmp_path: Path, packed: bool,
                                                                     pin_memory: bool) -> None:
    dev = torch.device("cuda:0")
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Pairs(), batch_size=8, shuffle=True, num_workers=2, multiprocessing_context="fork",
                        pin_memory=pin_memory, collate_fn=tp.packed_collate() if packed else None)
    batches = 0
    for epoch in range(EPOCHS):
        for batch in tp.DeviceLoader(loader, dev):
            assert batch["x"].device == dev and batch["tags"][1].device == dev
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            batches += 1
        tp.save(tmp_path / f"sync-{epoch}.safetensors", model=model, optimizer=opt, extra={"epoch": epoch})
        tp.save_async(tmp_path / f"async-{epoch}.safetensors", model=model, optimizer=opt,
                      extra={"epoch": epoch}).result()
    assert batches == EPOCHS * len(loader)
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    tp.load(tmp_path / f"async-{EPOCHS - 1}.safetensors", model=fresh)
    for mine, saved in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(mine.cpu(), saved)


def test_a_forked_child_never_frees_the_cuda_tensors_in_garbage_it_inherited() -> None:
    """Cyclic garbage holding a CUDA tensor at the fork: the child's collector leaves it alone."""
    dev = torch.device("cuda:0")
    gc.collect()
    gc.disable()  # the garbage must still be there at the fork
    try:
        cycle: list = [torch.ones(1024, device=dev)]
        cycle.append(cycle)
        del cycle
        pid = os.fork()
        if pid == 0:  # the child: collect what it inherited, as a worker's allocations would make it do
            try:
                gc.enable()
                gc.collect()
            finally:
                os._exit(0)  # a forked test child leaves without running the parent's exit handlers
    finally:
        gc.enable()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child died freeing an inherited CUDA tensor"
    gc.collect()
