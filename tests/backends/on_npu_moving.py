"""to_device, DeviceLoader, place() and strict mode on the npu test back end."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import torchplace as tp
from torchplace.errors import DeviceMismatchError

pytestmark = pytest.mark.usefixtures("npu")


@dataclass
class Batch:
    x: torch.Tensor
    ids: list


def test_to_device_moves_a_nested_batch_to_npu_and_back():
    batch = {"x": torch.randn(2, 3), "more": [Batch(torch.arange(4), [torch.ones(1)]), "name"]}
    moved = tp.to_device(batch, "npu:1")
    assert moved["x"].device == torch.device("npu", 1)
    assert moved["more"][0].x.device == torch.device("npu", 1)
    assert moved["more"][0].ids[0].device == torch.device("npu", 1) and moved["more"][1] == "name"
    back = tp.to_device(moved, "cpu", non_blocking=True)
    assert torch.equal(back["x"], batch["x"]) and back["more"][0].x.device.type == "cpu"
    across = tp.to_device(moved, "npu:0")
    assert torch.equal(across["more"][0].x.cpu(), torch.arange(4))


def _loader_batches():
    return [(torch.full((4, 3), float(i)), torch.arange(4) + i) for i in range(5)]


@pytest.mark.parametrize("background", [None, True, False])
def test_device_loader_degrades_without_streams(background):
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = tp.DeviceLoader(_loader_batches(), "npu:1", background=background)
        for x, y in loader:
            assert x.device == torch.device("npu", 1) and y.device == torch.device("npu", 1)
            seen.append(float(x.cpu()[0, 0]))
        for _ in loader:  # a second pass says nothing new
            pass
    assert seen == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert loader.stream is None
    notes = [str(w.message) for w in caught if "npu" in str(w.message)]
    assert len(notes) <= 1, notes


def test_device_loader_says_once_that_npu_has_no_streams():
    from torchplace.hardware import accelerator

    accelerator._said.discard(("npu", "streams"))
    with pytest.warns(tp.TorchplaceWarning, match=r"(?s)npu has no streams.*when the loop asks") as record:
        list(tp.DeviceLoader(_loader_batches(), "npu:0"))
        list(tp.DeviceLoader(_loader_batches(), "npu:1"))
    assert len([w for w in record if "npu" in str(w.message)]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory comes from CUDA's host allocator on this "
                    "machine, so there is nothing to degrade (seen on the H200, 2026-12-01)")
def test_pinning_degrades_where_the_back_end_has_no_pinned_memory():
    from torchplace.hardware import accelerator
    from torchplace.placement.transfer import pin

    accelerator._said.discard(("npu", "pinned memory"))
    t = torch.randn(3)
    with pytest.warns(tp.TorchplaceWarning, match="npu has no pinned host memory"):
        out = pin({"t": t})
    assert out["t"] is t


def test_place_splits_a_model_across_npu0_and_npu1():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plan = tp.place(net, {"": "npu:0", "2": "npu:1"}, output="cpu")
    assert net[0].weight.device == torch.device("npu", 0)
    assert net[2].weight.device == torch.device("npu", 1)
    x = torch.randn(3, 4)
    out = net(x)
    assert out.device.type == "cpu" and out.shape == (3, 2)
    # no backward: autograd on npu:1 needs a device count of 2 from the C++ guard (see npu.py)
    plan.remove()


def test_strict_names_an_npu_vs_cpu_mismatch(strict_leaves_nothing_behind):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to("npu:0")
    model[1].bias = nn.Parameter(torch.zeros(2))  # left on the cpu
    with pytest.raises(DeviceMismatchError) as info:
        with tp.strict():
            model(torch.randn(3, 4, device="npu:0"))
    message = str(info.value)
    # the module, both devices and torch's own words; the op's line is the back end's Python
    # dispatch frame here (a back end in C++ has none, and the line is the model's)
    assert "model.1" in message and "npu:0" in message and "on cpu" in message  # the path from the user's variable
    assert "Expected all tensors to be on the same device" in message


def test_explain_reports_npu_devices():
    model = nn.Linear(4, 2).to("npu:1")
    report = tp.explain(model, torch.randn(3, 4))
    text = str(report)
    assert "npu:1" in text and "cpu" in text
