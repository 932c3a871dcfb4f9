"""With the npu back end beside CUDA: a checkpoint from npu:1 loads onto cuda:0."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchplace as tp

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("npu")]


def test_save_on_npu1_load_onto_cuda0(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to("npu:1")
    path = tp.save(tmp_path / "ck.tpck", model=model)
    fresh = nn.Linear(4, 2)
    tp.load(path, device="cuda:0", model=fresh)
    assert fresh.weight.device == torch.device("cuda", 0)
    assert torch.equal(fresh.weight.cpu(), model.weight.detach().cpu())


def test_cuda_still_resolves_beside_npu():
    assert tp.device("auto") == torch.device("cuda", 0)  # cuda first, whatever torch.accelerator says
    assert tp.device("npu:1") == torch.device("npu", 1)
