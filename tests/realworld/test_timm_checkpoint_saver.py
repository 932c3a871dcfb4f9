"""timm's train.py checkpoint idioms (huggingface/pytorch-image-models, timm/utils/checkpoint_saver.py and
timm/models/_helpers.py at aa4b585): the saver writes tmp.pth.tar, renames it to last.pth.tar and hard-links
checkpoint-N.pth.tar and model_best.pth.tar to it; every file holds the parsed `args` (argparse.Namespace),
'state_dict', 'state_dict_ema', 'optimizer', 'epoch', 'version' and 'metric'; resume reads them back. Restated
on a tiny model, ported to torchplace as its docs say, and attacked (a flipped bit, a cut file, the folder)."""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace as tp


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        nn.functional.cross_entropy(model(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0])).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def timm_save(root: Path, model: nn.Module, opt: torch.optim.Optimizer, epoch: int, metric: float,
              args: argparse.Namespace, ported: bool) -> None:
    """CheckpointSaver.save_checkpoint's file dance, with torch.save (before the port) or torchplace.save."""
    state = {"epoch": epoch, "arch": args.model, "version": 2, "state_dict": model.state_dict(),
             "state_dict_ema": copy.deepcopy(model).state_dict(), "metric": metric}
    tmp, last = root / "tmp.pth.tar", root / "last.pth.tar"
    if ported:  # parsed arguments as plain data: torch.load(weights_only=True) refuses a Namespace
        tp.save(tmp, optimizer=opt, args=vars(args), **state)
    else:
        torch.save({**state, "optimizer": opt.state_dict(), "args": args}, tmp)
    if last.exists():
        last.unlink()
    os.replace(tmp, last)
    for name in (f"checkpoint-{epoch}.pth.tar", "model_best.pth.tar"):
        if (root / name).exists():
            (root / name).unlink()
        os.link(last, root / name)


ARGS = argparse.Namespace(model="tiny", lr=1e-2, epochs=3)


def test_a_pre_port_timm_checkpoint_with_its_namespace_resumes_through_torchplace(tmp_path: Path) -> None:
    model, opt = make()
    timm_save(tmp_path, model, opt, 1, 0.5, ARGS, ported=False)
    fresh = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ck = tp.load(tmp_path / "last.pth.tar", device="cpu", model=fresh, optimizer=fresh_opt)  # no trust_pickle
    assert ck["epoch"] == 1 and ck["args"].model == "tiny" and ck["version"] == 2
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert fresh_opt.state_dict()["state"][0]["step"] == 2


def test_the_ported_saver_writes_what_timm_resume_reads_and_the_folder_points_at_a_file(tmp_path: Path) -> None:
    model, opt = make()
    for epoch in (1, 2):
        timm_save(tmp_path, model, opt, epoch, 0.5 * epoch, ARGS, ported=True)
    saved = torch.load(tmp_path / "model_best.pth.tar", map_location="cpu")  # timm's _torch_load, weights_only
    assert saved["epoch"] == 2 and saved["args"]["model"] == "tiny" and "module." not in next(iter(saved["state_dict"]))
    fresh, _ = make()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ck = tp.load(tmp_path / "checkpoint-2.pth.tar", model=fresh, optimizer=fresh_opt)  # weights under 'state_dict'
    assert any("'state_dict'" in n for n in ck.notes) and torch.equal(fresh[3].weight, model[3].weight)
    ck = tp.load(tmp_path, model=fresh)  # the folder: the three hard links of one save, any of them
    assert ck["epoch"] == 2


def test_a_folder_of_another_tools_pth_tar_files_is_no_hf_folder(tmp_path: Path) -> None:
    model, opt = make()
    timm_save(tmp_path, model, opt, 1, 0.5, ARGS, ported=False)  # model_best.pth.tar starts with "model"
    with pytest.raises(tp.CheckpointError, match=r"(?s)holds no complete torchplace checkpoint.*load it by its name"):
        tp.load(tmp_path, model=model)


def test_a_flipped_bit_or_a_cut_end_of_a_pth_tar_is_refused_naming_it(tmp_path: Path) -> None:
    model, opt = make()
    timm_save(tmp_path, model, opt, 1, 0.5, ARGS, ported=True)
    good = (tmp_path / "last.pth.tar").read_bytes()
    weight = model[0].weight.detach().numpy().tobytes()
    at = good.find(weight)
    assert at > 0
    flipped = bytearray(good)
    flipped[at + 7] ^= 0x10
    (tmp_path / "flipped.pth.tar").write_bytes(bytes(flipped))
    before = model[0].weight.detach().clone()
    with pytest.raises(tp.CheckpointError, match=r"flipped.pth.tar is damaged: member .* fails its CRC-32"):
        tp.load(tmp_path / "flipped.pth.tar", model=model)
    (tmp_path / "cut.pth.tar").write_bytes(good[: len(good) // 2])
    with pytest.raises(tp.CheckpointError, match=r"cut.pth.tar cannot be read .*truncated\?"):
        tp.load(tmp_path / "cut.pth.tar", model=model)
    with pytest.warns(tp.TorchplaceWarning, match=r"passed over cut.pth.tar \(\d+ bytes\): it starts as a torch.save "
                                                  r"file but its end, the zip's directory, is missing.*Fix:"):
        ck = tp.load(tmp_path, model=nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)))
    assert any("skipped cut.pth.tar" in n for n in ck.notes)  # the folder's cut file is named, not passed over
    out = subprocess.run([sys.executable, "-m", "torchplace", "ckpt", "inspect", "--verify",
                          str(tmp_path / "flipped.pth.tar")], capture_output=True, text=True, timeout=240)
    assert out.returncode != 0 and "fails its CRC-32" in out.stdout + out.stderr and "Traceback" not in out.stderr
    assert torch.equal(model[0].weight, before)  # refused before any weight moved
