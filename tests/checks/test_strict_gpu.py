"""strict() on real GPUs: current-device placement, leaked set_device, autocast, syncs, mismatches."""

from __future__ import annotations

import math
import subprocess
import sys
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
    hot_loop,
    line_of,
    pick_gpu,
    to_cuda_string,
)

import torchplace as tp
from torchplace.checks import StrictWarning
from torchplace.checks.strict import disable, enable_from_env
from torchplace.errors import DeviceLeakWarning

pytestmark = pytest.mark.gpu
CUDA0, CUDA1 = torch.device("cuda:0"), torch.device("cuda:1")


@pytest.fixture(autouse=True)
def _device_zero():
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(0)


@pytest.fixture
def silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_cuda_without_index_names_line_and_current_device():
    with pytest.raises(tp.DeviceError) as info, tp.strict():
        cuda_without_index(torch.ones(2))
    assert at("cuda-no-index") in str(info.value) and "(cuda:0 at the moment)" in str(info.value)


def test_warn_mode_lands_on_the_current_device():
    with pytest.warns(StrictWarning) as caught, tp.strict("warn"):
        moved = to_cuda_string(torch.ones(2))
    assert moved.device == CUDA0 and caught[0].lineno == line_of("to-cuda")


@pytest.mark.multigpu
def test_named_devices_are_silent(silent):
    model = Toy()
    with tp.strict(factories=True):
        host = torch.ones(2, device="cpu")
        made = [host.cuda(0), host.to("cuda:1"), torch.zeros(2, device=CUDA1),
                model.to(CUDA1).head.weight, torch.ones(2, device="cpu")]
    assert [str(t.device) for t in made] == ["cuda:0", "cuda:1", "cuda:1", "cuda:1", "cpu"]


@pytest.mark.multigpu
def test_leaked_set_device_names_function_and_line_and_is_restored():
    with pytest.raises(tp.DeviceLeakError) as info, tp.strict():
        pick_gpu(1)
    text = str(info.value)
    assert text.startswith("pick_gpu() changed the current device from cuda:0 to cuda:1")
    assert at("leak-cuda") in text and torch.cuda.current_device() == 0


@pytest.mark.multigpu
def test_leak_is_caught_at_the_next_module_call():
    model = Toy().to(CUDA0)
    with pytest.warns(DeviceLeakWarning, match="pick_gpu") as caught, tp.strict("warn"):
        pick_gpu(1)
        assert torch.cuda.current_device() == 1
        model(torch.ones(1, 8, device=CUDA0))
        assert torch.cuda.current_device() == 0  # restored before forward ran
    assert caught[0].lineno == line_of("leak-cuda")


@pytest.mark.multigpu
def test_scopes_and_torch_cuda_device_are_not_leaks(silent):
    model = Toy().to(CUDA1)
    with tp.strict():
        with tp.on("cuda:1"):
            model(torch.ones(1, 8, device=CUDA1))
        with torch.cuda.device(1):
            model(torch.ones(1, 8, device=CUDA1))
        tp.guard(lambda: None)()
    assert torch.cuda.current_device() == 0


@pytest.mark.multigpu
def test_first_device_choice_of_a_process_is_not_a_leak():
    code = ("import torch, torchplace as tp\n"
            "def setup():\n    torch.cuda.set_device(1)\n"
            "with tp.strict():\n    setup()\n"
            "    torch.nn.Linear(2, 2).to('cuda:1')(torch.ones(1, 2, device='cuda:1'))\n"
            "print(torch.cuda.current_device())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_cuda_autocast_around_cpu_tensors():
    model = Toy()
    with pytest.raises(tp.DeviceMismatchError, match="turns on cuda autocast") as info, tp.strict():
        amp_forward(model, torch.ones(2, 8), "cuda")
    assert at("autocast") in str(info.value) and "on cpu" in str(info.value)


def test_cpu_autocast_around_gpu_tensors():
    model = Toy().to(CUDA0)
    with pytest.warns(StrictWarning, match="turns on cpu autocast.*on cuda:0"), tp.strict("warn"):
        amp_forward(model, torch.ones(2, 8, device=CUDA0), "cpu")


def test_matching_autocast_is_silent(silent):
    model = Toy().to(CUDA0)
    with tp.strict():
        out = amp_forward(model, torch.ones(2, 8, device=CUDA0), "cuda")
    assert out.dtype == torch.bfloat16


def test_sync_in_a_marked_hot_loop_raises_and_only_there():
    model = Toy().to(CUDA0)
    batches = [batch_on(CUDA0) for _ in range(2)]
    with pytest.raises(RuntimeError, match="synchroniz"), tp.strict(syncs=True):
        hot_loop(model, batches)
    assert torch.cuda.get_sync_debug_mode() == 0
    assert math.isfinite(hot_loop(model, batches))  # outside the block: allowed


def test_sync_warning_points_at_the_item_call():
    model = Toy().to(CUDA0)
    with pytest.warns(UserWarning, match="synchroniz") as caught, tp.strict(syncs="warn"):
        hot_loop(model, [batch_on(CUDA0)])
    assert any(w.lineno == line_of("sync") for w in caught)
    assert torch.cuda.get_sync_debug_mode() == 0


def test_mismatch_under_strict():
    model = Toy().to(CUDA0)
    with pytest.raises(tp.DeviceMismatchError, match=r"model\.layers\.0\.proj") as info:
        with tp.strict(model=model):
            forward_loss(model, batch_on("cpu"))
    assert info.value.report.culprits[0].device == "cpu"


def test_env_switch_on_a_gpu():
    model = Toy().to(CUDA0)
    enable_from_env({"TORCHPLACE_STRICT": "1"})
    try:
        with pytest.raises(tp.DeviceMismatchError, match=r"model\.layers\.0\.proj"):
            forward_loss(model, batch_on("cpu"))
        with pytest.raises(tp.DeviceError, match=at("to-cuda")):
            to_cuda_string(torch.ones(1))
    finally:
        disable()


def test_clean_gpu_training_and_inference_are_silent(silent):
    with tp.strict(factories=True):
        losses = clean_training(CUDA0)
        out = clean_inference(CUDA0)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses) and out.device == CUDA0
