"""`torchplace ckpt inspect` and `torchplace ckpt convert`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import torchplace
from torchplace.checkpoint import read_header
from torchplace.cli import main


def _ckpt(tmp_path: Path) -> Path:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    return torchplace.save(tmp_path / "c.safetensors", model=model, optimizer=opt, extra={"step": 11})


def test_inspect_json_lists_tensors_and_metadata(tmp_path: Path, capsys) -> None:
    path = _ckpt(tmp_path)
    assert main(["ckpt", "inspect", str(path), "--json", "--verify"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tool"] == "torchplace" and data["verified"] is True
    weight = next(t for t in data["tensors"] if t["key"] == "model/weight")
    assert weight == {"key": "model/weight", "dtype": "float32", "shape": [2, 3], "nbytes": 24, "saved_on": "cpu"}
    assert data["metadata"]["objects"]["optimizer"] == "torch.optim.sgd.SGD"
    assert "step=11" in data["contents"]["extra"] and "lr 0.25" in data["contents"]["optimizer"]


def test_inspect_table(tmp_path: Path, capsys) -> None:
    path = _ckpt(tmp_path)
    assert main(["ckpt", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "torchplace" in out and "model/weight" in out and "2x3" in out and "torch.optim.sgd.SGD" in out


def test_convert_says_which_format_it_wrote_and_refuses_an_hf_name_without_weights_only(tmp_path: Path,
                                                                                       capsys) -> None:
    """`convert --weights-only c out.pt` said '(plain safetensors)' of a torch.save file, and `convert c
    model.safetensors` wrote a torchplace checkpoint from_pretrained loads no weight of (save refuses that name)."""
    path = _ckpt(tmp_path)
    assert main(["ckpt", "convert", "--weights-only", str(path), str(tmp_path / "out.pt")]) == 0
    assert "2 model weights (a bare torch.save state dict)" in capsys.readouterr().out
    assert main(["ckpt", "convert", str(path), str(tmp_path / "model.safetensors")]) == 2
    assert "Fix: add --weights-only" in capsys.readouterr().err and not (tmp_path / "model.safetensors").exists()
    assert main(["ckpt", "convert", "--weights-only", str(path), str(tmp_path / "model.safetensors")]) == 0
    assert "(plain safetensors)" in capsys.readouterr().out


def test_inspect_verify_fails_on_a_damaged_file(tmp_path: Path, capsys) -> None:
    path = _ckpt(tmp_path)
    data = bytearray(path.read_bytes())
    data[read_header(path).data_offset] ^= 1
    path.write_bytes(bytes(data))
    assert main(["ckpt", "inspect", str(path)]) == 0  # the header is whole: inspecting works
    assert main(["ckpt", "inspect", str(path), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "is damaged" in err and "checksum" in err and str(path) in err


def test_convert_writes_a_torchplace_file(tmp_path: Path, capsys) -> None:
    src = tmp_path / "ddp.pt"
    model = torch.nn.Linear(3, 2)
    torch.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 2}, src)
    assert main(["ckpt", "convert", str(src), str(tmp_path / "out.safetensors"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stripped_prefix"] == "" and result["tensors"] == 2  # kept: load(model=) maps it
    assert any("'module.', kept" in n for n in result["notes"])
    target = torch.nn.Linear(3, 2)
    torchplace.load(tmp_path / "out.safetensors", model=target)
    assert torch.equal(target.weight, model.weight)
    assert main(["ckpt", "convert", str(src), str(tmp_path / "again.safetensors")]) == 0
    assert "starts with 'module.', kept" in " ".join(capsys.readouterr().out.split())  # rich wraps lines


def test_convert_refuses_to_replace_an_existing_output_unless_forced(tmp_path: Path, capsys) -> None:
    src = tmp_path / "plain.pt"
    torch.save({"model": torch.nn.Linear(3, 2).state_dict()}, src)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"someone's file")
    assert main(["ckpt", "convert", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} exists, and convert would replace it. Fix: pass --force" in " ".join(err.split())
    assert out.read_bytes() == b"someone's file"
    assert main(["ckpt", "convert", str(src), str(out), "--force"]) == 0
    assert torchplace.load(out)["model"]["weight"].shape == (2, 3)


def test_inspect_of_a_run_folder_describes_what_load_loads(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    for step in range(3):
        torchplace.save(runs / f"step{step}.tpck", model=torch.nn.Linear(3, 2), extra={"step": step}, keep_last=2)
    assert torchplace.load(runs).path.name == "step2.tpck"
    for target in (runs, runs / "latest"):
        assert main(["ckpt", "inspect", str(target), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert Path(data["path"]).name == "step2.tpck" and data["series"] == ["step2.tpck", "step1.tpck"]
        assert "is a run folder" in data["notes"][0] and f"torchplace.load({str(runs)!r}) loads" in data["notes"][0]
    assert main(["ckpt", "inspect", str(runs)]) == 0
    assert "newest complete checkpoint, step2.tpck" in " ".join(capsys.readouterr().out.split())


def test_ckpt_without_a_command_prints_help(capsys) -> None:
    assert main(["ckpt"]) == 2
    assert "inspect" in capsys.readouterr().out


def test_building_the_parser_does_not_import_torch() -> None:
    code = "import sys, torchplace.cli as c; c.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
