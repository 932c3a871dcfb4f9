"""Non-tensor state survives exactly, types included; what needs pickle is refused by name."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchplace
from torchplace.checkpoint import codec


def _roundtrip(tree: object) -> object:
    enc = codec.encode(tree)
    return codec.decode(enc.tree, enc.tensors.__getitem__)


def _same(a: object, b: object) -> bool:
    """Equal values of the same types, all the way down (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                   st.text(max_size=8), st.binary(max_size=8),
                   st.sampled_from([torch.float32, torch.bfloat16, torch.device("cpu"), torch.device("cuda", 1),
                                    torch.Size([2, 3])]))
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.tuples(st.integers(0, 3), st.text(max_size=3)))
trees = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
    st.dictionaries(keys, inner, max_size=4)), max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_any_plain_tree_round_trips_with_its_types(tree: object) -> None:
    assert _same(_roundtrip(tree), tree)


def test_training_state_shapes_round_trip() -> None:
    rng_state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    tree = {
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None}]},
        "plateau": {"best": float("inf"), "mode_worse": -math.inf, "eps": 1e-8},
        "rng": rng_state,
        "np": {"scalar": np.float32(0.5), "int": np.int64(7), "array": np.arange(6, dtype=np.uint32).reshape(2, 3)},
    }
    back = _roundtrip(tree)
    assert _same(back["optimizer"], tree["optimizer"])
    assert back["plateau"]["best"] == math.inf and back["plateau"]["mode_worse"] == -math.inf
    assert back["rng"]["python"] == rng_state["python"]
    assert _same(back["rng"]["numpy"], rng_state["numpy"])
    assert back["np"]["scalar"] == 0.5 and back["np"]["int"] == 7
    assert _same(back["np"]["array"], tree["np"]["array"])


class Config:
    def __init__(self) -> None:
        self.depth = 3


def test_objects_that_need_pickle_are_refused_by_path(tmp_path: Path) -> None:
    with pytest.raises(torchplace.CheckpointError, match=r"extra/run/cfg is a .*Config.*allow_pickle=True"):
        torchplace.save(tmp_path / "c", extra={"run": {"cfg": Config()}})
    assert not list(tmp_path.iterdir())


def test_allow_pickle_stores_them_and_load_needs_trust(tmp_path: Path) -> None:
    path = torchplace.save(tmp_path / "c", extra={"cfg": Config(), "step": 4}, allow_pickle=True)
    with pytest.raises(torchplace.CheckpointError, match=r"extra/cfg.*trust_pickle=True"):
        torchplace.load(path)
    ck = torchplace.load(path, trust_pickle=True)
    assert isinstance(ck.extra["cfg"], Config) and ck.extra["cfg"].depth == 3 and ck.extra["step"] == 4


def test_sparse_tensors_need_pickle_too(tmp_path: Path) -> None:
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(torchplace.CheckpointError, match=r"extra/m is a torch.sparse_coo Tensor.*Or: save under a .pt"):
        torchplace.save(tmp_path / "c", extra={"m": sparse})


def test_a_quantized_tensor_is_named_as_one_with_the_name_that_stores_it(tmp_path: Path) -> None:
    """A quantized model's packed weights were called 'a torch.strided Tensor', as if a dense one could not be saved."""
    qweight = torch.quantize_per_tensor(torch.randn(3, 3), 0.1, 0, torch.qint8)
    with pytest.raises(torchplace.CheckpointError, match=r"model/w is a quantized Tensor \(torch.qint8\).*\.pt name"):
        torchplace.save(tmp_path / "q.safetensors", model={"w": qweight})
    torchplace.save(tmp_path / "q.pt", model={"w": qweight})  # the name the message gives
    assert torch.equal(torchplace.load(tmp_path / "q.pt")["model"]["w"].int_repr(), qweight.int_repr())


def test_plain_lists_and_tuples_encode_as_themselves_and_nesting_is_still_bounded() -> None:
    state = random.getstate()  # 625 ints in a tuple: saved with every checkpoint
    enc = codec.encode({"python": state, "mixed": [1, "a", None, True, 2.5, math.inf]})
    assert enc.tree["v"][0][1] == {"t": "tuple", "v": [3, {"t": "tuple", "v": list(state[1])}, None]}
    assert _same(_roundtrip({"python": state, "mixed": [1, "a", None, True, 2.5, math.inf]}),
                 {"python": state, "mixed": [1, "a", None, True, 2.5, math.inf]})
    deep: list[object] = [1, 2]
    for _ in range(codec.MAX_NESTING):
        deep = [deep]
    with pytest.raises(torchplace.CheckpointError, match="nests containers more than"):
        codec.encode(deep)
