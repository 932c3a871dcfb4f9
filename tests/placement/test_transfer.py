"""to_device and the one traversal behind it, on real cpu and meta tensors."""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchplace as tp
from torchplace.errors import DeviceError
from torchplace.placement.transfer import _dense, _Mover, map_tensors, target_device


class Pair(NamedTuple):
    image: torch.Tensor
    label: Any


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    names: list
    n: int = 0


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    mask: torch.Tensor = dataclasses.field(init=False)
    calls: list = dataclasses.field(default_factory=list, compare=False)

    def __post_init__(self) -> None:
        self.calls.append("post_init")
        object.__setattr__(self, "mask", self.x > 0)


@dataclasses.dataclass(slots=True)
class Slotted:
    x: torch.Tensor
    tag: str = "s"


class Tagged(dict):
    """A dict subclass with an attribute, like HF's BatchEncoding keeps its extra state."""

    source = "tokenizer"


class Rows(list):
    pass


def nested() -> dict:
    dd = collections.defaultdict(list)
    dd["a"].append(torch.ones(2))
    return {
        "dict": {"x": torch.arange(6).view(2, 3), "s": "text", "n": 3, "f": 1.5, "none": None},
        "ordered": collections.OrderedDict([("b", torch.ones(1)), ("a", torch.zeros(1))]),
        "default": dd,
        "list": [torch.ones(3), b"raw", True],
        "tuple": (torch.full((2,), 7.0), 2),
        "named": Pair(torch.rand(3, 4, 4), 5),
        "data": Batch(torch.ones(2, 2), ["a", "b"], 4),
        "frozen": Frozen(torch.tensor([-1.0, 2.0])),
        "slots": Slotted(torch.ones(1)),
        "tagged": Tagged(ids=torch.ones(4, dtype=torch.long)),
        "rows": Rows([torch.zeros(2)]),
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
    }


