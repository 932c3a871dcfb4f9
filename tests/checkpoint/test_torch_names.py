"""Names that promise a torch.save file (.pt, .pth, .tar, .ckpt) get one, or a refusal with the fix
(issue 32, item 3): torch.load (weights_only, torch's default), Fabric.load and torchplace.load read
what tp.save writes there; nothing is silent."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import torchplace
from torchplace.errors import CheckpointError


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


class Config:
    """A user's config class: torch.load(weights_only=True) refuses it."""

    lr = 0.1


@pytest.mark.parametrize("name", ["ckpt.pt", "snapshot.pth", "checkpoint.pth.tar", "fabric.ckpt", "model.bin"])
def test_a_torch_name_gets_a_file_torch_load_reads(tmp_path: Path, name: str) -> None:
    model, opt = _trained()
    path = torchplace.save(tmp_path / name, model=model, optimizer=opt, iter_num=7, model_args={"n_layer": 2},
                           extra={"note": "x"})
    expected = (random.random(), float(np.random.rand()), torch.rand(2))  # drawn right after the save
    raw = torch.load(path, map_location="cpu")  # nanoGPT's and imagenet's reader, weights_only by default
    assert raw["iter_num"] == 7 and raw["model_args"] == {"n_layer": 2} and raw["extra"] == {"note": "x"}
    fresh, fresh_opt = _trained(1)
    fresh.load_state_dict(raw["model"])
    fresh_opt.load_state_dict(raw["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # atomic: no temporary left
    back, back_opt = _trained(2)
    ck = torchplace.load(path, model=back, optimizer=back_opt)  # and torchplace reads all of it back
    assert ck.tool == "torchplace (torch.save file)" and ck["iter_num"] == 7 and ck.extra == {"note": "x"}
    assert ck.rng_restored == ["python", "numpy", "cpu"]
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    assert back_opt.param_groups[0]["lr"] == 0.01 and torch.equal(back[0].weight, model[0].weight)


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch) -> None:
    """Importing lightning sets PYTORCH_NVML_BASED_CUDA_CHECK; put it back after each test."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")


def test_fabric_load_reads_it(tmp_path: Path) -> None:
    from lightning.fabric import Fabric

    model, opt = _trained()
    path = torchplace.save(tmp_path / "checkpoint.ckpt", model=model, optimizer=opt, step=3)
    fabric = Fabric(accelerator="cpu", devices=1)
    target, target_opt = fabric.setup(*_trained(1))
    rest = fabric.load(path, {"model": target, "optimizer": target_opt})
    assert rest["step"] == 3 and torch.equal(target.module[0].weight, model[0].weight)


def test_what_a_torch_save_file_cannot_hold_is_refused(tmp_path: Path) -> None:
    model, _ = _trained()
    with pytest.raises(CheckpointError, match=r"weights_only=True\) refuses .*Config.*Fix: save plain data"):
        torchplace.save(tmp_path / "c.pt", model=model, config=Config())
    import argparse  # torchvision's and timm's checkpoints hold their parsed args

    with pytest.raises(CheckpointError, match=r"argparse.Namespace.*Fix: .*vars\(args\)"):
        torchplace.save(tmp_path / "c.pth", model=model, args=argparse.Namespace(lr=0.1))
    with pytest.raises(CheckpointError, match="torch.save cannot write the state"):
        torchplace.save(tmp_path / "c.pt", model=model, schedule=lambda step: step)
    with pytest.raises(CheckpointError, match="keep_last= and latest= order a series.*Fix: name it .*c.safetensors"):
        torchplace.save(tmp_path / "c.pt", model=model, keep_last=2)
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        torchplace.save(tmp_path / "c.pth", model=model, allow_pickle=True)
    with pytest.raises(CheckpointError, match="save_async writes torchplace's own format"):
        torchplace.save_async(tmp_path / "c.pt", model=model)
    for name in ("model.safetensors", "pytorch_model.bin", "model-00001-of-00002.safetensors"):
        with pytest.raises(CheckpointError, match="ckpt convert --weights-only"):
            torchplace.save(tmp_path / name, model=model)
    assert list(tmp_path.iterdir()) == []


def test_a_lightning_module_in_a_ckpt_is_refused_with_the_fix(tmp_path: Path) -> None:
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 2)

    with pytest.raises(CheckpointError, match="trainer.save_checkpoint"):
        torchplace.save(tmp_path / "lit.ckpt", model=Lit())
    torchplace.save(tmp_path / "lit.pt", model=Lit())  # a .pt name promises torch.load only
    assert list(torch.load(tmp_path / "lit.pt")["model"]) == ["net.weight", "net.bias"]


def test_convert_to_a_torch_name_writes_the_torch_save_file(tmp_path: Path) -> None:
    from torchplace.checkpoint import convert

    model, opt = _trained()
    src = torchplace.save(tmp_path / "src.safetensors", model=model, optimizer=opt)
    convert(src, tmp_path / "out.pt")
    assert torch.equal(torch.load(tmp_path / "out.pt")["model"]["0.weight"], model[0].weight)
    convert(src, tmp_path / "w.pth", weights_only=True)  # the bare state dict a published .pth holds (dcgan's netG)
    fresh = _trained(seed=1)[0]
    fresh.load_state_dict(torch.load(tmp_path / "w.pth", weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert getattr(torch.load(tmp_path / "w.pth"), "_metadata", None) is not None  # module versions kept
    # the fix save("pytorch_model.bin") gives: transformers reads a .bin with torch.load, as a bare state dict
    convert(src, tmp_path / "pytorch_model.bin", weights_only=True)
    fresh = _trained(seed=2)[0]
    fresh.load_state_dict(torch.load(tmp_path / "pytorch_model.bin", weights_only=True))
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_a_folder_of_torch_name_files_resumes_from_the_newest(tmp_path: Path) -> None:
    """torchvision's reference and imagenet save model_{epoch}.pth and checkpoint.pth into the output folder;
    given that folder (load(DIR), setup(checkpoint_dir=..., resume=...)), torchplace takes the newest of its
    own torch.save files, by the creation time in their metadata, and ignores a pre-port torch.save file."""
    model, opt = _trained()
    torch.save({"model": model.state_dict(), "epoch": 9}, tmp_path / "pre_port.pth")  # not ours: ignored
    for epoch in range(3):
        torchplace.save(tmp_path / f"model_{epoch}.pth", model=model, optimizer=opt, epoch=epoch)
    ck = torchplace.load(tmp_path, model=_trained(1)[0])
    assert ck.path.name == "model_2.pth" and ck["epoch"] == 2
    rt = torchplace.setup("cpu", threads=None, checkpoint_dir=tmp_path, resume=True, verbose=False)
    assert rt.resume_from is not None and rt.resume_from.name == "model_2.pth"
    assert any("model_2.pth" in line for line in rt.decisions)


def test_save_weights_only_writes_what_the_models_own_readers_take(tmp_path: Path) -> None:
    """A published .pth (dcgan's netG_epoch_N.pth) is a bare state dict, HF's model.safetensors plain safetensors:
    save(weights_only=True) writes each as its readers take it; anything beside the model is refused, unwritten."""
    from safetensors.torch import load_file

    model, opt = _trained()
    fresh = _trained(seed=1)[0]
    fresh.load_state_dict(torch.load(torchplace.save(tmp_path / "net.pth", model=model, weights_only=True)))
    assert torch.equal(fresh[0].weight, model[0].weight)
    fresh = _trained(seed=2)[0]
    fresh.load_state_dict(load_file(torchplace.save(tmp_path / "model.safetensors", model=model, weights_only=True)))
    assert torch.equal(fresh[2].bias, model[2].bias)
    with pytest.raises(CheckpointError, match=r"weights alone, and optimizer was given too.*Fix"):
        torchplace.save(tmp_path / "both.pth", model=model, optimizer=opt, weights_only=True)
    with pytest.raises(CheckpointError, match="no model= was given"):
        torchplace.save(tmp_path / "none.pth", weights_only=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "net.pth"]


def test_torch_saves_order_saves_what_torch_save_would(tmp_path: Path) -> None:
    """`tp.save(model.state_dict(), "ckpt.pt")`, a port of torch.save, raised 'takes 1 positional argument': a state
    dict (or module) alone is its bare weights, which torch.load gives back; a dict of entries is named state."""
    model, opt = _trained()
    fresh = _trained(seed=1)[0]
    fresh.load_state_dict(torch.load(torchplace.save(model.state_dict(), tmp_path / "ckpt.pt")))
    assert torch.equal(fresh[0].weight, model[0].weight)
    fresh.load_state_dict(torch.load(torchplace.save(tmp_path / "ckpt.pt", model.state_dict())))  # path first too
    assert set(torch.load(torchplace.save(model, str(tmp_path / "m.pth")))) == set(model.state_dict())
    nano = {"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 5, "model_args": {"n_layer": 2}}
    raw = torch.load(torchplace.save(nano, tmp_path / "nano.pt"))  # nanoGPT's checkpoint dict, entries at the top
    assert raw["iter_num"] == 5 and raw["model_args"] == {"n_layer": 2} and set(raw["model"]) == set(nano["model"])
    back, back_opt = _trained(seed=2)
    ck = torchplace.load(tmp_path / "nano.pt", model=back, optimizer=back_opt)
    assert ck["iter_num"] == 5 and torch.equal(back[2].bias, model[2].bias) and ck.rng_restored
    with pytest.raises(TypeError, match=r"model is given twice.*Fix"):
        torchplace.save(model.state_dict(), tmp_path / "x.pt", model=model)
    with pytest.raises(TypeError, match=r"second argument, as in torch.save, is the path.*Fix"):
        torchplace.save(model.state_dict())
    with pytest.raises(TypeError, match=r"never a pickled object.*Fix"):
        torchplace.save([1, 2], tmp_path / "x.pt")
    fut = torchplace.save_async(model.state_dict(), tmp_path / "a.tpck")  # save_async writes torchplace's format
    fresh = _trained(seed=3)[0]
    torchplace.load(fut.result(), model=fresh)
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tpck", "ckpt.pt", "m.pth", "nano.pt"]


@pytest.mark.parametrize("name", ["ckpt.pkl", "model_best.pth.tar", "last.ckpt"])
def test_pickle_and_tar_names_get_the_torch_save_file(tmp_path: Path, name: str) -> None:
    """A .pkl name (torch.save's pickle) got torchplace's format, which torch.load refuses with a pickle error."""
    model, _ = _trained()
    raw = torch.load(torchplace.save(tmp_path / name, model=model, epoch=2))
    assert raw["epoch"] == 2 and set(raw["model"]) == set(model.state_dict())


def test_other_names_get_torchplaces_format(tmp_path: Path) -> None:
    """No suffix, or one that promises no torch.save file: torchplace's format, which tp.load reads."""
    from torchplace.checkpoint import read_header

    model, _ = _trained()
    for name in ("checkpoint", "run.state", "step-1.tpck"):
        assert read_header(torchplace.save(tmp_path / name, model=model)).meta is not None


def test_inspect_names_torchplaces_torch_save_file(tmp_path: Path) -> None:
    """`torchplace ckpt inspect ckpt.pt` of nanoGPT's tp.save said 'made by torch.save (training dict)' and put
    iter_num, the RNG states and torchplace's metadata under one 'extra' entry, unlike tp.load."""
    from torchplace.checkpoint import inspect

    model, opt = _trained()
    info = inspect(torchplace.save(tmp_path / "ckpt.pt", model=model, optimizer=opt, iter_num=3))
    assert info.tool == torchplace.load(tmp_path / "ckpt.pt").tool == "torchplace (torch.save file)"
    assert list(info.contents) == ["model", "optimizer", "iter_num", "rng"] and info.contents["iter_num"] == "3"
    assert info.metadata["objects"]["optimizer"] == "torch.optim.adamw.AdamW"


def test_weights_only_convert_takes_imagenets_state_dict_entry(tmp_path: Path) -> None:
    """`torchplace ckpt convert --weights-only checkpoint.pth.tar w.pt` of imagenet's dict saved by tp.save said
    'holds no model weights', though tp.load(path, model=...) takes its 'state_dict' as the model's."""
    from torchplace.checkpoint import convert

    model, opt = _trained()
    src = torchplace.save(tmp_path / "checkpoint.pth.tar", epoch=2, state_dict=model.state_dict(),
                          optimizer=opt.state_dict())
    done = convert(src, tmp_path / "w.pt", weights_only=True)
    fresh = _trained(seed=1)[0]
    fresh.load_state_dict(torch.load(done.path))
    assert torch.equal(fresh[0].weight, model[0].weight) and any("'state_dict'" in n for n in done.notes)
