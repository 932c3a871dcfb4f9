"""accelerate's `send_to_device` cases, re-expressed against `torchplace.to_device`.

Source of the cases: huggingface/accelerate, tests/test_utils.py (`test_send_to_device`,
`test_send_to_device_compiles`, `test_named_tuples`). Rewritten here in our own words, on the
cpu and meta devices. Deliberate differences are marked where they occur and listed in
docs/moving-data.md ("Beside accelerate and Lightning").
"""

from __future__ import annotations

from collections import UserDict, namedtuple
from typing import NamedTuple

import pytest
import torch

import torchplace as tp
from torchplace.shared.tree import map_tensors

Triple = namedtuple("Triple", "a b c")


def same_tensor_on(out: torch.Tensor, like: torch.Tensor, device: str) -> bool:
    """OUT is LIKE on DEVICE: same shape and dtype there (and the same values on the host)."""
    if out.device.type != device or out.shape != like.shape or out.dtype != like.dtype:
        return False
    return device == "meta" or torch.equal(out, like)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_lone_tensor(device):
    t = torch.randn(5, 2)
    assert same_tensor_on(tp.to_device(t, device), t, device)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_tuple_holding_a_list_and_a_number(device):
    t = torch.randn(5, 2)
    out = tp.to_device((t, [t, t], 1), device)
    assert type(out) is tuple and type(out[1]) is list and out[2] == 1
    assert all(same_tensor_on(x, t, device) for x in (out[0], *out[1]))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_dict_holding_a_list_and_a_number(device):
    t = torch.randn(5, 2)
    out = tp.to_device({"a": t, "b": [t, t], "c": 1}, device)
    assert type(out) is dict and type(out["b"]) is list and out["c"] == 1
    assert all(same_tensor_on(x, t, device) for x in (out["a"], *out["b"]))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_namedtuple_keeps_its_type_and_fields(device):
    t = torch.randn(5, 2)
    out = tp.to_device(Triple(a=t, b=[t, t], c=1), device)
    assert type(out) is Triple and type(out.b) is list and out.c == 1
    assert all(same_tensor_on(x, t, device) for x in (out.a, *out.b))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_userdict_stays_a_userdict(device):
    t = torch.randn(5, 2)
    batch = UserDict({"a": t, "b": [t, t], "c": 1})
    out = tp.to_device(batch, device)
    assert isinstance(out, UserDict) and type(out["b"]) is list and out["c"] == 1
    assert all(same_tensor_on(x, t, device) for x in (out["a"], *out["b"]))
    assert batch["a"] is t  # ours in addition: the caller's mapping is not written to


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta", torch.device("meta")])
def test_compiles_in_a_full_graph(device):
    # accelerate passes the string "cpu"; ours takes a torch.device, "cpu" or "meta" inside
    # compile (other specs need resolving first: see the test after this one)
    compiled = torch.compile(tp.to_device, fullgraph=True, backend="eager")
    out = compiled(torch.zeros([1], dtype=torch.bfloat16), device)
    assert out.device == torch.device(device) and out.dtype == torch.bfloat16


def test_difference_a_spec_to_resolve_is_refused_inside_compile():
    # Deliberate difference: accelerate hands any string to Tensor.to; "auto" or "cuda" would be
    # resolved by us (environment, LOCAL_RANK, visible devices), which cannot be traced.
    compiled = torch.compile(lambda x: tp.to_device(x, "auto"), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"resolve it before compiling"):
        compiled(torch.zeros(1))


class QuantTensorBase(NamedTuple):
    value: torch.Tensor
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None


class Second(QuantTensorBase):
    pass


def test_typed_namedtuples_and_their_subclasses_are_rebuilt_as_themselves():
    point = namedtuple("Point", ["x", "y"])
    cases = [QuantTensorBase(torch.tensor(1.0), None, None), Second(torch.tensor(1.0), torch.ones(1), None),
             point(torch.ones(1), y=22)]
    for value in cases:
        out = tp.to_device(value, "meta")
        assert type(out) is type(value) and len(out) == len(value) and out[0].device.type == "meta"
        assert [type(x) for x in out] == [type(x) for x in value]
    assert tp.to_device((1, 2), "meta") == (1, 2)
    assert tp.to_device("hey", "meta") == "hey"


def _shape(obj):
    return map_tensors(obj, lambda x: (x.device.type, tuple(x.shape), x.dtype))


def test_agrees_with_send_to_device_on_the_same_batch():
    operations = pytest.importorskip("accelerate.utils.operations")
    t = torch.randn(3)
    batch = {"a": t, "b": [t, (t, 1)], "c": Triple(t, "s", None), "d": UserDict(x=t)}
    ours, theirs = tp.to_device(batch, "meta"), operations.send_to_device(batch, torch.device("meta"))
    assert _shape(ours) == _shape(theirs)
