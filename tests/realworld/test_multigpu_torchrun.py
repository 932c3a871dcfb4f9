"""The DDP tutorial's multigpu_torchrun.py (pytorch/examples, distributed/ddp-tutorial-series/
multigpu_torchrun.py) ported: rank-0 snapshots, sampler.set_epoch on the wrapped loader, and torchrun's
restart after a worker is SIGKILLed, resuming from the snapshot."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from realworld.launch import run_program


def test_rank0_snapshots_survive_a_sigkill_and_the_restart_resumes(tmp_path: Path) -> None:
    out = run_program("multigpu_torchrun.py", "6", "1", "3", cwd=tmp_path, nproc=2, max_restarts=1)
    text = out.stdout + out.stderr
    resumed = [int(n) for n in re.findall(r"\[rank 0\] Resuming training from snapshot at Epoch (\d+)", text)]
    assert resumed and 1 <= resumed[0] <= 3, text[-3000:]  # the restart continued from a rank-0 snapshot
    assert "[rank 0] finished 6 epochs, 64 samples" in text and "[rank 1] finished 6 epochs, 64 samples" in text
    snapshot = torch.load(tmp_path / "snapshot.pt")  # the original's reader
    assert snapshot["EPOCHS_RUN"] == 5 and set(snapshot["MODEL_STATE"]) == {"weight", "bias"}
