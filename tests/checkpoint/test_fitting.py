"""A load torch refuses leaves the model as it was (checkpoint/fitting.py).

torch's load_state_dict copies every tensor that fits before it raises for missing, unexpected or
misshapen keys; the interop pass found tp.load refusing a checkpoint after overwriting the layers
that did fit. The rehearsal on a meta twin must agree with torch: refuse what torch refuses, load
what torch loads (version hooks included), and stay out of modules whose hooks have side effects.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace as tp
from torchplace.checkpoint import fitting
from torchplace.errors import CheckpointError


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model: nn.Module, snap: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("strict", [True, False])
def test_a_refused_load_leaves_every_weight_as_it_was(tmp_path: Path, strict: bool) -> None:
    tp.save(tmp_path / "c", model=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3)))
    other = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(3, 3)) if strict else \
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 4))  # strict=False still refuses another shape
    snap = _snapshot(other)
    with pytest.raises(CheckpointError, match="left as it was"):
        tp.load(tmp_path / "c", model=other, strict=strict)
    assert _same(other, snap)  # before: layer 0 had the checkpoint's weights


def test_the_rehearsal_agrees_with_torchs_version_hooks() -> None:
    """A BatchNorm state of version 1 has no num_batches_tracked; torch's hook fills it in and loads."""
    bn = nn.BatchNorm1d(3)
    old = OrderedDict((k, v) for k, v in bn.state_dict().items() if k != "num_batches_tracked")
    old._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    assert fitting.rehearse(nn.BatchNorm1d(3), old, strict_keys=True) is None
    nn.BatchNorm1d(3).load_state_dict(old, strict=True)  # what torch does with it
    new = OrderedDict(old)
    new._metadata = OrderedDict({"": {"version": 2}})  # type: ignore[attr-defined]
    refused = fitting.rehearse(nn.BatchNorm1d(3), new, strict_keys=True)
    assert refused is not None and "num_batches_tracked" in str(refused)


def test_modules_with_load_hooks_are_not_rehearsed_and_their_hooks_run_once() -> None:
    calls = []
    model = nn.Linear(2, 2)
    model.register_load_state_dict_post_hook(lambda module, keys: calls.append(1))
    state = nn.Linear(2, 2).state_dict()
    assert fitting.rehearse(model, state, strict_keys=True) is None  # not rehearsed
    model.load_state_dict(state)
    assert calls == [1]


def test_the_rehearsal_changes_nothing_and_moves_no_data() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    snap = _snapshot(model)
    state = {k: torch.full_like(v, 7) for k, v in model.state_dict().items()}
    assert fitting.rehearse(model, state, strict_keys=True) is None
    assert _same(model, snap)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_named_module_that_does_not_fit_is_left_as_it_was(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    tp.save(tmp_path / "c", model=model, ema=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3)))
    ema = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(3, 3))
    snap = _snapshot(ema)
    with pytest.raises(CheckpointError, match="saved ema state does not fit"):
        tp.load(tmp_path / "c", model=nn.Linear(2, 2), ema=ema)
    assert _same(ema, snap)  # before: its first layer had the saved weights


class _ReadsItsScale(nn.Module):
    """A module whose own loading reads a saved value, which a meta tensor cannot give."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("scale", torch.tensor(2.0))

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:  # type: ignore[no-untyped-def]
        if float(state_dict[prefix + "scale"]) <= 0:
            raise ValueError("scale must be positive")
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_a_module_whose_loading_reads_values_is_not_refused_by_the_rehearsal(tmp_path: Path) -> None:
    # `.item()` on a meta tensor raises a RuntimeError of its own: no verdict, the real load decides
    model = _ReadsItsScale()
    assert fitting.rehearse(model, model.state_dict(), strict_keys=True) is None
    path = tmp_path / "m.pt"
    tp.save(path, model=model)
    fresh = _ReadsItsScale()
    tp.load(path, model=fresh)
    assert torch.equal(fresh.lin.weight, model.lin.weight)


def test_a_quantized_module_loads_as_torch_loads_it() -> None:
    q = torch.ao.nn.quantized.Linear(4, 4)
    assert fitting.rehearse(q, q.state_dict(), strict_keys=True) is None
    assert isinstance(fitting.rehearse(nn.Linear(2, 2), {"weight": torch.ones(3, 3)}, strict_keys=False), RuntimeError)


def test_the_twin_shares_what_a_module_holds_besides_its_tensors() -> None:
    # a LightningModule's dataset, a cached table: copying them for every load would double them
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[0].table = [torch.ones(3)] * 4
    model.lock = __import__("threading").Lock()  # deepcopy refuses a lock: no rehearsal before
    twin = fitting._meta_twin(model)
    assert twin is not None and twin[0].table is model[0].table and twin.lock is model.lock
    assert twin[0].weight.is_meta and twin[1].running_mean.is_meta and twin[0] is not model[0]
    assert isinstance(fitting.rehearse(model, {"0.weight": torch.ones(3, 3)}, strict_keys=False), RuntimeError)
    assert fitting.rehearse(model, model.state_dict(), strict_keys=True) is None


def test_values_torch_cannot_shape_on_meta_are_passed_as_they_are() -> None:
    # a quantized conv saves its weight as a quantized tensor: empty_like(..., device="meta") raised
    # NotImplementedError (a RuntimeError), and the load was refused as not fitting
    conv = torch.ao.nn.quantized.Conv2d(2, 2, 1)
    state = conv.state_dict()
    assert any(isinstance(v, torch.Tensor) and v.is_quantized for v in state.values())
    assert fitting.rehearse(conv, state, strict_keys=True) is None
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert fitting._shell(nested) is nested and fitting._shell(torch.ones(2)).is_meta


def test_a_module_holding_a_quantized_buffer_is_not_rehearsed_and_loads() -> None:
    """torch has no meta kernel to shape a quantized tensor: making the twin must not raise."""
    model = nn.Module()
    model.register_buffer("q", torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8))
    state = {"q": torch.quantize_per_tensor(torch.full((3,), 2.0), 0.1, 0, torch.qint8)}
    assert fitting.rehearse(model, state, strict_keys=True) is None
    model.load_state_dict(state)
    assert torch.equal(model.q.dequantize(), torch.full((3,), 2.0))


class _Shared(nn.Module):
    """One block under two names, and a head tied to the embedding: torch loads each name of each."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.block = nn.Linear(3, 3)
        self.again = self.block
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def test_the_verdict_from_keys_and_shapes_agrees_with_torch_without_a_twin() -> None:
    model = _Shared()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert fitting._plainly_fits(model, sd) and fitting.rehearse(model, sd, strict_keys=True) is None
    misshapen = {**sd, "block.weight": torch.ones(2, 3)}
    assert not fitting._plainly_fits(model, misshapen)
    assert isinstance(fitting.rehearse(model, misshapen, strict_keys=False), RuntimeError)
    lacking = {k: v for k, v in sd.items() if k != "again.bias"}  # the shared block's second name is loaded too
    assert not fitting._plainly_fits(model, lacking)
    assert isinstance(fitting.rehearse(model, lacking, strict_keys=True), RuntimeError)
    assert fitting.rehearse(model, lacking, strict_keys=False) is None
    extra = {**sd, "cache": torch.zeros(2)}  # a non-persistent buffer is not loaded: unexpected
    assert not fitting._plainly_fits(model, extra)
    assert isinstance(fitting.rehearse(model, extra, strict_keys=True), RuntimeError)
    assert not fitting._plainly_fits(nn.BatchNorm1d(3), nn.BatchNorm1d(3).state_dict())  # loads its own way
