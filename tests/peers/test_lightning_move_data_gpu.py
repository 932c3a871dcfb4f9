"""Lightning's GPU batch cases that need a real accelerator, against `to_device`.

Source of the cases: Lightning-AI/pytorch-lightning, tests/tests_pytorch/models/test_gpu.py
(`test_single_gpu_batch_parse`, `test_non_blocking`), rewritten in our own words. The device
independent parts run on meta in test_lightning_move_data.py.
"""

from __future__ import annotations

import pytest
import torch

import torchplace as tp

pytestmark = pytest.mark.gpu


class CustomBatch:
    def __init__(self) -> None:
        self.a = torch.rand(2, 2)
        self.calls: list[dict] = []

    def to(self, *args, **kwargs):
        self.calls.append(kwargs)
        self.a = self.a.to(*args, **kwargs)
        return self


def test_a_mixed_batch_lands_on_gpu_0():
    batch = ([torch.rand(2, 3) for _ in range(2)], [{"a": torch.rand(2, 3)}], CustomBatch())
    out = tp.to_device(batch, torch.device("cuda:0"))
    assert out[0][0].device == torch.device("cuda:0") and out[1][0]["a"].type() == "torch.cuda.FloatTensor"
    assert out[2].a.device == torch.device("cuda:0")


def test_objects_are_offered_non_blocking_to_a_gpu():
    obj = CustomBatch()
    tp.to_device(obj, "cuda:0")  # host to GPU is asynchronous by default (Lightning: tensors only)
    assert obj.calls == [{"non_blocking": True}]
