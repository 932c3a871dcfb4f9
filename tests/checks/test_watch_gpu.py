"""watch(model) on real GPUs: the same mistakes with cuda:0, cuda:1 and cpu."""

from __future__ import annotations

import math

import pytest
import torch
from checks_programs import Scaled, Toy, WithConstant, at, batch_on, clean_training, forward_loss, late_submodule

import torchplace as tp

pytestmark = pytest.mark.gpu
CUDA0, CUDA1 = torch.device("cuda:0"), torch.device("cuda:1")


def mismatch(fn, *args, model=None):
    with pytest.raises(tp.DeviceMismatchError) as info:
        with tp.watch(model):
            fn(*args)
    return info.value


def culprits(err):
    return [(t.label, t.device) for t in err.report.culprits]


def test_batch_left_on_the_cpu():
    model = Toy().to(CUDA0)
    err = mismatch(forward_loss, model, batch_on("cpu"), model=model)
    assert err.report.module == "model.layers.0.proj" and err.report.expected_device == "cuda:0"
    assert culprits(err) == [("input", "cpu")]
    assert err.report.culprits[0].origin.startswith("batch['x']") and at("block") in str(err)


@pytest.mark.multigpu
def test_batch_on_the_other_gpu():
    model = Toy().to(CUDA0)
    err = mismatch(forward_loss, model, batch_on(CUDA1), model=model)
    assert err.report.module == "model.layers.0.proj" and culprits(err) == [("input", "cuda:1")]
    assert "to_device(batch, 'cuda:0')" in str(err)


def test_plain_attribute_stays_on_the_cpu():
    model = Scaled().to(CUDA0)
    err = mismatch(model, torch.randn(2, 8, device=CUDA0), model=model)
    assert culprits(err) == [("self.scale", "cpu")] and err.report.culprits[0].kind == "attribute"
    assert at("plain-attribute") in str(err)


def test_constant_made_in_forward():
    model = WithConstant().to(CUDA0)
    err = mismatch(model, torch.randn(2, 8, device=CUDA0), model=model)
    assert culprits(err) == [("offsets", "cpu")] and at("constant") in str(err)


@pytest.mark.multigpu
def test_submodule_added_after_to_on_two_gpus():
    model = late_submodule(CUDA1)
    err = mismatch(model, torch.randn(2, 8, device=CUDA1), model=model)
    assert err.report.module == "model.head"
    assert sorted(culprits(err)) == [("self.bias", "cpu"), ("self.weight", "cpu")]
    assert "model.head on cpu" in str(err)


def test_labels_on_the_cpu():
    model = Toy().to(CUDA0)
    batch = batch_on(CUDA0)
    batch["y"] = batch["y"].cpu()
    err = mismatch(forward_loss, model, batch, model=model)
    assert err.report.module is None and culprits(err) == [("target", "cpu")] and at("loss") in str(err)


def test_cpu_scalar_with_a_gpu_tensor_is_fine():
    with tp.watch():
        out = torch.ones(3, device=CUDA0) * torch.tensor(2.0)
    assert out.device == CUDA0


def test_clean_training_on_a_gpu_is_silent():
    with tp.watch():
        losses = clean_training(CUDA0)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
