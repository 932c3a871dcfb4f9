"""lightning-utilities' `apply_to_collection` cases that concern moving data, against `to_device`.

Source of the cases: Lightning-AI/utilities, tests/unittests/core/test_apply_func.py
(`test_recursive_application_to_collection`, `test_application_to_collection_return_type`,
`test_apply_to_collection_frozen_dataclass`, `test_apply_to_collection_allow_frozen_dataclass`,
`test_apply_to_collection_with_cached_property_dataclass`). Rewritten here in our own words: the
function applied is a move to the meta device instead of "times two". Cases about
`apply_to_collections` (two collections zipped), `include_none` and dtype filters have no
counterpart in a move and are not ported. Deliberate differences are marked where they occur
and listed in docs/moving-data.md ("Beside accelerate and Lightning").
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import InitVar
from functools import cached_property
from typing import Any, ClassVar

import pytest
import torch

import torchplace as tp
from torchplace.shared.tree import map_tensors

Foo = namedtuple("Foo", ["bar", "baz"])


@dataclasses.dataclass
class Feature:
    input_ids: torch.Tensor
    segment_ids: torch.Tensor


@dataclasses.dataclass
class ModelExample:
    example_ids: list
    feature: Feature
    label: torch.Tensor
    some_constant: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.some_constant = 7


@dataclasses.dataclass
class WithClassVar:
    class_var: ClassVar[int] = 0
    dummy: Any


@dataclasses.dataclass
class WithInitVar:
    dummy: Any
    override: InitVar[Any | None] = None

    def __post_init__(self, override: Any | None) -> None:
        if override is not None:
            self.dummy = override


_CLASS_TENSOR = torch.tensor(0)


@dataclasses.dataclass
class WithClassAndInitVar:
    class_var: ClassVar[torch.Tensor] = _CLASS_TENSOR
    dummy: Any
    override: InitVar[Any | None] = torch.tensor(1)

    def __post_init__(self, override: Any | None) -> None:
        if override is not None:
            self.dummy = override


class CustomCollection(dict):
    def __init__(self, initial: dict) -> None:
        super().__init__(initial)


def on_meta(obj: Any) -> bool:
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return bool(found) and all(t.device.type == "meta" for t in found)


def example() -> ModelExample:
    return ModelExample(["i-1", "i-2", "i-3"], Feature(torch.tensor([1.0, 2.0]), torch.tensor([4.0, 5.0])),
                        torch.tensor([7.0, 8.0]))


def test_every_kind_in_one_collection_moves_and_keeps_its_type():
    batch = {
        "tensor": torch.tensor([1.0]),
        "list": [torch.tensor([2.0])],
        "tuple": (torch.tensor([100.0]),),
        "named": Foo(bar=5.0, baz=10.0),
        "str": "this_is_a_dummy_str",
        "number": 12.0,
        "dataclass": Feature(torch.tensor([1.0, 2.0]), torch.tensor([4.0, 5.0])),
        "nested": example(),
        "classvar": WithClassVar(torch.arange(3)),
        "initvar": WithInitVar("this_gets_overridden", torch.tensor([2.0])),
        "both": WithClassAndInitVar(example(), None),
    }
    out = tp.to_device(batch, "meta")
    assert type(out) is dict and list(out) == list(batch)
    assert all(type(out[k]) is type(v) for k, v in batch.items())
    for key in ("tensor", "list", "tuple", "dataclass", "nested", "classvar", "initvar", "both"):
        assert on_meta(out[key]), key
    assert out["named"] == Foo(5.0, 10.0) and out["str"] == batch["str"] and out["number"] == 12.0
    assert out["nested"].example_ids == ["i-1", "i-2", "i-3"] and out["nested"].some_constant == 7
    assert out["initvar"].dummy.shape == (1,)  # the InitVar is not applied again
    assert type(out["both"].dummy) is ModelExample and out["both"].dummy.some_constant == 7
    assert WithClassVar.class_var == 0 and WithClassAndInitVar.class_var is _CLASS_TENSOR  # class state untouched
    assert not on_meta(batch)  # and the input too


@pytest.mark.parametrize("make", [
    lambda t: {"a": t, "b": 2},
    lambda t: OrderedDict([("b", t), ("a", 1)]),
    lambda t: CustomCollection({"a": t, "b": 2}),
    lambda t: defaultdict(int, {"a": t, "b": 2}),
    lambda t: Foo(bar=t, baz=5),
], ids=["dict", "OrderedDict", "dict-subclass", "defaultdict", "namedtuple"])
def test_the_collection_type_is_kept(make):
    original = make(torch.ones(2))
    out = tp.to_device(original, "meta")
    assert type(out) is type(original) and on_meta(out)
    if isinstance(original, dict):
        assert list(out) == list(original)
    if isinstance(original, defaultdict):
        assert out.default_factory is int


@dataclasses.dataclass(frozen=True)
class FrozenFoo:
    var: torch.Tensor


@pytest.mark.xfail(strict=True, reason="deliberate: frozen dataclasses are moved, not refused")
def test_difference_a_frozen_dataclass_is_refused():
    # lightning-utilities raises ValueError ("frozen dataclass was passed") unless allow_frozen=True
    with pytest.raises(ValueError, match="frozen dataclass"):
        tp.to_device(FrozenFoo(torch.tensor(0)), "meta")


def test_a_frozen_dataclass_is_moved_into_a_new_frozen_one():
    foo = FrozenFoo(torch.tensor(0))
    out = tp.to_device(foo, "meta")
    assert type(out) is FrozenFoo and out.var.device.type == "meta" and foo.var.device.type == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.var = torch.tensor(1)  # type: ignore[misc]


def test_nothing_to_move_in_a_frozen_dataclass_gives_it_back():
    foo = FrozenFoo(torch.tensor(0))
    assert tp.to_device(foo, "cpu") is foo


@dataclasses.dataclass
class WithCache:
    var: torch.Tensor

    @cached_property
    def cached(self) -> torch.Tensor:
        return self.var * 2


def test_a_cached_property_is_computed_from_the_moved_fields():
    foo = WithCache(torch.tensor(1))
    assert torch.equal(foo.cached, torch.tensor(2))
    out = tp.to_device(foo, "meta")
    assert out.var.device.type == "meta" and out.cached.device.type == "meta"
    assert foo.cached.device.type == "cpu"


def test_agrees_with_apply_to_collection_used_as_a_mover():
    apply_func = pytest.importorskip("lightning_utilities.core.apply_func")
    batch = {"a": [torch.ones(2), (torch.zeros(1), "s")], "b": Feature(torch.ones(1), torch.ones(2)),
             "c": OrderedDict(x=torch.ones(3)), "d": Foo(torch.ones(1), 3)}
    theirs = apply_func.apply_to_collection(batch, torch.Tensor, lambda t: t.to("meta"))
    ours = tp.to_device(batch, "meta")

    def shape(obj: Any) -> Any:
        return map_tensors(obj, lambda t: (t.device.type, tuple(t.shape), t.dtype))

    assert shape(ours) == shape(theirs)
    assert type(ours["b"]) is type(theirs["b"]) and type(ours["c"]) is type(theirs["c"])
