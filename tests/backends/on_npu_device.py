"""Device specs, scopes, leak guards, precision and setup() on the npu test back end."""

from __future__ import annotations

import threading

import pytest
import torch

import torchplace as tp
from torchplace.errors import DeviceError, DeviceLeakError, DeviceLeakWarning

pytestmark = pytest.mark.usefixtures("npu")


def test_the_back_end_is_what_torch_sees():
    assert torch.accelerator.current_accelerator() == torch.device("npu")
    assert torch.accelerator.device_count() == 2
    assert torch.get_device_module("npu").device_count() == 2


def test_device_resolves_npu_specs():
    assert tp.device("npu:1") == torch.device("npu", 1)
    assert tp.device("npu") == torch.device("npu", 0)
    assert tp.device(torch.device("npu", 1)) == torch.device("npu", 1)


def test_auto_and_ints_choose_npu_where_there_is_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("auto prefers cuda where there is one")
    assert tp.device("auto") == torch.device("npu", 0)
    assert tp.device(1) == torch.device("npu", 1)


def test_auto_follows_local_rank(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("auto prefers cuda where there is one")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert tp.device("auto") == torch.device("npu", 1)


def test_errors_list_what_exists():
    with pytest.raises(DeviceError,
                       match=r"(?s)npu:2 requested, but 2 npu device\(s\) exist\. Available: cpu.*npu:0\.\.npu:1"):
        tp.device("npu:2")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match=r"cuda:0 requested.*"):
            tp.device("cuda:0")


def test_on_makes_npu_current_and_restores():
    mod = torch.npu
    assert mod.current_device() == 0
    with tp.on("npu:1") as dev:
        assert dev == torch.device("npu", 1)
        assert mod.current_device() == 1
        with tp.on("npu:0"):
            assert mod.current_device() == 0
        assert mod.current_device() == 1
    assert mod.current_device() == 0


def test_on_with_factories_allocates_on_npu():
    with tp.on("npu:1", factories=True):
        assert torch.zeros(2).device == torch.device("npu", 1)
    assert torch.zeros(2).device.type == "cpu"


def test_on_is_per_thread():
    seen = []
    with tp.on("npu:1"):
        t = threading.Thread(target=lambda: seen.append(torch.npu.current_device()))
        t.start()
        t.join()
    assert seen == [0]


def test_guard_catches_a_helper_that_leaks_the_npu_device():
    def helper():
        torch.npu.set_device(1)

    with pytest.warns(DeviceLeakWarning, match=r"(?s)from npu:0 to npu:1.*torch\.npu\.device"):
        with tp.guard():
            helper()
    assert torch.npu.current_device() == 0
    with pytest.raises(DeviceLeakError, match="npu:1"):
        tp.guard(helper, action="raise")()
    assert torch.npu.current_device() == 0


def test_precision_for_an_unknown_back_end():
    policy = tp.precision_for("npu:1")
    assert policy.dtype == torch.float32 and "npu" in policy.reason
    asked = tp.precision_for("npu:0", "bf16")
    assert asked.dtype == torch.bfloat16 and not asked.grad_scaler
    model = torch.nn.Linear(4, 2).to("npu:0")
    with asked.autocast():
        out = model(torch.randn(3, 4, device="npu:0"))
    assert out.dtype == torch.bfloat16 and out.device == torch.device("npu", 0)


def test_setup_chooses_npu(restore_threads):
    if torch.cuda.is_available():
        pytest.skip("auto prefers cuda where there is one")
    rt = tp.setup(seed=0)
    try:
        assert rt.device == torch.device("npu", 0)
        assert "npu" in rt.decisions[0]
        model = torch.nn.Linear(4, 2).to(rt.device)
        batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
        for x, y in rt.loader(batches):
            assert x.device == rt.device
            with rt.autocast():
                loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
    finally:
        rt.close()


def test_seed_reaches_the_npu_generators():
    tp.seed_everything(3)
    a = torch.randn(4, device="npu:1").cpu()
    tp.seed_everything(3)
    assert torch.equal(a, torch.randn(4, device="npu:1").cpu())
