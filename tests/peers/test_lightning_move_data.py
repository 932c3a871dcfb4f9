"""Lightning's `move_data_to_device` / `batch_to_device` cases, against `to_device`.

Sources of the cases: Lightning-AI/pytorch-lightning, tests/tests_fabric/utilities/test_apply_func.py
(`test_wrongly_implemented_transferable_data_type`) and tests/tests_pytorch/models/test_gpu.py
(`test_single_gpu_batch_parse`, `test_non_blocking`). Rewritten here in our own words; the GPU
cases run on the meta device (the structure handling does not depend on the device), and the
ones that need a real accelerator are in test_lightning_move_data_gpu.py. Deliberate
differences are marked where they occur and listed in docs/moving-data.md ("Beside accelerate
and Lightning").
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

import torchplace as tp


class Holder:
    """A user type whose `.to(device)` moves its tensor and may forget to return anything."""

    def __init__(self, tensor: torch.Tensor, returns: bool) -> None:
        self.tensor, self.returns = tensor, returns

    def to(self, device):
        self.tensor = self.tensor.to(device)
        return self if self.returns else None


@pytest.mark.parametrize("returns", [False, True])
def test_a_to_that_forgets_to_return_gives_the_object_back(returns):
    obj = Holder(torch.tensor(0.1), returns)
    assert tp.to_device(obj, torch.device("cpu")) is obj
    assert tp.to_device(obj, "meta") is obj and obj.tensor.device.type == "meta"


@pytest.mark.parametrize("batch", [None, {}, [], 1.0, "x", [None, 2], {"x": (1, 2), "y": None}])
def test_values_without_tensors_come_back_equal(batch):
    assert tp.to_device(batch, "meta") == batch


def test_a_tensor():
    out = tp.to_device(torch.rand(2, 3), "meta")
    assert out.device.type == "meta" and out.dtype == torch.float32


def test_lists_and_lists_of_lists():
    out = tp.to_device([torch.rand(2, 3), torch.rand(2, 3)], "meta")
    assert [t.device.type for t in out] == ["meta", "meta"]
    out = tp.to_device([[torch.rand(2, 3), torch.rand(2, 3)]], "meta")
    assert [t.device.type for t in out[0]] == ["meta", "meta"]


def test_dicts_in_lists_and_a_tuple_of_both():
    out = tp.to_device([{"a": torch.rand(2, 3), "b": torch.rand(2, 3)}], "meta")
    assert out[0]["a"].device.type == out[0]["b"].device.type == "meta"
    batch = ([torch.rand(2, 3) for _ in range(2)], [{"a": torch.rand(2, 3), "b": torch.rand(2, 3)} for _ in range(2)])
    out = tp.to_device(batch, "meta")
    assert type(out) is tuple and out[0][0].device.type == "meta"
    assert out[1][0]["a"].device.type == out[1][0]["b"].device.type == "meta"


def test_a_list_of_namedtuples():
    kind = namedtuple("BatchType", ["a", "b"])
    out = tp.to_device([kind(a=torch.rand(2, 3), b=torch.rand(2, 3)) for _ in range(2)], "meta")
    assert type(out[0]) is kind and out[0].a.device.type == "meta"


class CustomBatch:
    """Not a tensor, but with a `.to(*args, **kwargs)` that moves in place and returns self."""

    def __init__(self) -> None:
        self.a = torch.rand(2, 2)
        self.calls: list[tuple] = []

    def to(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        self.a = self.a.to(*args, **kwargs)
        return self


def test_an_object_with_its_own_to():
    out = tp.to_device(CustomBatch(), "meta")
    assert out.a.device.type == "meta"


def test_non_blocking_reaches_tensors():
    # Lightning checks the keyword on Tensor.to with a mock; we do not mock torch. A pinned
    # source is what non_blocking needs on a GPU: see test_lightning_move_data_gpu.py.
    out = tp.to_device(torch.zeros(2, 3), "meta", non_blocking=True)
    assert out.device.type == "meta"


@pytest.mark.xfail(strict=True, reason="deliberate: non_blocking is passed to objects' own .to() too")
def test_difference_non_blocking_is_kept_from_objects():
    # Lightning passes non_blocking to tensors only, and calls other objects' .to(device).
    obj = CustomBatch()
    tp.to_device(obj, "meta", non_blocking=True)
    assert obj.calls == [((torch.device("meta"),), {})]


def test_non_blocking_is_offered_to_objects_that_accept_it():
    obj = CustomBatch()
    tp.to_device(obj, "meta", non_blocking=True)
    assert obj.calls == [((torch.device("meta"),), {"non_blocking": True})]
    obj = CustomBatch()
    tp.to_device(obj, "cpu", non_blocking=True)  # to the host: always synchronous for objects
    assert obj.calls == [((torch.device("cpu"),), {"non_blocking": False})]
