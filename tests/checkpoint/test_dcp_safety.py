"""torch.distributed.checkpoint folders never run code from their files unless told to trust them,
and plain DCP folders (written by torch alone, no side file of ours) load through the same safe reader.

The crafted folders are real DCP checkpoints: `dcp.save` of an object whose pickle calls os.mkdir
(a marker directory: if it exists, code from the file ran), stored as a BYTE_IO item under a key the
model asks for. torch's own `dcp.load` runs it (the control test), so every refusal below is real.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from adversarial.crafting import Payload  # tests/ is on the path
from torch import nn

import torchplace
from torchplace.checkpoint import read_dcp_metadata, write_file
from torchplace.checkpoint.codec import TensorRef
from torchplace.checkpoint.format import SIDE_FILE
from torchplace.cli import main as cli_main
from torchplace.runtime import setup


def dcp_save(state: dict, folder: Path) -> None:
    """torch.distributed.checkpoint.save in this one process (torch warns that there is no group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(folder))


def crafted(folder: Path, marker: Path, *, side: bool) -> Path:
    """A DCP folder whose `model/weight` (or plain `weight`) is a BYTE_IO pickle calling os.mkdir.

    With SIDE, keys and the side file are laid out as torchplace's sharded save writes them."""
    key = "model/weight" if side else "weight"
    bias = "model/bias" if side else "bias"
    dcp_save({key: Payload(marker), bias: torch.zeros(2)}, folder)
    if side:
        write_file(folder / SIDE_FILE, {"model": {"weight": TensorRef(key), "bias": TensorRef(bias)}},
                   info={"world_size": 1, "sharded": True, "rotation": True, "primary_device": "cpu"})
    return folder


REFUSED = r"(?s)__0_0\.distcp.*weight.*needs code.*trust_pickle=True"


