"""`place` and `to_device` with what transformers users hand them, beyond tests/interop/test_batches.py
and test_split_interop.py: a device_map given the way `from_pretrained(device_map=...)` takes one,
and batch types those passes did not reach (BatchFeature, a ModelOutput with fields left None, a
slotted keyword-only dataclass, a NamedTuple whose defaults are tensors).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import torchplace as tp

META = torch.device("meta")


@pytest.mark.parametrize("spec", ["auto", "cpu", torch.device("cpu"), 0])
def test_a_device_map_given_as_one_device_or_auto_is_refused_with_the_dict_to_pass(spec: Any) -> None:
    """huggingface/transformers, tests/utils/test_modeling_utils.py (from_pretrained(device_map="auto" | "cpu"
    | 0)): the same values given to place() raised AttributeError: 'str' object has no attribute 'items'.
    Now a DeviceError names the shape wanted, before anything moves."""
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(tp.DeviceError, match=r"place\(\) takes a map of submodule names to devices.*"
                                             r"Fix: \{'': .*infer_auto_device_map"):
        tp.place(model, spec)
    assert not model._forward_pre_hooks and not model._forward_hooks


@dataclasses.dataclass(slots=True, kw_only=True)
class Slotted:
    x: torch.Tensor
    rest: list[torch.Tensor]


class WithDefaults(NamedTuple):
    ids: torch.Tensor
    mask: torch.Tensor = torch.ones(2)
    n: int = 3


def batch_feature() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.BatchFeature({"pixel_values": torch.ones(1, 3), "sizes": [4, 5]}, tensor_type="pt")


def causal_output() -> Any:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    return outputs.CausalLMOutputWithPast(logits=torch.ones(2, 3), loss=None)


BATCHES = {
    "slotted_kw_only_dataclass": lambda: Slotted(x=torch.ones(2), rest=[torch.zeros(1)]),
    "namedtuple_with_tensor_defaults": lambda: WithDefaults(torch.arange(2)),
    "batch_feature": batch_feature,
    "model_output_with_none_fields": causal_output,
}


def tensors_of(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict) or hasattr(x, "items"):
        return [t for v in x.values() for t in tensors_of(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensors_of(v)]
    if dataclasses.is_dataclass(x):
        return [t for f in dataclasses.fields(x) for t in tensors_of(getattr(x, f.name))]
    return []


@pytest.mark.parametrize("kind", list(BATCHES))
def test_framework_batches_keep_their_type_and_every_tensor_moves(kind: str) -> None:
    """huggingface/transformers, tests/utils/test_feature_extraction_utils.py (BatchFeature.to) and
    tests/utils/test_model_output.py (a ModelOutput keeps only the fields that are set): passed unchanged."""
    batch = BATCHES[kind]()
    out = tp.to_device(batch, META)
    assert type(out) is type(batch)
    moved, kept = tensors_of(out), tensors_of(batch)
    assert len(moved) == len(kept) > 0 and all(t.is_meta for t in moved) and not any(t.is_meta for t in kept)
    if kind == "model_output_with_none_fields":
        assert list(out.keys()) == ["logits"] and out.loss is None and out[0].is_meta
    if kind == "namedtuple_with_tensor_defaults":
        assert out.n == 3