def leaves(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return found


def test_every_structure_moves_to_meta_with_its_types_kept():
    batch = nested()
    out = tp.to_device(batch, "meta")
    assert all(t.device.type == "meta" for t in leaves(out))
    assert [(t.shape, t.dtype) for t in leaves(out)] == [(t.shape, t.dtype) for t in leaves(batch)]
    assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"]) == ["b", "a"]
    assert type(out["default"]) is collections.defaultdict and out["default"].default_factory is list
    assert type(out["named"]) is Pair and out["named"].label == 5
    assert type(out["data"]) is Batch and out["data"].names == ["a", "b"] and out["data"].n == 4
    assert type(out["slots"]) is Slotted and out["slots"].tag == "s"
    assert type(out["tagged"]) is Tagged and out["tagged"].source == "tokenizer"
    assert type(out["rows"]) is Rows
    assert out["dict"]["s"] == "text" and out["dict"]["none"] is None and out["list"][1:] == [b"raw", True]
    assert out["size"] is batch["size"] and out["device"] is batch["device"]


def test_frozen_dataclass_keeps_init_false_fields_and_does_not_rerun_post_init():
    frozen = Frozen(torch.tensor([-1.0, 2.0]))
    out = tp.to_device({"f": frozen}, "meta")["f"]
    assert type(out) is Frozen and out.mask.device.type == "meta" and out.mask.dtype == torch.bool
    assert frozen.calls == ["post_init"]  # one __post_init__, from the original construction
    assert frozen.x.device.type == "cpu"  # the original is untouched


def test_values_round_trip_through_the_same_traversal():
    batch = nested()
    copied = map_tensors(batch, lambda t: t.clone())
    originals, copies = leaves(batch), leaves(copied)
    assert len(copies) == len(originals) == 13
    for a, b in zip(originals, copies):
        assert torch.equal(a, b) and a is not b
    mask, copied_mask = batch["frozen"].mask, copied["frozen"].mask
    assert copied_mask is not mask and torch.equal(copied_mask, mask)


def test_nothing_to_move_returns_the_very_same_object():
    batch = nested()
    assert tp.to_device(batch, "cpu") is batch
    assert map_tensors(batch, lambda t: t) is batch


def test_a_tensor_alone_and_plain_values():
    t = torch.ones(2)
    assert tp.to_device(t, "meta").device.type == "meta"
    for value in ("s", 3, 2.5, None, b"x", True):
        assert tp.to_device(value, "meta") is value


class Moves:
    """An object with its own .to(), as in a user's batch class."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.device = torch.device("cpu")

    def to(self, device, non_blocking=False):
        self.calls.append((device, non_blocking))
        moved = Moves()
        moved.device = device
        return moved


class MovesInPlace(Moves):
    def to(self, device, non_blocking=False):  # type: ignore[override]
        self.calls.append((device, non_blocking))
        self.device = device
        return None


class OldStyle:
    def __init__(self) -> None:
        self.device = None

    def to(self, device):
        self.device = device
        return self


def test_object_with_its_own_to():
    obj = Moves()
    out = tp.to_device([obj], "meta")[0]
    assert isinstance(out, Moves) and out.device == torch.device("meta")
    assert obj.calls == [(torch.device("meta"), False)]


def test_a_to_that_returns_none_keeps_the_original():
    obj = MovesInPlace()
    out = tp.to_device({"o": obj}, "meta")
    assert out["o"] is obj and obj.device == torch.device("meta")


def test_a_to_without_non_blocking_is_called_without_it():
    obj = OldStyle()
    assert tp.to_device((obj,), "meta")[0] is obj and obj.device == torch.device("meta")


def test_a_module_in_the_batch_is_moved_with_its_own_to():
    out = tp.to_device({"m": torch.nn.Linear(2, 2)}, "meta")
    assert out["m"].weight.device.type == "meta"


def test_keywords_reach_every_depth():
    deep = Moves()
    batch = {"a": [({"b": Batch(torch.ones(1), [deep])},)]}
    tp.to_device(batch, "meta", non_blocking=True)
    assert deep.calls == [(torch.device("meta"), True)]


def test_copies_to_the_host_are_never_left_asynchronous_for_objects():
    obj = Moves()
    tp.to_device(obj, "cpu", non_blocking=True)
    assert obj.calls == [(torch.device("cpu"), False)]


@pytest.mark.parametrize("device,non_blocking,expected", [
    ("cuda:0", None, True),   # host -> GPU: asynchronous by default
    ("xpu:0", None, True),
    ("cpu", None, False),     # to the host: synchronous, the caller reads it at once
    ("mps:0", None, False),   # MPS: synchronous
    ("meta", None, False),
    ("cpu", True, True),      # asked for: issued together, synchronized once before returning
    ("cuda:0", False, False),
])
def test_non_blocking_policy(device, non_blocking, expected):
    mover = _Mover(torch.device(device), non_blocking)  # no backend is touched to decide
    assert mover.nb is expected
    assert mover.sync_dst is (torch.device(device).type in ("cpu", "mps"))


def test_meta_tensors_cannot_move_to_real_memory():
    with pytest.raises(DeviceError, match=r"meta tensor \(shape \(2, 3\).*to_empty"):
        tp.to_device({"w": torch.empty(2, 3, device="meta")}, "cpu")


def test_an_unsatisfiable_device_is_refused_before_anything_moves():
    with pytest.raises(DeviceError, match="cuda:7 requested"):
        tp.to_device({"x": torch.ones(1)}, "cuda:7")


def test_stable_specs_are_resolved_once():
    assert target_device("cpu") == torch.device("cpu") and target_device(torch.device("meta")) == torch.device("meta")
    assert target_device("auto").type in ("cpu", "cuda")


def test_other_mappings_and_sequences():
    proxy = types.MappingProxyType({"x": torch.ones(1)})
    out = tp.to_device(proxy, "meta")
    assert isinstance(out, types.MappingProxyType) and out["x"].device.type == "meta"
    result = torch.tensor([[1.0, 3.0], [4.0, 2.0]]).max(dim=1)  # a torch.return_types structseq
    moved = tp.to_device(result, "meta")
    assert type(moved) is type(result) and moved.values.device.type == "meta" and moved.indices.dtype == torch.long


def test_unknown_objects_pass_through():
    marker = object()
    gen = (i for i in range(3))
    out = tp.to_device({"o": marker, "g": gen, "set": {1, 2}}, "meta")
    assert out["o"] is marker and out["g"] is gen and out["set"] == {1, 2}


@pytest.mark.parametrize("make,dense", [
    (lambda: torch.ones(3, 4), True),
    (lambda: torch.ones(3, 4).t(), True),
    (lambda: torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last), True),
    (lambda: torch.ones(1, 1), True),
    (lambda: torch.ones(4, 6)[:, ::2], False),
    (lambda: torch.ones(3, 1).expand(3, 4), False),
])
def test_dense_layouts(make, dense):
    assert _dense(make()) is dense


# random nested batches: every container kind, any depth, tensors of several dtypes
_tensors = st.builds(lambda n, dtype: torch.arange(n).to(dtype), st.integers(0, 5),
                     st.sampled_from([torch.float32, torch.int64, torch.bool, torch.float16]))
_leaves = st.one_of(_tensors, st.integers(), st.text(max_size=3), st.none(), st.floats(allow_nan=False))
_batches = st.recursive(_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.lists(inner, max_size=4).map(tuple),
    st.dictionaries(st.text(max_size=3), inner, max_size=4),
    st.dictionaries(st.text(max_size=3), inner, max_size=4).map(collections.OrderedDict),
    st.tuples(inner, inner).map(lambda p: Pair(*p)),
    st.tuples(inner, st.lists(inner, max_size=2)).map(lambda p: Batch(p[0], p[1])),
), max_leaves=20)


def _shape(obj: Any) -> Any:
    """The structure of OBJ with each tensor replaced by (shape, dtype)."""
    return map_tensors(obj, lambda t: (tuple(t.shape), t.dtype))


@settings(max_examples=150, deadline=None)
@given(_batches)
def test_any_nested_batch_keeps_its_structure(batch):
    moved = tp.to_device(batch, "meta")
    assert all(t.device.type == "meta" for t in leaves(moved))
    assert _shape(moved) == _shape(batch)
    copied = map_tensors(batch, lambda t: t.clone())
    assert all(torch.equal(a, b) for a, b in zip(leaves(batch), leaves(copied)))
    assert tp.to_device(batch, "cpu") is batch
