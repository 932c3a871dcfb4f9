"""The cells of docs/interop.md's checkpoint table that no other test covers (issue 32): every cell loads
the right weights, or is loud (an error, a refusal, the reader's own warning) and the table gives the fix.
The other cells' tests are named in the table (test_interop.py, test_torch_names.py, test_foreign.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace
from torchplace.checkpoint import convert


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch) -> None:
    """Importing lightning sets PYTORCH_NVML_BASED_CUDA_CHECK; put it back after each test."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_torch_load_of_a_torchplace_safetensors_file_is_loud(tmp_path: Path) -> None:
    """torchplace's own format is no torch.save file: torch 2.13's torch.load reads it as safetensors, a flat
    dict keyed 'model/0.weight', so a reader's checkpoint['model'] is a KeyError (the fix: a .pt name)."""
    ours = torchplace.save(tmp_path / "ours.safetensors", model=net(0))
    try:
        flat = torch.load(ours)
    except Exception:  # an older torch.load does not read safetensors at all: loud too
        flat = {}
    assert "model" not in flat and all(k.startswith(("model/", "rng/")) for k in flat)
    torchplace.save(tmp_path / "ours.pt", model=net(0))
    back = net(1)
    back.load_state_dict(torch.load(tmp_path / "ours.pt")["model"])
    assert same(net(0), back)


def test_lightning_load_from_checkpoint_of_a_torchplace_file_is_loud(tmp_path: Path) -> None:
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(0)

    ours = torchplace.save(tmp_path / "ours.safetensors", model=Lit())
    with pytest.raises(Exception):  # noqa: B017 - Lightning's own error: not its format
        Lit.load_from_checkpoint(ours)
    fresh = Lit()  # the table's way: torchplace.load into the LightningModule
    with torch.no_grad():
        fresh.net[0].weight.zero_()
    torchplace.load(ours, model=fresh)
    assert same(Lit(), fresh)


def test_accelerate_save_model_and_load_checkpoint_in_model_both_ways(tmp_path: Path, caplog) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import load_checkpoint_in_model

    accelerator = Accelerator(cpu=True)
    try:
        accelerator.save_model(accelerator.prepare(net(0)), tmp_path / "saved")  # theirs -> ours
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    bare = net(1)
    torchplace.load(tmp_path / "saved" / "model.safetensors", model=bare)
    assert same(net(0), bare)
    ours = torchplace.save(tmp_path / "ours.safetensors", model=net(0), rng_state=False)
    target = net(2)
    with caplog.at_level(logging.WARNING):
        load_checkpoint_in_model(target, str(ours))  # ours as it is: no weight loads, and accelerate says so
    assert same(net(2), target) and "were not used" in caplog.text and "model/0.weight" in caplog.text
    convert(ours, tmp_path / "model.safetensors", weights_only=True)  # the table's fix
    load_checkpoint_in_model(target, str(tmp_path / "model.safetensors"))
    assert same(net(0), target)


def test_hf_from_pretrained_of_a_copied_torchplace_file_reports_every_weight_missing(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(config)
    hf.save_pretrained(tmp_path / "hf")
    ours = torchplace.save(tmp_path / "step-1.safetensors", model=hf, rng_state=False)
    (tmp_path / "hf" / "model.safetensors").write_bytes(ours.read_bytes())  # copied by hand, past the refusal
    _, info = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert len(info["missing_keys"]) >= len(hf.state_dict()) - 2  # HF's own report: nothing of it was used
    assert any(k.startswith("model/") for k in info["unexpected_keys"])
