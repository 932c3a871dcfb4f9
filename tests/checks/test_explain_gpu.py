"""explain() on real GPUs: optimizer state left behind by a move, DataParallel, models over two GPUs."""

from __future__ import annotations

import pytest
import torch
from checks_programs import Toy, batch_on
from torch import nn

import torchplace as tp

pytestmark = pytest.mark.gpu
CUDA0, CUDA1 = torch.device("cuda:0"), torch.device("cuda:1")


def kinds(result):
    return [(p["kind"], p["where"]) for p in result["problems"] if p["kind"] != "not-checked"]


def test_clean_gpu_model_and_batch():
    model = Toy().to(CUDA0)
    result = tp.explain(model, batch_on(CUDA0), optimizer=torch.optim.AdamW(model.parameters()))
    assert kinds(result) == [] and result["model"]["devices"] == ["cuda:0"]


def test_batch_on_the_cpu():
    result = tp.explain(Toy().to(CUDA0), batch_on("cpu"))
    assert kinds(result) == [("input-device", "inputs[0]['x']"), ("input-device", "inputs[0]['y']")]


def test_optimizer_stepped_before_the_move_keeps_its_state_on_the_cpu():
    model = Toy()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()  # state made on the CPU
    model.to(CUDA0)  # moves parameters in place, not the optimizer's state
    result = tp.explain(model, optimizer=optimizer)
    assert kinds(result) == [("optimizer-state-device", "optimizer")]
    assert "model.layers.0.proj.weight['exp_avg'] on cpu (parameter on cuda:0)" in result["problems"][0]["message"]


@pytest.mark.multigpu
def test_dataparallel_whose_first_device_does_not_hold_the_model():
    """DataParallel's own rule, run on fake tensors: device_ids[0] must hold the whole model."""
    wrong = nn.DataParallel(Toy().to(CUDA1), device_ids=[0, 1])
    [error] = [p for p in tp.explain(wrong, torch.randn(4, 8, device=CUDA0)).problems if p["severity"] == "error"]
    assert error["kind"] == "mismatch" and "device_ids[0]" in error["message"]
    right = nn.DataParallel(Toy().to(CUDA0), device_ids=[0, 1])
    assert [p for p in tp.explain(right, torch.randn(4, 8, device=CUDA0)).problems if p["severity"] == "error"] == []


@pytest.mark.multigpu
def test_model_over_two_gpus_is_shown_by_module():
    model = Toy().to(CUDA0)
    model.head.to(CUDA1)
    result = tp.explain(model)
    assert [(m["module"], m["device"]) for m in result["modules"]] == [("model.layers", "cuda:0"),
                                                                       ("model.head", "cuda:1")]
    assert kinds(result) == [("model-split", "model")]
