"""keep_last and the `latest` pointer; resuming from a directory finds the newest complete checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import torchplace
from torchplace.checkpoint import complete_checkpoints, latest
from torchplace.checkpoint.format import read_header


def _save(directory: Path, step: int, **kwargs) -> Path:
    return torchplace.save(directory / f"step-{step:04d}.safetensors", model={"w": torch.full((10,), float(step))},
                           extra={"step": step}, rng_state=False, **kwargs)


def test_keep_last_keeps_the_newest_and_points_at_the_last(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    other = torchplace.save(tmp_path / "best.safetensors", extra={"best": True})  # saved without rotation
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best.safetensors", "latest", "notes.txt", "step-0004.safetensors", "step-0005.safetensors"]
    pointer = json.loads((tmp_path / "latest").read_text())
    assert pointer["latest"] == "step-0005.safetensors"
    assert pointer["history"] == ["step-0004.safetensors", "step-0005.safetensors"]
    assert torchplace.load(tmp_path).extra["step"] == 5
    assert other.exists()


def test_latest_true_keeps_everything_and_updates_the_pointer(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, latest=True)
    assert len(list(tmp_path.glob("step-*"))) == 3
    assert json.loads((tmp_path / "latest").read_text())["latest"] == "step-0003.safetensors"


def test_a_checkpoint_renamed_but_not_recorded_is_adopted(tmp_path: Path) -> None:
    """A writer killed between its rename and the pointer update: the next save counts that file."""
    for step in (1, 2):
        _save(tmp_path, step, keep_last=2)
    pointer = (tmp_path / "latest").read_bytes()
    _save(tmp_path, 3, keep_last=2)
    (tmp_path / "latest").write_bytes(pointer)  # as if killed before the pointer moved
    assert torchplace.load(tmp_path).extra["step"] == 3  # the directory still resolves to the newest
    _save(tmp_path, 4, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0003.safetensors", "step-0004.safetensors"]


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=3)
    newest = tmp_path / "step-0003.safetensors"
    header = read_header(newest)
    data = bytearray(newest.read_bytes())
    data[header.data_offset + 5] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="skipping .*step-0003.*checksum"):
        ck = torchplace.load(tmp_path)
    assert ck.extra["step"] == 2 and "skipped step-0003.safetensors" in ck.notes[0]

    os.truncate(tmp_path / "step-0002.safetensors", 100)  # a header that is not whole: not even a candidate
    assert complete_checkpoints(tmp_path)[0].name == "step-0003.safetensors"
    with pytest.warns(RuntimeWarning):
        assert torchplace.load(tmp_path).extra["step"] == 1


def test_a_missing_or_garbled_pointer_does_not_matter_for_resuming(tmp_path: Path) -> None:
    for step in (1, 2):
        _save(tmp_path, step, keep_last=5)
    (tmp_path / "latest").write_text("{not json")
    assert latest(tmp_path).name == "step-0002.safetensors"
    (tmp_path / "latest").unlink()
    assert torchplace.load(tmp_path).extra["step"] == 2
    _save(tmp_path, 3, keep_last=5)  # a new pointer is written from what is in the directory
    assert json.loads((tmp_path / "latest").read_text())["history"][-1] == "step-0003.safetensors"


def test_a_directory_without_checkpoints_says_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "readme.md").write_text("hello")
    with pytest.raises(torchplace.CheckpointError,
                       match=r"holds no complete torchplace checkpoint \(it holds: readme.md\)"):
        torchplace.load(tmp_path)


def test_resuming_refuses_a_pickled_newest_instead_of_skipping_it(tmp_path: Path) -> None:
    _save(tmp_path, 1, keep_last=3)
    torchplace.save(tmp_path / "step-0002.safetensors", extra={"obj": object.__new__(Holder)}, allow_pickle=True,
                    keep_last=3)
    with pytest.raises(torchplace.CheckpointError, match="trust_pickle=True"):
        torchplace.load(tmp_path)


class Holder:
    pass
