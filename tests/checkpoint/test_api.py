"""save/load on the CPU: full round trips, wrappers and prefixes, devices, and clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace
from torchplace.checkpoint import format as fmt


def _train_a_bit(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_round_trip_cpu_to_cpu_restores_every_object(tmp_path: Path, make_net) -> None:
    model = make_net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", growth_interval=1)
    ema = make_net(5)
    _train_a_bit(model, opt)
    sched.step()
    path = torchplace.save(tmp_path / "ck.safetensors", model=model, optimizer=opt, scheduler=sched,
                           scaler=scaler, extra={"step": 2, "tags": ("a", "b")}, ema=ema, epoch=7)

    model2, ema2 = make_net(1), make_net(6)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu", growth_interval=1)
    ck = torchplace.load(path, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2, ema=ema2)

    _assert_same_state(model, model2)
    _assert_same_state(ema, ema2)
    assert ck.extra == {"step": 2, "tags": ("a", "b")} and ck["epoch"] == 7
    assert sched2.state_dict() == sched.state_dict()
    assert scaler2.state_dict() == scaler.state_dict()
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for pid, entry in s1["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, s2["state"][pid][name]), (pid, name)
            assert s2["state"][pid][name].device.type == "cpu"
    assert ck.tool == "torchplace" and ck.missing_keys == [] and ck.unexpected_keys == []
    assert ck.rng_restored == ["python", "numpy", "cpu"]
    assert all(name.startswith("cuda:") for name in ck.rng_skipped)  # only if CUDA ran in this process
    meta = ck.metadata
    assert meta["torch_version"] == torch.__version__ and meta["world_size"] == 1
    assert meta["objects"]["optimizer"] == "torch.optim.adamw.AdamW"
    assert meta["devices"]["default"] == "cpu" and meta["primary_device"] == "cpu"


def test_wrappers_are_peeled_on_save(tmp_path: Path, make_net) -> None:
    model = make_net(0)
    for wrapped in (nn.DataParallel(model), torch.compile(model), nn.DataParallel(torch.compile(model)),
                    torch.compile(nn.DataParallel(model))):
        path = torchplace.save(tmp_path / "w", model=wrapped, rng_state=False)
        keys = [e.key for e in fmt.read_header(path).entries]
        assert keys and all(k.startswith("model/") and "module." not in k and "_orig_mod." not in k for k in keys)
        target = make_net(3)
        torchplace.load(path, model=torch.compile(target))  # loading into a wrapper works too
        _assert_same_state(model, target)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module.",
                                    "module.module."])
def test_wrapper_prefixes_from_other_tools_are_stripped(tmp_path: Path, make_net, prefix: str) -> None:
    model = make_net(0)
    path = tmp_path / "other.pt"
    torch.save({prefix + k: v for k, v in model.state_dict().items()}, path)
    target = make_net(1)
    ck = torchplace.load(path, model=target)
    assert ck.stripped_prefix == prefix and ck.tool == "torch.save (state dict)"
    _assert_same_state(model, target)
    # without a model only torch.compile's `_orig_mod.` is unambiguous; `module.` may be a real submodule
    kept = prefix.replace("_orig_mod.", "")
    assert set(torchplace.load(path)["model"]) == {kept + k for k in model.state_dict()}


class Holder(nn.Module):
    """A model whose only child is really called `module`: its keys must be left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(3, 3)


def test_prefix_stripping_touches_nothing_else(tmp_path: Path) -> None:
    holder = Holder()
    path = tmp_path / "h.pt"
    torch.save(holder.state_dict(), path)
    target = Holder()
    ck = torchplace.load(path, model=target)
    assert ck.stripped_prefix == "" and torch.equal(target.module.weight, holder.module.weight)

    mixed = {"module.a": torch.ones(1), "b": torch.zeros(1)}  # not every key has it: nothing stripped
    torch.save(mixed, path)
    assert set(torchplace.load(path)["model"]) == {"module.a", "b"}
    inner = {"encoder.module.weight": torch.ones(1)}  # only leading prefixes count
    torch.save(inner, path)
    assert set(torchplace.load(path)["model"]) == {"encoder.module.weight"}


