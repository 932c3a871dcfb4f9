"""MetaTensorError reports of hostile models: 100,000 meta parameters, a module graph that holds itself,
modules and tensor subclasses whose named_parameters / __getattr__ / shape raise. The report summarises
(never lists every weight), and a failing diagnosis leaves PyTorch's error and a general fix, never hides it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import torchplace as tp

pytestmark = pytest.mark.timeout(120)


def _many(n: int) -> nn.Module:
    model = nn.Module()
    with torch.device("meta"):
        for i in range(n):
            model.register_parameter(f"p{i}", nn.Parameter(torch.empty(2)))
    return model


def test_100000_meta_parameters_are_summarised_not_listed() -> None:
    model = _many(100_000)
    with pytest.raises(tp.MetaTensorError) as err, tp.watch(model):
        model.p5.cpu()
    text = str(err.value)
    assert len(text) < 2000, len(text)
    assert "100000 of 100000 parameters and buffers on meta" in text and "and 99996 more" in text
    assert "model.p5" in text and "Fix: load the weights" in text


def test_a_module_graph_that_holds_itself_keeps_pytorchs_error() -> None:
    with torch.device("meta"):
        inner = nn.Linear(2, 2)
    outer = nn.Sequential(inner)
    inner.add_module("back", outer)  # named_modules(remove_duplicate=False) never ends
    with pytest.raises(tp.MetaTensorError, match="(?s)Fix:.*Cannot copy out of meta tensor"), tp.watch(outer):
        inner.weight.cpu()


class _Raising(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.w = nn.Parameter(torch.empty(2))

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("named_parameters broke")

    def __repr__(self) -> str:
        raise ValueError("repr broke")


class _Shapeless(torch.Tensor):
    @property
    def shape(self) -> Any:  # type: ignore[override]
        raise ValueError("shape broke")

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        raise ValueError("repr broke")


def test_a_module_whose_methods_raise_still_gets_a_report() -> None:
    model = _Raising()
    with pytest.raises(tp.MetaTensorError, match="(?s)Fix:.*Cannot copy out of meta tensor.*named_parameters broke"):
        with tp.watch(model):
            model.w.cpu()


def test_a_tensor_subclass_whose_shape_raises_still_gets_a_report() -> None:
    x = torch.empty(3, device="meta").as_subclass(_Shapeless)
    with pytest.raises(tp.MetaTensorError, match="(?s)Fix:.*Cannot copy out of meta tensor"), tp.watch():
        x.cpu()
