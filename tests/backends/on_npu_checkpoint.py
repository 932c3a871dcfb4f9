"""Checkpoints saved on the npu test back end, loaded onto npu and the cpu."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchplace as tp

pytestmark = pytest.mark.usefixtures("npu")


def _trained(device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():  # gradients made by hand: backward on npu:1 needs torch's C++ guard (npu.py)
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    return model, opt


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x.detach().cpu(), y.detach().cpu()) for x, y in zip(a.state_dict().values(),
                                                                               b.state_dict().values()))


@pytest.mark.parametrize("target", ["cpu", "npu:0", "npu:1"])
def test_save_on_npu1_load_onto(tmp_path, target):
    model, opt = _trained("npu:1")
    path = tp.save(tmp_path / "ck.tpck", model=model, optimizer=opt)
    # on the target before the optimizer is made: this back end's tensors are Python wrappers, so
    # Module.to() replaces the parameters instead of swapping their data (a C++ back end swaps)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(target)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    ck = tp.load(path, device=target, model=fresh, optimizer=fresh_opt)
    want = torch.device(target)
    assert all(p.device == want for p in fresh.parameters())
    assert _same(model, fresh)
    state = fresh_opt.state_dict()["state"][0]
    assert state["exp_avg"].device == want
    assert ck is not None


def test_inspect_names_the_npu_device(tmp_path):
    model, _ = _trained("npu:1")
    path = tp.save(tmp_path / "ck.tpck", model=model)
    info = tp.inspect(path) if hasattr(tp, "inspect") else None
    if info is not None:
        assert "npu" in str(info)


def test_rng_state_of_npu_round_trips(tmp_path):
    model, _ = _trained("npu:0")
    torch.npu.manual_seed_all(7)
    path = tp.save(tmp_path / "ck.tpck", model=model)
    expected = torch.randn(3, device="npu:0").cpu()
    tp.load(path, device="npu:0", model=model)
    assert torch.equal(torch.randn(3, device="npu:0").cpu(), expected)