def test_optimizer_step_stays_on_cpu_and_state_follows_params(tmp_path: Path, make_net) -> None:
    model = make_net(0)
    opt = torch.optim.Adam(model.parameters())
    _train_a_bit(model, opt)
    path = torchplace.save(tmp_path / "c", model=model, optimizer=opt)
    model2 = make_net(1).to(torch.float64)
    opt2 = torch.optim.Adam(model2.parameters())
    torchplace.load(path, model=model2, optimizer=opt2)
    state = opt2.state_dict()["state"][0]
    assert state["step"].device.type == "cpu" and state["step"].dtype == torch.float32
    assert state["exp_avg"].dtype == torch.float64  # cast to the parameter, as load_state_dict does


def test_load_without_objects_returns_everything_on_the_device(tmp_path: Path, make_net) -> None:
    model = make_net(0)
    path = torchplace.save(tmp_path / "c", model=model, extra={"x": torch.arange(3)})
    ck = torchplace.load(path, device=torch.device("cpu"))
    assert all(t.device.type == "cpu" for t in ck["model"].values())
    assert torch.equal(ck.extra["x"], torch.arange(3))
    assert isinstance(ck["rng"]["cpu"], torch.Tensor)


def test_devices_that_do_not_exist_are_refused_before_anything_happens(tmp_path: Path, make_net) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = torchplace.save(tmp_path / "c", model=make_net(0))
    with pytest.raises(torchplace.DeviceError, match="cuda:3"):
        torchplace.load(path, device="cuda:3", model=make_net(1))


def test_mismatches_are_checkpoint_errors_that_say_what_to_do(tmp_path: Path, make_net) -> None:
    path = torchplace.save(tmp_path / "c", model=make_net(0))
    with pytest.raises(torchplace.CheckpointError,
                       match=r"has no optimizer state \(it holds: model, rng\)\. Fix: load it without optimizer="):
        model = make_net(1)
        torchplace.load(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(torchplace.CheckpointError, match=r"(?s)do not fit Linear.*strict=False"):
        torchplace.load(path, model=nn.Linear(8, 16))
    ck = torchplace.load(path, model=nn.Linear(8, 16), strict=False)
    assert "fc1.weight" in ck.unexpected_keys and "weight" in ck.missing_keys
    with pytest.raises(TypeError, match="reserved"):
        torchplace.save(tmp_path / "d", extra={}, rng="x")
    with pytest.raises(ValueError, match="keep_last=0"):
        torchplace.save(tmp_path / "d", extra={}, keep_last=0)
    with pytest.raises(torchplace.CheckpointError, match="does not exist"):
        torchplace.load(tmp_path / "missing.safetensors")


def test_a_shape_mismatch_names_the_tensors_and_does_not_suggest_strict_false(tmp_path: Path) -> None:
    """strict=False skips missing and unexpected keys; torch refuses another shape either way, so the
    message must not send the user there (issue 18: it did, and strict=False gave the same error)."""
    path = torchplace.save(tmp_path / "c", model=nn.Linear(4, 8))
    for strict in (True, False):
        with pytest.raises(torchplace.CheckpointError) as info:
            torchplace.load(path, model=nn.Linear(4, 6), strict=strict)
        message = str(info.value)
        assert "Fix: build the model with the configuration it was saved with: 2 tensor(s) have another shape " \
               "(weight saved [8, 4], model [6, 4]; bias saved [8], model [6])" in message
        assert "which strict=False does not skip" in message and "or strict=False to load" not in message
    state = torchplace.load(path)["model"]  # the way round it that the message gives
    del state["bias"]
    model = nn.Linear(4, 8)
    assert model.load_state_dict(state, strict=False).missing_keys == ["bias"]


def test_save_into_a_missing_directory_says_so(tmp_path: Path) -> None:
    with pytest.raises(torchplace.CheckpointError, match=r"directory .*nope does not exist.*os.makedirs"):
        torchplace.save(tmp_path / "nope" / "c", extra={"a": 1})


def test_printing_a_load_result_is_one_short_line(tmp_path):
    """print(ck) dumped every tensor of the model and optimizer state."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    torchplace.save(tmp_path / "c.tpck", model=model, optimizer=opt, extra={"epoch": 3})
    ck = torchplace.load(tmp_path / "c.tpck", model=model)
    text = repr(ck)
    assert "\n" not in text and len(text) < 300 and "tensor(" not in text, text
    assert "model (40 tensors, 325.0 KiB)" in text and "optimizer (120 tensors" in text and "extra (epoch)" in text
    assert str(ck) == text
