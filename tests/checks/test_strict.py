"""strict(): each mistake is reported with its file and line; clean programs stay silent (cpu, meta)."""

from __future__ import annotations

import sys
import threading
import warnings

import pytest
import torch
from checks_programs import (
    Toy,
    amp_forward,
    at,
    batch_on,
    clean_inference,
    clean_training,
    cuda_without_index,
    forward_loss,
    init_on_meta,
    line_of,
    mask_without_device,
    module_cuda,
    restoring_helper,
    scoped_helper,
    to_cuda_device,
    to_cuda_string,
    zeros_on_cuda,
)
from torch import nn

import torchplace as tp
from torchplace.checks import StrictWarning, deferred
from torchplace.checks.implicit_device import implicit_device
from torchplace.checks.strict import config_from_env, disable, enable_from_env, make_config
from torchplace.errors import DeviceLeakWarning
from torchplace.shared import strict_switch

PLACEMENT = [
    (cuda_without_index, "cuda-no-index", "`t.cuda()`"),
    (to_cuda_string, "to-cuda", '`t.to("cuda")`'),
    (to_cuda_device, "to-cuda-device", '`t.to(torch.device("cuda"), non_blocking=True)`'),
]


def torch_goes_on(fn, *args):
    """After a warning, the call reaches CUDA: it works where there is one, torch refuses where not."""
    if torch.cuda.is_available():
        return fn(*args)
    expected = RuntimeError if torch.backends.cuda.is_built() else AssertionError
    with pytest.raises(expected):
        fn(*args)
    return None


