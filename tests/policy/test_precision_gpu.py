"""On a GPU: the policy reads the real capability, and the first-step check catches CPU tensors
under CUDA autocast (the silent-fp32 trap) while a correct step passes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401 - the first dispatch mode imports it, and it writes TORCHINDUCTOR_CACHE_DIR

from torchplace import precision_for
from torchplace.errors import DeviceMismatchError, PrecisionWarning

pytestmark = pytest.mark.gpu


def test_policy_picks_bf16_from_the_real_capability():
    capability = torch.cuda.get_device_capability(0)
    if capability < (8, 0):
        pytest.skip(f"needs compute capability 8.0+ (this GPU has {capability})")
    policy = precision_for("cuda:0")
    assert policy.device == torch.device("cuda", 0) and policy.capability == tuple(capability)
    assert policy.dtype == torch.bfloat16 and not policy.grad_scaler and policy.tf32
    assert torch.cuda.get_device_name(0) in policy.reason


def test_a_correct_cuda_step_passes_the_check():
    policy = precision_for("cuda:0")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to("cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        with policy.autocast():
            out = model(torch.randn(32, 64, device="cuda:0"))
    assert out.dtype == policy.dtype
    check = policy.last_check
    assert check.ok and check.matmuls_by_dtype.get(str(policy.dtype).removeprefix("torch."), 0) == 2


def test_cpu_tensors_under_cuda_autocast_are_caught():
    policy = precision_for("cuda:0", "bf16")
    model = torch.nn.Linear(64, 8)  # forgotten on the CPU
    with pytest.warns(PrecisionWarning, match=r"cuda autocast.*on cpu.*none of the"):
        with policy.autocast():
            out = model(torch.randn(32, 64))
    assert out.dtype == torch.float32  # what the user silently got
    assert policy.last_check.wrong_device_count >= 1 and policy.last_check.low_precision_ops == 0
    strict = precision_for("cuda:0", "bf16", strict=True)
    with pytest.raises(DeviceMismatchError, match="on cpu"):
        with strict.autocast():
            model(torch.randn(32, 64))


def test_fp16_policy_scales_gradients():
    policy = precision_for("cuda:0", "fp16")
    model = torch.nn.Linear(64, 1).to("cuda:0")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = policy.make_grad_scaler()
    assert scaler.is_enabled()
    with policy.autocast():
        loss = model(torch.randn(16, 64, device="cuda:0")).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert policy.last_check.ok and scaler.get_scale() > 0
