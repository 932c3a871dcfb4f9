"""First-contact mistakes with save/load's and DeviceLoader's arguments get a TypeError that names
what was passed and the call that works, before anything is read, written or moved (found by the
new-user pass: load(model=[m]) raised AttributeError 'list' object has no attribute 'parameters',
DeviceLoader(None) failed only when iterated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace as tp


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return tp.save(tmp_path / "m.pt", model=nn.Linear(2, 2), rng_state=False)


@pytest.mark.parametrize("bad", [lambda m: [m], lambda m: (m,), lambda m: {"a": m}], ids=["list", "tuple", "dict"])
def test_several_modules_are_asked_for_by_name(saved: Path, tmp_path: Path, bad) -> None:
    m = nn.Linear(2, 2)
    before = m.weight.detach().clone()
    with pytest.raises(TypeError, match=r"model=model, ema=ema_model.*ModuleDict"):
        tp.load(saved, model=bad(m))
    assert torch.equal(m.weight, before)
    with pytest.raises(TypeError, match=r"save\(path, model=model, ema=ema_model\)"):
        tp.save(tmp_path / "x.pt", model=bad(m))
    assert not (tmp_path / "x.pt").exists()


def test_a_state_dict_is_not_a_model_to_fill(saved: Path) -> None:
    with pytest.raises(TypeError, match=r"a state dict\?.*ck\['model'\]"):
        tp.load(saved, model=nn.Linear(2, 2).state_dict())
    assert set(tp.load(saved)["model"]) == {"weight", "bias"}  # the way the message names works


@pytest.mark.parametrize("bad", ["model", 5])
def test_other_objects_name_their_type_and_the_fix(saved: Path, bad) -> None:
    with pytest.raises(TypeError, match=rf"got a {type(bad).__name__}\. Fix: pass the nn.Module to fill"):
        tp.load(saved, model=bad)


def test_a_wrapped_module_is_still_a_model(saved: Path) -> None:
    fresh = nn.Linear(2, 2)
    tp.load(saved, model=nn.DataParallel(fresh))
    assert torch.equal(fresh.weight, tp.load(saved)["model"]["weight"])


@pytest.mark.parametrize("bad", [None, 5, 2.5])
def test_device_loader_refuses_what_is_not_iterable_when_made(bad) -> None:
    with pytest.raises(TypeError, match=r"must be iterable.*DataLoader\(dataset, batch_size=\.\.\.\)"):
        tp.DeviceLoader(bad, "cpu")


def test_device_loader_refuses_a_transform_that_is_not_callable() -> None:
    with pytest.raises(TypeError, match=r"transform must be a function of the batch"):
        tp.DeviceLoader([torch.ones(1)], "cpu", transform=5)


def test_anything_iterable_is_still_a_loader() -> None:
    class Indexed:  # the old sequence protocol: __getitem__ until IndexError
        def __getitem__(self, i: int) -> torch.Tensor:
            if i >= 2:
                raise IndexError(i)
            return torch.full((1,), float(i))

    assert [t.item() for t in tp.DeviceLoader(Indexed(), "cpu")] == [0.0, 1.0]
    assert [t.item() for t in tp.DeviceLoader((torch.ones(1) for _ in range(2)), "cpu")] == [1.0, 1.0]


def test_loading_into_objects_on_the_meta_device_is_refused_before_anything_moves(saved: Path) -> None:
    """device="meta" moved the model to meta (its weights gone) and loaded the file's tensors as shapes only."""
    m = nn.Linear(2, 2)
    before = m.weight.detach().clone()
    said = r"device='meta', model=Linear\) asked to load into objects on the meta device.*no values.*Fix: load with " \
           r"device=\"cpu\".*load_state_dict\(state, assign=True\).*to_empty\(device=\"cpu\"\)"
    with pytest.raises(tp.DeviceError, match=said):
        tp.load(saved, model=m, device="meta")
    assert m.weight.device.type == "cpu" and torch.equal(m.weight, before)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(tp.DeviceError, match=r"model=Linear, optimizer=SGD\) asked"):
        tp.load(saved, model=m, optimizer=opt, device=torch.device("meta"))
    with torch.device("meta"):
        shapes_only = nn.Linear(2, 2)
    with pytest.raises(tp.DeviceError, match="meta device"):
        tp.load(saved, model=shapes_only, device="meta")
    tp.load(saved, model=shapes_only, device="cpu")  # the fix the message gives
    assert shapes_only.weight.device.type == "cpu" and shapes_only.weight.shape == (2, 2)


@pytest.mark.parametrize(("arg", "fix"), [("map_location", r"device='cpu'"), ("weights_only", "trust_pickle")])
def test_torch_loads_own_arguments_get_torchplaces_way(saved: Path, arg: str, fix: str) -> None:
    """A drop-in `tp.load(path, map_location="cpu")` was told to read ck['map_location'] from the result."""
    with pytest.raises(TypeError, match=rf"{arg}=.*an argument of torch.load.*Fix: .*{fix}"):
        tp.load(saved, model=nn.Linear(2, 2), **{arg: "cpu" if arg == "map_location" else True})


def test_load_state_dict_of_a_checkpoint_names_the_fix(saved: Path) -> None:
    """`model.load_state_dict(tp.load(path))`, the torch.load idiom: torch said only 'Expected state_dict to be
    dict-like'; now the Checkpoint is a mapping of what the file holds, and load_state_dict is refused with the fix."""
    m = nn.Linear(2, 2)
    before = m.weight.detach().clone()
    ck = tp.load(saved)
    said = r"(?s)tp.load returns a Checkpoint .*'model'.*Fix: tp.load\(.*model=model"
    with pytest.raises(tp.CheckpointError, match=said):
        m.load_state_dict(ck)
    assert torch.equal(m.weight, before)
    m.load_state_dict(ck["model"])  # the message's other fix
    assert dict(ck.items()).keys() == set(ck.keys()) and len(ck) == len(ck.keys())


def test_an_open_file_is_asked_for_by_its_path(saved: Path, tmp_path: Path) -> None:
    """word_language_model's `with open(args.save, 'wb') as f: torch.save(model, f)` and `model = torch.load(f)`:
    tp.load said only 'expected str, bytes or os.PathLike object, not BufferedReader'."""
    m = nn.Linear(2, 2)
    with open(tmp_path / "w.pt", "wb") as f:
        for call in (tp.save, tp.save_async):
            with pytest.raises(TypeError, match=r"open file \(BufferedWriter\).*Fix: pass the path \('.*w.pt': f.name"):
                call(m, f)
    with open(saved, "rb") as f, pytest.raises(TypeError, match=r"open file \(BufferedReader\).*Fix: pass the path"):
        tp.load(f)
    with pytest.raises(AttributeError, match=r"no attribute 'eval': tp.load returns what m.pt holds .*Fix: build"):
        tp.load(saved).eval()  # `model = torch.load(f)` of a pickled module, ported
    assert not hasattr(tp.load(saved), "eval")