@pytest.fixture
def silent():
    """Any warning is a test failure (no false alarms)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# placement that depends on the current device
@pytest.mark.parametrize("program, mark, code", PLACEMENT)
def test_implicit_placement_is_an_error_naming_code_and_line(program, mark, code):
    with pytest.raises(tp.DeviceError) as info, tp.strict():
        program(torch.ones(2))
    text = str(info.value)
    assert text.startswith(code) and at(mark) in text and "torchplace.device('cuda:0')" in text


def test_module_cuda_without_index_is_reported_once_as_a_warning():
    model = Toy()
    with pytest.warns(StrictWarning) as caught, tp.strict("warn"):
        torch_goes_on(module_cuda, model)
    assert len(caught) == 1  # not once more per parameter that Module.cuda moves
    assert caught[0].filename.endswith("checks_programs.py") and caught[0].lineno == line_of("module-cuda")
    assert "`model.cuda()`" in str(caught[0].message)


@pytest.mark.parametrize("program, mark, code", PLACEMENT)
def test_warn_mode_warns_at_the_users_line_and_goes_on(program, mark, code):
    with pytest.warns(StrictWarning, match="puts it on whatever cuda device") as caught, tp.strict("warn"):
        torch_goes_on(program, torch.ones(2))
    assert caught[0].lineno == line_of(mark)


def test_named_devices_and_dtypes_are_silent(silent):
    x, model = torch.ones(2), Toy()
    with tp.strict():
        moved = [x.to("cpu"), x.to("meta"), x.to(torch.float16), x.to(torch.ones(1, dtype=torch.float64)),
                 x.to(device="meta", dtype=torch.bfloat16), x.cpu(), model.to("meta").layers[0].proj.weight]
    assert [str(t.device) for t in moved] == ["cpu", "meta", "cpu", "cpu", "meta", "cpu", "meta"]


@pytest.mark.parametrize("spec, expected", [
    ("cuda", torch.device("cuda")), (torch.device("cuda"), torch.device("cuda")), ("xpu", torch.device("xpu")),
    ("cuda:1", None), (torch.device("cuda", 0), None), (0, None), ("cpu", None), ("meta", None), ("mps", None),
    (torch.float16, None), (None, None), ("not-a-device", None),
])
def test_implicit_device(spec, expected):
    assert implicit_device(spec) == expected


# factories, on request
def test_factory_without_device_is_reported_when_asked():
    with pytest.raises(tp.DeviceError) as info, tp.strict(factories=True):
        mask_without_device(3)
    assert "`torch.ones(n, n)`" in str(info.value) and at("factory-no-device") in str(info.value)
    assert torch._C._len_torch_function_stack() == 0


def test_factory_with_indexless_device_is_reported_when_asked():
    with pytest.raises(tp.DeviceError, match=at("factory-cuda")), tp.strict(factories="warn"):
        zeros_on_cuda(3)


def test_factories_are_not_checked_by_default(silent):
    with tp.strict():
        assert mask_without_device(2).device.type == "cpu"


def test_factory_check_stays_silent_on_clean_code(silent):
    x = torch.ones(3)
    with tp.strict(factories=True):
        made = [torch.zeros_like(x), torch.as_tensor(x), torch.ones(2, device="cpu"), scoped_helper()]
        losses = clean_training("cpu")  # AdamW's own step counters are torch's business
    assert [t.device.type for t in made] == ["cpu", "cpu", "cpu", "meta"] and len(losses) == 3


# current-device changes that leak out of a function
def test_leaked_default_device_names_function_and_line_and_is_restored():
    with pytest.raises(tp.DeviceLeakError) as info, tp.strict():
        init_on_meta()
    text = str(info.value)
    assert text.startswith("init_on_meta() changed the default device from cpu to meta")
    assert at("leak-default") in text and "restored cpu" in text
    assert torch.get_default_device() == torch.device("cpu")


def test_leak_is_caught_at_the_next_module_call_before_forward_runs():
    calls = []

    class Probe(nn.Module):
        def forward(self, x):
            calls.append(x.device)
            return x

    probe = Probe()
    with pytest.raises(tp.DeviceLeakError, match="init_on_meta"), tp.strict():
        init_on_meta()
        probe(torch.ones(1, device="cpu"))
    assert calls == []


def test_leak_in_warn_mode_warns_restores_and_goes_on():
    model = Toy()
    with pytest.warns(DeviceLeakWarning) as caught, tp.strict("warn"):
        init_on_meta()
        model(torch.ones(1, 8, device="cpu"))
        assert torch.zeros(1).device.type == "cpu"  # restored at the module call
    assert caught[0].lineno == line_of("leak-default")


def test_change_made_by_the_block_itself_is_named_as_such():
    model = Toy().to("meta")
    with pytest.raises(tp.DeviceLeakError, match=r"^code inside torchplace.strict\(\) changed the default") as info:
        with tp.strict():
            line = sys._getframe().f_lineno + 1
            torch.set_default_device("meta")
            model(torch.ones(1, 8))  # the block is still running: not judged here
    assert f"test_strict.py:{line}" in str(info.value)


def test_restored_scoped_and_still_running_changes_are_silent(silent):
    model = Toy()

    def main_like():  # sets the device for its own run, calls the model, restores before returning
        torch.set_default_device("meta")
        try:
            return model(torch.ones(1, 8, device="cpu"))
        finally:
            torch.set_default_device(None)

    with tp.strict():
        made = [restoring_helper(), scoped_helper(), main_like()]
    assert [t.device.type for t in made] == ["meta", "meta", "cpu"]


def test_leaks_off_leaves_the_change_alone():
    with tp.strict(leaks=False):
        init_on_meta()
    try:
        assert torch.get_default_device() == torch.device("meta")
    finally:
        torch.set_default_device(None)


def test_a_leak_during_another_error_is_only_a_warning():
    with pytest.raises(ValueError, match="boom"), pytest.warns(DeviceLeakWarning, match="init_on_meta"):
        with tp.strict():
            init_on_meta()
            raise ValueError("boom")


# autocast for the wrong device type
def test_autocast_around_tensors_of_another_device_type():
    model = Toy().to("meta")
    with pytest.raises(tp.DeviceMismatchError) as info, tp.strict():
        amp_forward(model, torch.ones(2, 8, device="meta"), "cpu")
    text = str(info.value)
    assert "turns on cpu autocast (bfloat16), but the tensors it wraps are on meta" in text
    assert at("autocast") in text and "device_type=x.device.type" in text


def test_autocast_warning_points_at_the_autocast_line():
    model = Toy().to("meta")
    with pytest.warns(StrictWarning, match="autocast") as caught, tp.strict("warn"):
        amp_forward(model, torch.ones(2, 8, device="meta"), "cpu")
    assert caught[0].lineno == line_of("autocast")


def test_autocast_on_the_right_device_or_disabled_is_silent(silent):
    model = Toy()
    with tp.strict():
        out = amp_forward(model, torch.ones(2, 8), "cpu")
        with torch.autocast("cpu", enabled=False):
            model.to("meta")(torch.ones(2, 8, device="meta"))
    assert out.dtype == torch.bfloat16


def test_autocast_blocks_without_modules_do_not_pile_up():
    with tp.strict():
        for _ in range(50):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.ones(2) * 2
        assert deferred.pending() == 1
        Toy()(torch.ones(1, 8))  # the pending check sees autocast is over and goes
        assert deferred.pending() == 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.ones(2) * 2
        assert deferred.pending() == 1
    assert deferred.pending() == 0  # strict mode is over: nothing left to run at module calls


# device mismatches
def test_mismatch_under_strict_names_the_module():
    model = Toy().to("meta")
    with pytest.raises(tp.DeviceMismatchError, match=r"inside module model\.layers\.0\.proj") as info:
        with tp.strict(model=model):
            forward_loss(model, batch_on("cpu"))
    assert info.value.report.culprits[0].origin.startswith("batch['x']")



class _Inputs:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class _ReadsAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, inputs: _Inputs) -> torch.Tensor:
        return self.proj(inputs.x)


class _Runner:
    def __init__(self, net: nn.Module) -> None:
        self.net = net

    def run(self, inputs: _Inputs) -> torch.Tensor:
        return self.net(inputs)


def test_mismatch_names_the_callers_variables_for_the_model_and_the_input():
    runner, sent1_inputs = _Runner(_ReadsAttribute().to("meta")), _Inputs(torch.zeros(2, 4))
    with pytest.raises(tp.DeviceMismatchError) as info:
        with tp.strict(model=runner.net):
            runner.run(sent1_inputs)
    assert "sent1_inputs.x" in str(info.value)  # the caller's name for `inputs`
    # no variable holds the model itself: its paths start where the code holds it, runner.net (a 'model:' line
    # said so under 'model.' paths before module paths started at the user's variable)
    assert "inside module runner.net.proj (Linear)" in str(info.value)

# syncs: torch's CUDA sync debug mode; a machine without CUDA has no host-device syncs
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU twin checks syncs on CUDA")
def test_syncs_without_cuda_change_nothing(silent):
    assert make_config("warn", syncs=True).syncs == "warn"
    with tp.strict(syncs=True):
        assert torch.ones(2).sum().item() == 2.0


# the clean programs
def test_clean_training_and_inference_are_silent_and_unchanged(silent):
    bare = clean_training("cpu")
    with tp.strict():
        checked = clean_training("cpu")
        out = clean_inference("cpu")
    assert checked == bare and out.shape == (2, 3)


# switching on and off
def test_off_means_torchs_own_functions():
    originals = (torch.nn.Module.to, torch.nn.Module.cuda, torch.autocast.__enter__)
    with tp.strict():
        assert "to" in vars(torch.Tensor) and torch.nn.Module.to is not originals[0]
    assert (torch.nn.Module.to, torch.nn.Module.cuda, torch.autocast.__enter__) == originals
    assert "to" not in vars(torch.Tensor) and strict_switch.active() is None


def test_strict_is_per_thread():
    seen = {}
    with tp.strict():
        worker = threading.Thread(target=lambda: seen.setdefault("worker", strict_switch.active()))
        worker.start()
        worker.join()
        seen["main"] = strict_switch.active()
    assert seen["worker"] is None and seen["main"] is not None


def test_inner_block_overrides_outer():
    with tp.strict():
        with pytest.warns(StrictWarning), tp.strict("warn"):
            torch_goes_on(cuda_without_index, torch.ones(1))
        with pytest.raises(tp.DeviceError):
            cuda_without_index(torch.ones(1))


def test_works_as_a_decorator_each_call_fresh():
    @tp.strict()
    def setup():
        init_on_meta()

    for _ in range(2):
        with pytest.raises(tp.DeviceLeakError):
            setup()


@pytest.mark.parametrize("kwargs, match", [
    ({"action": "loud"}, "use 'error'"), ({"placement": "maybe"}, "placement='maybe'"),
])
def test_bad_arguments_say_what_is_accepted(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tp.strict(**kwargs)


# the environment switch
@pytest.mark.parametrize("value, expected", [
    ("1", {"placement": "error", "factories": None}), ("warn", {"placement": "warn", "leaks": "warn"}),
    ("warn,factories", {"factories": "warn", "syncs": None}), ("error, syncs", {"syncs": "error"}),
    ("0", None), ("", None), (None, None),
])
def test_env_values(value, expected):
    config = config_from_env(value)
    if expected is None:
        assert config is None
    else:
        assert {k: getattr(config, k) for k in expected} == expected


def test_env_typo_says_what_is_accepted():
    with pytest.raises(tp.TorchplaceError, match=r"TORCHPLACE_STRICT='strcit'.*'warn'.*'factories'"):
        config_from_env("strcit")


def test_env_switch_covers_code_outside_any_block():
    model = Toy().to("meta")
    assert enable_from_env({"TORCHPLACE_STRICT": "1"}) is not None
    try:
        with pytest.raises(tp.DeviceMismatchError) as info:
            forward_loss(model, batch_on("cpu"))
        assert info.value.report.module == "model.layers.0.proj"  # no model given: the test's variable for it
        assert at("block") in str(info.value)
        with pytest.raises(tp.DeviceError, match=at("to-cuda")):
            to_cuda_string(torch.ones(1))
        with pytest.raises(tp.DeviceLeakError, match="init_on_meta"):
            init_on_meta()
            model(torch.ones(1, 8, device="meta"))
    finally:
        disable()
    assert strict_switch.active() is None and torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl


def test_env_switch_unset_does_nothing():
    assert enable_from_env({}) is None and strict_switch.active() is None
