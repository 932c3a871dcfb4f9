"""to_device and the one traversal behind it, on real cpu and meta tensors."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import functools
import types
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_calls import RecordStreamCalls  # tests/torch_calls.py (pythonpath = tests)

import torchplace as tp
from torchplace.errors import DeviceError
from torchplace.placement import record_stream, target_device
from torchplace.placement.transfer import _dense, _Mover
from torchplace.shared.tree import map_tensors


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


def test_record_stream_reaches_every_nested_device_tensor():
    """Each device tensor at any depth is marked once with the stream (torchtnt's helper missed
    nested ones), inside objects with their own .to() too; host tensors are left alone."""
    batch = tp.to_device(nested(), "meta")  # meta: a device other than the host, on any machine
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    batch["packed"] = torch.nn.utils.rnn.PackedSequence(packed.data.to("meta"), packed.batch_sizes)
    batch["host"] = [torch.ones(2)]
    stream = torch.Stream(device="cpu")
    with RecordStreamCalls(run=False) as calls:
        record_stream(batch, stream)
    on_device = [t for t in leaves(batch) if t.device.type == "meta"]
    assert len(on_device) == 13 + 1  # nested()'s tensors and the packed data; not batch_sizes or host
    assert [id(t) for t, _ in calls.marked] == [id(t) for t in on_device]
    assert all(s is stream for _, s in calls.marked)
    deep = [batch["default"]["a"][0], batch["named"].image, batch["frozen"].mask, batch["slots"].x,
            batch["tagged"]["ids"], batch["rows"][0], batch["packed"].data]
    assert all(any(t is m for m, _ in calls.marked) for t in deep)


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


# --- objects with their own .to() (issue 15, item 3) ------------------------------------------

def test_a_packed_sequence_is_moved_by_its_own_to_and_keeps_batch_sizes_on_the_host():
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    out = tp.to_device({"seq": packed}, "meta")["seq"]
    assert type(out) is torch.nn.utils.rnn.PackedSequence
    assert out.data.device.type == "meta" and out.batch_sizes.device.type == "cpu"
    lstm = torch.nn.LSTM(2, 3).to("meta")
    assert lstm(out)[0].data.shape == (5, 3)  # an LSTM refuses batch_sizes off the host


def test_a_tensordict_with_a_device_is_moved_by_its_own_to():
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"x": torch.ones(2, 3), "y": {"z": torch.zeros(2)}}, batch_size=[2], device="cpu")
    out = tp.to_device([td], "meta")[0]
    assert isinstance(out, tensordict.TensorDict) and out.device == torch.device("meta")
    assert out.batch_size == torch.Size([2]) and out["y", "z"].device.type == "meta"
    assert td.device == torch.device("cpu") and td["x"].device.type == "cpu"


@dataclasses.dataclass
class WithTo:
    x: torch.Tensor
    moved_by: str = "walk"

    def to(self, device, non_blocking=False):
        return WithTo(self.x.to(device), "own to")


class TupleWithTo(NamedTuple):
    x: torch.Tensor

    def to(self, device, non_blocking=False):
        return TupleWithTo(self.x.to(device) + 1)


def test_an_own_to_wins_over_taking_a_dataclass_or_namedtuple_apart():
    out = tp.to_device({"d": WithTo(torch.ones(1)), "t": TupleWithTo(torch.zeros(1))}, "meta")
    assert out["d"].moved_by == "own to" and out["d"].x.device.type == "meta"
    assert type(out["t"]) is TupleWithTo and out["t"].x.device.type == "meta"


def test_traversals_without_a_mover_still_reach_tensors_inside_objects_with_to():
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    assert len(leaves({"seq": packed})) == 2  # data and batch_sizes (sorted input: no index tensors)
    assert leaves(WithTo(torch.ones(1)))[0].shape == (1,)


def test_a_module_moves_in_place_as_its_own_to_does():
    module = torch.nn.Linear(2, 2)
    out = tp.to_device({"m": module}, "meta")
    assert out["m"] is module and module.weight.device.type == "meta"


# --- the input is never changed (items 4, 5, 6) ------------------------------------------------

class Store(collections.abc.MutableMapping):
    """A mapping over an inner dict, as many batch classes are: a shallow copy shares that dict."""

    def __init__(self, items=None) -> None:
        self._items = dict(items or {})

    def __getitem__(self, key):
        return self._items[key]

    def __setitem__(self, key, value) -> None:
        self._items[key] = value

    def __delitem__(self, key) -> None:
        del self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class NeedsName(Store):
    def __init__(self, name, items=None) -> None:
        super().__init__(items)
        self.name = name


class ReadOnly(dict):
    def __setitem__(self, key, value):
        raise TypeError("ReadOnly does not support item assignment")


def test_a_custom_mutable_mapping_is_rebuilt_not_written_to():
    batch = Store({"x": torch.ones(2), "n": 1})
    out = tp.to_device(batch, "meta")
    assert type(out) is Store and out["x"].device.type == "meta" and out["n"] == 1
    assert batch["x"].device.type == "cpu"


def test_a_mapping_whose_constructor_wants_more_comes_back_as_a_dict():
    batch = NeedsName("b", {"x": torch.ones(2)})
    out = tp.to_device(batch, "meta")
    assert type(out) is dict and out["x"].device.type == "meta"
    assert batch["x"].device.type == "cpu"


def test_a_dict_subclass_that_refuses_item_assignment():
    batch = ReadOnly(x=torch.ones(2), label="a")
    out = tp.to_device(batch, "meta")
    assert type(out) is ReadOnly and out["x"].device.type == "meta" and out["label"] == "a"
    assert batch["x"].device.type == "cpu"


def test_no_container_of_the_input_is_changed():
    user = collections.UserDict(x=torch.ones(1))
    tagged = Tagged(x=torch.ones(1))
    tagged.extra = "kept"
    rows = Rows([torch.ones(1)])
    data = Batch(torch.ones(1), [torch.ones(1)])
    batch = {"user": user, "tagged": tagged, "rows": rows, "data": data}
    out = tp.to_device(batch, "meta")
    assert all(t.device.type == "meta" for t in leaves(out))
    assert all(t.device.type == "cpu" for t in leaves(batch))
    assert type(out["user"]) is collections.UserDict and out["tagged"].extra == "kept"
    assert type(out["rows"]) is Rows and out["data"] is not data


@dataclasses.dataclass
class Cached:
    x: torch.Tensor

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.x * 2


def test_a_cached_property_computed_before_the_move_is_computed_again_after_it():
    batch = Cached(torch.ones(2))
    assert batch.doubled.device.type == "cpu"
    out = tp.to_device(batch, "meta")
    assert out.doubled.device.type == "meta" and out.x.device.type == "meta"
    assert batch.doubled.device.type == "cpu"  # the original keeps its own


# --- tuple subclasses (item 9) ------------------------------------------------------------------

class Spread(tuple):
    """A tuple subclass whose constructor takes the items as separate arguments."""

    def __new__(cls, *items):
        return super().__new__(cls, items)


class FromIterable(tuple):
    pass


class Fixed(tuple):
    def __new__(cls, first, second, *, tag):
        return super().__new__(cls, (first, second))


def test_tuple_subclasses_keep_their_items_and_type():
    spread = tp.to_device(Spread(torch.ones(1), 2), "meta")
    assert type(spread) is Spread and len(spread) == 2 and spread[0].device.type == "meta" and spread[1] == 2
    plain = tp.to_device(FromIterable([torch.ones(1), 2]), "meta")
    assert type(plain) is FromIterable and len(plain) == 2 and plain[0].device.type == "meta"
    fixed = tp.to_device(Fixed(torch.ones(1), 2, tag="t"), "meta")  # neither form works: a plain tuple
    assert type(fixed) is tuple and fixed[0].device.type == "meta" and fixed[1] == 2


# --- torch.compile (item 8) ---------------------------------------------------------------------

@pytest.mark.parametrize("device", [torch.device("meta"), torch.device("cpu"), "cpu", "meta"])
def test_to_device_traces_in_a_full_graph(device):
    def step(x):
        return tp.to_device({"x": x, "pair": Pair(x, 1), "list": [x * 2]}, device)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    out = compiled(torch.zeros(3, dtype=torch.bfloat16))
    assert out["x"].device == torch.device(device) and type(out["pair"]) is Pair and out["pair"].label == 1


def test_a_spec_that_needs_resolving_is_refused_inside_compile_with_the_fix():
    compiled = torch.compile(lambda x: tp.to_device(x, "auto"), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"torchplace.device\('auto'\)"):
        compiled(torch.zeros(1))
