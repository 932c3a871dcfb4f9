"""The lock two jobs saving into one directory share (rotation.series_lock) is waited for, not for
ever: a holder that is frozen (SIGSTOP, a hung file system) gets a warning after LOCK_WARN_S and a
CheckpointError after LOCK_TIMEOUT_S, with nothing written; a holder that finishes lets the save go on."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace as tp
from torchplace.checkpoint import rotation
from torchplace.errors import TorchplaceWarning


def _hold(directory: Path) -> int:
    """The directory's series lock, held through a descriptor of our own (as another process would)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_frozen_holder_is_warned_of_then_refused_with_nothing_written(tmp_path, monkeypatch):
    monkeypatch.setattr(rotation, "LOCK_WARN_S", 0.05)
    monkeypatch.setattr(rotation, "LOCK_TIMEOUT_S", 0.3)
    tp.save(tmp_path / "step-1.tpck", model=nn.Linear(2, 2), keep_last=2, rng_state=False)
    before = sorted(os.listdir(tmp_path))
    fd = _hold(tmp_path)
    try:
        with pytest.warns(TorchplaceWarning, match="waiting for another process that is saving into this directory"):
            with pytest.raises(tp.CheckpointError, match=r"still holds its checkpoint series .* Nothing was written\. "
                                                         r"Fix: give each job its own directory"):
                tp.save(tmp_path / "step-2.tpck", model=nn.Linear(2, 2), keep_last=2, rng_state=False)
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == before


def test_a_holder_that_finishes_lets_the_save_go_on(tmp_path, monkeypatch):
    monkeypatch.setattr(rotation, "LOCK_WARN_S", 60.0)
    tp.save(tmp_path / "step-1.tpck", model=nn.Linear(2, 2), keep_last=2, rng_state=False)
    fd = _hold(tmp_path)
    closed = threading.Event()

    def release() -> None:
        closed.set()
        os.close(fd)

    released = threading.Timer(0.2, release)
    released.start()
    model = nn.Linear(2, 2)
    path = tp.save(tmp_path / "step-2.tpck", model=model, keep_last=2, rng_state=False)
    assert closed.is_set()  # the save waited for the holder
    released.join()
    assert torch.equal(tp.load(path)["model"]["weight"], model.weight)
