"""GPU twin of test_batches.py: pinning and DeviceLoader keep tensor subclasses (tv_tensors-like
metadata), sparse and nested tensors what they are on the way to a GPU."""

from __future__ import annotations

import pytest
import torch

import torchplace as tp
from torchplace.placement.transfer import pin_tensor

from .boxes import Boxes
from .helpers import on_host

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def kinds() -> dict[str, torch.Tensor]:
    return {"boxes": Boxes([[0.0, 1, 2, 3]], format="XYXY", canvas_size=(8, 8)),
            "coo": torch.eye(3).to_sparse(), "csr": torch.eye(3).to_sparse_csr(),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)]),
            "jagged": torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(4, 3)], layout=torch.jagged),
            "plain": torch.arange(6.0).view(2, 3).t()}


def test_pin_tensor_keeps_the_kind() -> None:
    """pin_tensor made an empty strided pinned block for every tensor: a subclass came back a plain
    tensor (metadata lost), sparse and nested raised "do not have strides"."""
    for name, t in kinds().items():
        out = pin_tensor(t)
        assert out.is_pinned() or out.is_nested, name
        assert type(out) is type(t) and out.layout is t.layout and on_host(out) == on_host(t), name
    assert pin_tensor(kinds()["boxes"]).canvas_size == (8, 8)


@pytest.mark.parametrize("background", [None, True])
def test_device_loader_moves_every_kind_to_the_gpu(background: bool | None) -> None:
    """DeviceLoader (its side stream pins big and odd tensors with pin_tensor) on batches holding every kind."""
    batches = [kinds() for _ in range(3)]
    got = list(tp.DeviceLoader(batches, "cuda:0", background=background))
    for out, want in zip(got, batches):
        assert all(t.is_cuda for t in out.values())
        assert type(out["boxes"]) is Boxes and out["boxes"].format == "XYXY" and out["boxes"].canvas_size == (8, 8)
        assert on_host(tp.to_device(out, "cpu")) == on_host(want)
