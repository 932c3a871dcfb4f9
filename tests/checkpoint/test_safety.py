"""Loading never runs code from a file unless told to trust it: malicious pickles stay inert."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from adversarial.crafting import Payload  # tests/ is on the path

import torchplace
from torchplace.checkpoint import convert, inspect, read_dcp_metadata


def test_a_torch_save_file_with_a_payload_is_refused(tmp_path: Path, marker: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "extra": Payload(marker)}, path)
    with pytest.raises(torchplace.CheckpointError,
                       match=r"(?s)evil.pt is a pickle that needs code.*mkdir.*trust_pickle=True"):
        torchplace.load(path)
    with pytest.raises(torchplace.CheckpointError, match="trust_pickle"):
        inspect(path)
    with pytest.raises(torchplace.CheckpointError, match="trust_pickle"):
        convert(path, tmp_path / "out.safetensors")
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def test_a_raw_pickle_with_a_payload_is_refused(tmp_path: Path, marker: Path) -> None:
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(Payload(marker), protocol=2))
    with pytest.raises(torchplace.CheckpointError, match="trust_pickle"):
        torchplace.load(path)
    assert not marker.exists()


def test_a_pickled_entry_in_a_torchplace_file_runs_only_when_trusted(tmp_path: Path, marker: Path) -> None:
    path = torchplace.save(tmp_path / "c.safetensors", extra={"cb": Payload(marker)}, allow_pickle=True)
    with pytest.raises(torchplace.CheckpointError, match=r"extra/cb.*allow_pickle=True.*trust_pickle=True"):
        torchplace.load(path)
    assert not marker.exists()
    assert inspect(path).metadata["pickled"] == ["extra/cb"]  # inspecting shows it without running it
    assert not marker.exists()
    torchplace.load(path, trust_pickle=True)  # the explicit opt-in does what it says
    assert marker.exists()


def test_a_dcp_metadata_file_with_a_payload_is_refused(tmp_path: Path, marker: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(torchplace.CheckpointError, match="posix.mkdir is not a DCP metadata class"):
        read_dcp_metadata(tmp_path)
    with pytest.raises(torchplace.CheckpointError, match="trust_pickle"):
        inspect(tmp_path)
    assert not marker.exists()


def test_an_accelerate_directory_with_a_payload_is_refused(tmp_path: Path, marker: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    torch.save({"state": {}, "param_groups": [], "hook": Payload(marker)}, tmp_path / "optimizer.bin")
    with pytest.raises(torchplace.CheckpointError, match=r"optimizer.bin is a pickle"):
        torchplace.load(tmp_path)
    assert not marker.exists()