def test_control_torch_own_load_runs_the_payload(tmp_path: Path, marker: Path) -> None:
    """The crafted folder is a real attack: torch's default planner unpickles it and the code runs."""
    folder = crafted(tmp_path / "ck", marker, side=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({"weight": torch.empty(2, 2), "bias": torch.empty(2)}, checkpoint_id=str(folder))
        except Exception:  # what the payload returns does not fit; it has run by then
            pass
    assert marker.exists()


@pytest.mark.parametrize("side", [True, False], ids=["torchplace-side-file", "plain-dcp"])
def test_load_of_a_folder_refuses_a_pickled_item(tmp_path: Path, marker: Path, side: bool) -> None:
    folder = crafted(tmp_path / "ck", marker, side=side)
    with pytest.raises(torchplace.CheckpointError, match=REFUSED):
        torchplace.load(folder, model=nn.Linear(2, 2))
    assert not marker.exists()


def test_load_of_a_run_folder_whose_newest_is_crafted_refuses_it(tmp_path: Path, marker: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    crafted(runs / "step-999", marker, side=True)
    with pytest.raises(torchplace.CheckpointError, match=REFUSED):
        torchplace.load(runs, model=nn.Linear(2, 2))
    assert not marker.exists()


@pytest.mark.parametrize("side", [True, False], ids=["torchplace-side-file", "plain-dcp"])
def test_runtime_load_refuses_a_pickled_item(tmp_path: Path, marker: Path, side: bool) -> None:
    folder = crafted(tmp_path / "ck", marker, side=side)
    rt = setup("cpu", precision="fp32", threads=None, distributed=False, verbose=False)
    try:
        with pytest.raises(torchplace.CheckpointError, match=REFUSED):
            rt.load(folder, model=nn.Linear(2, 2))
    finally:
        rt.close()
    assert not marker.exists()


def test_trust_pickle_lets_dcp_unpickle(tmp_path: Path, marker: Path) -> None:
    """trust_pickle=True is the caller's decision to run the file's code: then it runs (and the
    value it returns is not a tensor, which is reported)."""
    folder = crafted(tmp_path / "ck", marker, side=False)
    with pytest.raises(torchplace.CheckpointError, match=r"weight.*holds a NoneType.*tensor"):
        torchplace.load(folder, model=nn.Linear(2, 2), trust_pickle=True)
    assert marker.exists()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchplace", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("side", [True, False], ids=["torchplace-side-file", "plain-dcp"])
def test_cli_inspect_and_convert_run_no_code(tmp_path: Path, marker: Path, side: bool) -> None:
    folder = crafted(tmp_path / "ck", marker, side=side)
    shown = _cli("ckpt", "inspect", "--verify", str(folder))
    assert "Traceback" not in shown.stderr + shown.stdout
    assert shown.returncode == 0, shown.stderr  # inspect reads the metadata only: it lists, never unpickles
    converted = _cli("ckpt", "convert", str(folder), str(tmp_path / "out.safetensors"))
    assert converted.returncode != 0
    assert "Traceback" not in converted.stderr
    assert len(converted.stderr.strip().splitlines()) == 1, converted.stderr
    assert not (tmp_path / "out.safetensors").exists()
    assert not marker.exists()


def test_cli_main_in_process_refuses_the_same(tmp_path: Path, marker: Path, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    folder = crafted(tmp_path / "ck", marker, side=False)
    assert cli_main(["ckpt", "inspect", str(folder)]) == 0
    assert cli_main(["ckpt", "convert", str(folder), str(tmp_path / "out.safetensors")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not marker.exists()


class _EvilMetadata:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("side", [True, False], ids=["torchplace-side-file", "plain-dcp"])
def test_a_metadata_pickle_that_runs_code_is_refused_everywhere(tmp_path: Path, marker: Path, side: bool) -> None:
    """Regression: `.metadata` goes through the restricted unpickler on every entry point."""
    folder = crafted(tmp_path / "ck", tmp_path / "unused", side=side)
    (folder / ".metadata").write_bytes(pickle.dumps(_EvilMetadata(marker)))
    msg = r"(?s)\.metadata.*posix\.mkdir is not a DCP metadata class.*trust_pickle=True"
    with pytest.raises(torchplace.CheckpointError, match=msg):
        read_dcp_metadata(folder)
    with pytest.raises(torchplace.CheckpointError, match=msg):
        torchplace.load(folder, model=nn.Linear(2, 2))
    for cmd in (["inspect", str(folder)], ["convert", str(folder), str(tmp_path / "o.safetensors")]):
        proc = _cli("ckpt", *cmd)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not marker.exists()


def test_storage_outside_the_folder_is_refused(tmp_path: Path) -> None:
    """A `.metadata` pointing an item at a file outside its folder (../secret) is refused, not read."""
    folder = tmp_path / "ck"
    dcp_save({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, folder)
    metadata = read_dcp_metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = "../secret.distcp"
    (tmp_path / "secret.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)\.\./secret\.distcp.*outside"):
        torchplace.load(folder, model=nn.Linear(2, 2))


def test_storage_beyond_the_end_of_its_file_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    dcp_save({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, folder)
    metadata = read_dcp_metadata(folder)
    for info in metadata.storage_data.values():
        info.length = 1 << 40
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)__0_0\.distcp.*bytes.*Fix"):
        torchplace.load(folder, model=nn.Linear(2, 2))


# Plain DCP folders: written by torch alone, read by torchplace.


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-1)


def test_plain_dcp_model_state_dict_round_trip(tmp_path: Path) -> None:
    model, _ = _trained()
    dcp_save(model.state_dict(), tmp_path / "ck")
    fresh, _ = _fresh()
    ck = torchplace.load(tmp_path / "ck", model=fresh)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert ck.tool == "torch.distributed.checkpoint"


def test_plain_dcp_model_and_optimizer_round_trip(tmp_path: Path) -> None:
    model, opt = _trained()
    dcp_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7}, tmp_path / "ck")
    fresh, fresh_opt = _fresh()
    ck = torchplace.load(tmp_path / "ck", model=fresh, optimizer=fresh_opt)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert got["param_groups"][0]["lr"] == 3e-3
    assert set(got["state"]) == set(want["state"])
    for pid, entry in want["state"].items():
        for name, value in entry.items():
            assert torch.equal(got["state"][pid][name], value), (pid, name)
    assert any("'model.'" in note for note in ck.notes), ck.notes


def test_plain_dcp_that_does_not_fit_the_model_says_what_it_holds(tmp_path: Path) -> None:
    dcp_save({"encoder.weight": torch.ones(3, 3)}, tmp_path / "ck")
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)ck.*encoder\.weight.*0\.weight.*Fix"):
        torchplace.load(tmp_path / "ck", model=_fresh()[0])


def test_plain_dcp_without_a_model_says_how_to_load_it(tmp_path: Path) -> None:
    dcp_save({"weight": torch.ones(2, 2)}, tmp_path / "ck")
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)torch\.distributed\.checkpoint.*model="):
        torchplace.load(tmp_path / "ck")


def test_plain_dcp_with_a_payload_in_the_optimizer_state_is_refused(tmp_path: Path, marker: Path) -> None:
    """Non-tensor slots (param groups) are read with weights_only too: a payload there is refused."""
    model, _ = _trained()
    groups = [{"params": [0, 1, 2, 3], "lr": Payload(marker)}]
    dcp_save({"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": groups}}, tmp_path / "ck")
    fresh, fresh_opt = _fresh()
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)__0_0\.distcp.*param_groups\.0\.lr.*trust_pickle=True"):
        torchplace.load(tmp_path / "ck", model=fresh, optimizer=fresh_opt)
    assert not marker.exists()


def test_declared_sizes_beyond_the_files_are_refused_before_allocating(tmp_path: Path) -> None:
    """Optimizer state is allocated from the metadata: a declared 4 TiB tensor is refused first."""
    model, opt = _trained()
    dcp_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck")
    metadata = read_dcp_metadata(tmp_path / "ck")
    md = metadata.state_dict_metadata["optimizer.state.0.exp_avg"]
    md.size = torch.Size([1 << 40] + [1] * (len(md.size) - 1))  # as many dimensions as its chunk's offsets
    md.chunks[0].sizes = md.size
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)optimizer\.state\.0\.exp_avg.*declares.*bytes.*Fix"):
        torchplace.load(tmp_path / "ck", model=_fresh()[0], optimizer=_fresh()[1])
