"""Precision policy: every CUDA compute capability from snapshot records, the CPU from torch's own
queries, explicit requests, and the first-step autocast check on real CPU autocast."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401 - the first dispatch mode imports it, and it writes TORCHINDUCTOR_CACHE_DIR
from snapshots import load_snapshot_dict

from torchplace import precision_for
from torchplace.amp import cpu_features
from torchplace.checks.autocast import FirstStepCheck
from torchplace.errors import DeviceError, DeviceMismatchError, PrecisionError, PrecisionWarning
from torchplace.hardware.topology import Topology
from torchplace.policy.precision import decide_cpu, decide_cuda, normalize_dtype

# Every compute capability NVIDIA has shipped, with a GPU of it, and what the policy must pick:
# (dtype, GradScaler, TF32).
GPUS = [
    ("Tesla K80", (3, 7), ("float32", False, False)),
    ("Tesla M60", (5, 2), ("float32", False, False)),
    ("Jetson TX1", (5, 3), ("float16", True, False)),
    ("Tesla P100", (6, 0), ("float16", True, False)),
    ("GeForce GTX 1080", (6, 1), ("float32", False, False)),
    ("Jetson TX2", (6, 2), ("float16", True, False)),
    ("Tesla V100", (7, 0), ("float16", True, False)),
    ("Jetson AGX Xavier", (7, 2), ("float16", True, False)),
    ("Tesla T4", (7, 5), ("float16", True, False)),
    ("A100-SXM4-80GB", (8, 0), ("bfloat16", False, True)),
    ("A10", (8, 6), ("bfloat16", False, True)),
    ("Jetson AGX Orin", (8, 7), ("bfloat16", False, True)),
    ("L4", (8, 9), ("bfloat16", False, True)),
    ("H100 80GB HBM3", (9, 0), ("bfloat16", False, True)),
    ("B200", (10, 0), ("bfloat16", False, True)),
    ("B300", (10, 3), ("bfloat16", False, True)),
    ("Jetson Thor", (11, 0), ("bfloat16", False, True)),
    ("GeForce RTX 5090", (12, 0), ("bfloat16", False, True)),
    ("DGX Spark GB10", (12, 1), ("bfloat16", False, True)),
]


def snapshot_with_every_capability() -> Topology:
    """The real H200 snapshot, with one GPU record per capability in GPUS."""
    data = copy.deepcopy(load_snapshot_dict("h200x2"))
    template = data["gpus"][0]
    data["gpus"] = [{**template, "index": i, "uuid": f"GPU-{i:08d}", "name": name, "compute_capability": list(cc)}
                    for i, (name, cc, _) in enumerate(GPUS)]
    data["links"] = []
    return Topology.from_dict(data)


@pytest.mark.parametrize("gpu", snapshot_with_every_capability().gpus, ids=lambda g: g.name)
def test_policy_for_every_capability(gpu):
    expected = dict((name, want) for name, _, want in GPUS)[gpu.name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the automatic choice never warns
        policy = precision_for("cuda:0", capability=gpu.compute_capability, name=gpu.name)
    assert (str(policy.dtype).removeprefix("torch."), policy.grad_scaler, policy.tf32) == expected
    assert policy.capability == tuple(gpu.compute_capability)
    assert gpu.name in policy.reason and "compute capability" in policy.reason


def test_real_h200_snapshot_gets_bf16_without_scaler():
    for raw in load_snapshot_dict("h200x2")["gpus"]:
        policy = precision_for("cuda:0", capability=raw["compute_capability"], name=raw["name"])
        assert policy.dtype == torch.bfloat16 and not policy.grad_scaler and policy.tf32


def test_bf16_requested_on_t4_warns_and_is_respected():
    with pytest.warns(PrecisionWarning, match=r"Tesla T4 \(compute capability 7.5\).*no native bf16.*Fix: use fp16"):
        policy = precision_for("cuda:0", "bf16", capability=(7, 5), name="Tesla T4")
    assert policy.dtype == torch.bfloat16 and policy.requested == "bfloat16"
    assert "float16" in policy.reason  # says what the capability alone would pick


def test_bf16_on_v100_raises_under_strict():
    import torchplace as tp

    with pytest.raises(PrecisionError, match="compute capability 7.0"):
        precision_for("cuda:0", torch.bfloat16, capability=(7, 0), strict=True)
    with tp.strict():  # the same switch as TORCHPLACE_STRICT=1 and setup(strict=True)
        with pytest.raises(PrecisionError, match="no native bf16"):
            precision_for("cuda:0", "bfloat16", capability=(7, 0))
    with tp.strict("warn"):
        with pytest.warns(PrecisionWarning):
            precision_for("cuda:0", "bfloat16", capability=(7, 0))


def test_fp16_requested_where_it_is_slow():
    with pytest.warns(PrecisionWarning, match="6.1.*far slower than fp32"):
        policy = precision_for("cuda:0", "fp16", capability=(6, 1), name="GeForce GTX 1080")
    assert policy.dtype == torch.float16 and policy.grad_scaler


def test_explicit_fp16_on_hopper_is_fine_and_keeps_the_scaler():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy = precision_for("cuda:0", "half", capability=(9, 0))
    assert policy.dtype == torch.float16 and policy.grad_scaler and not policy.tf32


def test_environment_request_and_tf32_override(monkeypatch):
    monkeypatch.setenv("TORCHPLACE_PRECISION", "fp32")
    policy = precision_for("cuda:0", capability=(9, 0))
    assert policy.dtype == torch.float32 and not policy.tf32
    assert precision_for("cuda:0", "auto", capability=(9, 0), tf32=True).tf32


def test_bad_requests_say_what_exists():
    with pytest.raises(PrecisionError, match="bf16/bfloat16, fp16/float16/half, fp32/float32"):
        normalize_dtype("fp8")
    with pytest.raises(DeviceError, match="describe CUDA devices"):
        precision_for("cpu", capability=(9, 0))


def test_cpu_policy_follows_torch_cpu_capability():
    bf16, fp16, label = cpu_features()
    policy = precision_for("cpu")
    assert policy.dtype == torch.float32  # the CPU default, bf16 instructions or not (issue 32, item 8)
    assert not policy.grad_scaler and not policy.tf32
    assert torch.backends.cpu.get_cpu_capability() in label
    native = decide_cpu(True, False, "x")
    assert native.dtype == "float32" and "precision='bf16' turns it on" in native.reason
    asked = decide_cpu(True, False, "x", requested="bfloat16")
    assert asked.dtype == "bfloat16" and asked.problem is None and "asked for" in asked.reason
    assert decide_cpu(False, False, "x").dtype == "float32"
    assert "emulated" in (decide_cpu(False, False, "x", requested="bfloat16").problem or "")
    assert "no fp16 arithmetic" in (decide_cpu(True, False, "x", requested="float16").problem or "")


def test_unknown_capability_is_fp32():
    decision = decide_cuda(None)
    assert decision.dtype == "float32" and "unknown" in decision.reason


# --------------------------------------------------------------------------- autocast check


def cpu_bf16_policy():
    """bf16 on the CPU, requested explicitly (on CPUs without bf16 that warns; not under test here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        return precision_for("cpu", "bf16")


def test_first_step_counts_low_precision_ops():
    policy = cpu_bf16_policy()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with policy.autocast():
            out = model(torch.randn(8, 16))
    check = policy.last_check
    assert out.dtype == torch.bfloat16
    assert check is not None and check.ok
    assert check.matmuls_by_dtype.get("bfloat16") == 2 and check.low_precision_ops >= 3
    assert check.wrong_device_count == 0


def test_autocast_that_changes_nothing_warns_then_costs_nothing():
    policy = cpu_bf16_policy()
    x = torch.randn(8, 16)
    with pytest.warns(PrecisionWarning, match=r"none of the \d+ floating-point ops.*ran in bfloat16"):
        with policy.autocast():
            (x.relu() * 2).sum()
    first = policy.last_check
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # later steps are not checked: plain torch.autocast
        with policy.autocast():
            (x.relu() * 2).sum()
    assert policy.last_check is first and first.ops_by_dtype == {"float32": 3}


def test_tensors_on_another_device_type_are_named():
    policy = cpu_bf16_policy()
    model = torch.nn.Linear(16, 4, device="meta")
    with pytest.warns(PrecisionWarning, match=r"received tensors on another device type.*on meta"):
        with policy.autocast():
            model(torch.randn(8, 16, device="meta"))
    assert policy.last_check.wrong_device_count >= 1


def test_wrong_device_raises_under_strict():
    policy = cpu_bf16_policy()
    model = torch.nn.Linear(16, 4, device="meta")
    with pytest.raises(DeviceMismatchError, match="addmm"):
        with policy.autocast(strict=True):
            model(torch.randn(8, 16, device="meta"))


def test_check_sees_cpu_tensors_under_cuda_type():
    """What CUDA autocast around a CPU model looks like to the check (the GPU twin runs it for real)."""
    model = torch.nn.Linear(16, 4)
    mode = FirstStepCheck("cuda", "bfloat16", low_precision=True)
    with mode:
        model(torch.randn(8, 16)) * torch.tensor(2.0)  # a 0-dim CPU scalar alone is allowed
    result = mode.result()
    assert result.wrong_device_count == 2  # addmm and mul; the view (t) and the scalar are not counted
    assert "aten.addmm.default got a float32 tensor" in result.wrong_device[0]
    assert "on cpu" in result.problems[0] and "none of the" in result.problems[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_policy_cannot_enter_autocast_without_cuda():
    policy = precision_for("cuda:0", capability=(9, 0))
    with pytest.raises(DeviceError, match=r"compute capability 9.0\).*no cuda device"):
        with policy.autocast():
            pass


def test_grad_scaler_and_tf32_follow_the_policy():
    policy = precision_for("cpu", "fp32")
    assert not policy.make_grad_scaler().is_enabled()
    before = torch.get_float32_matmul_precision()
    try:
        policy.tf32 = True
        assert policy.apply_tf32() == before and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_autocast_context_made_once_is_entered_many_times():
    """nanoGPT builds `ctx` once and enters it every step (issue 32, item 5): like torch.autocast."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)  # bf16 emulated on a CPU without its instructions
        policy = precision_for("cpu", "bf16", strict=False)
    ctx = policy.autocast()
    layer = torch.nn.Linear(4, 4)
    for _ in range(3):
        with ctx:
            assert layer(torch.randn(2, 4)).dtype == torch.bfloat16
    with ctx:
        with ctx:
            assert torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    assert policy.last_check is not None
