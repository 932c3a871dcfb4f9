"""imagenet/main.py's mp.spawn DDP path ported (programs/imagenet_spawn.py): the program's own gloo group,
sampler.set_epoch on the torchplace loader, a rank-0 save every rank reads after a barrier, the copy to
model_best.pth.tar, and --resume on both ranks of a file whose model weights sit under 'state_dict'."""

from __future__ import annotations

from pathlib import Path

import torch

from realworld.launch import run_program


def test_spawned_ranks_save_on_rank0_and_resume_from_state_dict(tmp_path: Path) -> None:
    from ports import free_port

    first = run_program("imagenet_spawn.py", str(free_port()), "2", cwd=tmp_path)
    assert "rank 0 done at epoch 2" in first.stdout and "rank 1 done at epoch 2" in first.stdout
    assert "adopted" in first.stderr  # setup() took the program's own group
    saved = torch.load(tmp_path / "model_best.pth.tar")  # the pre-port reader
    assert saved["epoch"] == 2 and next(iter(saved["state_dict"])).startswith("module.")
    again = run_program("imagenet_spawn.py", str(free_port()), "3", "checkpoint.pth.tar", cwd=tmp_path)
    for rank in (0, 1):
        assert f"rank {rank} resumed at epoch 2" in again.stdout and f"rank {rank} done at epoch 3" in again.stdout
