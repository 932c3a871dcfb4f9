"""torchtnt's `copy_data_to_device` cases, against `to_device`.

Source of the cases: pytorch/tnt, tests/utils/test_device.py (the `test_copy_data_to_device_*`
cases: tensor, module, list, tuple, dict, namedtuple, dataclass, defaultdict, nested).
Rewritten here in our own words; the originals need a GPU, these run on the meta device (the
structure handling does not depend on the device). The `record_data_in_stream` cases mock
`Tensor.record_stream`; ours run on a real GPU in tests/placement/test_transfer_gpu.py.
No case differs on purpose.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, namedtuple
from typing import Any

import pytest
import torch

import torchplace as tp

META = torch.device("meta")


def test_a_tensor():
    a = torch.tensor([1, 2, 3])
    assert tp.to_device(a, META).device == META and a.device.type == "cpu"


def test_a_module_is_moved_by_its_own_to():
    model = torch.nn.Linear(1, 1)
    out = tp.to_device(model, META)
    assert all(p.device == META for p in out.parameters())


@pytest.mark.parametrize("kind", [list, tuple])
def test_lists_and_tuples(kind):
    original = kind([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])])
    out = tp.to_device(original, META)
    assert type(out) is kind and all(t.device == META for t in out)
    assert all(t.device.type == "cpu" for t in original)


def test_a_dict():
    out = tp.to_device({"f": torch.tensor([1, 2, 3]), "g": torch.tensor([4, 5, 6])}, META)
    assert all(t.device == META for t in out.values())


def test_a_namedtuple():
    pair = namedtuple("tensor_tuple", ["tensor_a", "tensor_b"])
    original = pair(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]))
    out = tp.to_device(original, META)
    assert type(out) is type(original) and out.tensor_a.device == out.tensor_b.device == META


def test_dataclasses_plain_frozen_and_with_a_field_set_after_init():
    @dataclasses.dataclass
    class Plain:
        val: torch.Tensor

    assert tp.to_device(Plain(torch.tensor([1, 2, 3])), META).val.device == META

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        val: torch.Tensor

    out = tp.to_device(Frozen(torch.tensor([1, 2, 3])), META)
    assert out.val.device == META
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.val = torch.tensor([1, 2, 3], device=META)  # type: ignore[misc]

    @dataclasses.dataclass
    class NoInit:
        val: torch.Tensor = dataclasses.field(init=False)

        def __post_init__(self) -> None:
            self.val = torch.tensor([0, 1])

    original = NoInit()
    original.val = torch.tensor([1, 2, 3])  # set after __post_init__: the move keeps this one
    out = tp.to_device(original, META)
    assert out.val.device == META and out.val.shape == (3,)


def test_a_defaultdict_keeps_its_default_factory():
    dd: defaultdict = defaultdict(torch.Tensor)
    dd[1] = torch.tensor([1, 2, 3])
    _ = dd[2]  # an empty tensor made by the factory
    out = tp.to_device(dd, META)
    assert out[1].device == out[2].device == META
    assert type(out[3]) is type(dd[3])


def test_a_dataclass_around_nested_containers():
    @dataclasses.dataclass
    class Nested:
        dict_container: dict[str, Any]

    h, i, j, k, m, n = (torch.tensor([v]) for v in range(6))
    original = Nested({"1": [(h, i), (j, k)], "2": [m], "3": n, "4": 2.0, "5": "string"})
    out = tp.to_device(original, META).dict_container
    assert all(t.device == META for pair in out["1"] for t in pair) and type(out["1"][0]) is tuple
    assert out["2"][0].device == out["3"].device == META
    assert out["4"] == 2.0 and out["5"] == "string"
    assert original.dict_container["3"].device.type == "cpu"
