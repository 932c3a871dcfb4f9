"""The precision decision: which dtype, GradScaler and TF32 a device's capability calls for, and why.

Three questions, answered from what the hardware does natively: which dtype to compute in under
autocast, whether a GradScaler is needed, and whether TF32 helps fp32 matmuls. The rules (CUDA C
Programming Guide, arithmetic throughput tables):

- compute capability 8.0 and up (A100, H100/H200, L4, B200, RTX 30xx and later): bfloat16,
  no GradScaler (bf16 keeps fp32's exponent range, so gradients do not underflow), TF32 on.
- 7.x (V100, T4, RTX 20xx): float16 tensor cores but no native bf16, which torch only
  *emulates* there (`torch.cuda.is_bf16_supported()` says True by default because it counts
  emulation), so: float16 with a GradScaler. No TF32 hardware.
- 5.3, 6.0, 6.2 (Jetson TX1, P100, Jetson TX2): double-rate fp16 without tensor cores:
  float16 with a GradScaler.
- other capabilities below 7.0 (K80, M60, GTX 10xx at 6.1 where fp16 runs at 1/64 rate):
  float32, because low precision would only slow them down.
- CPU: bfloat16 where the CPU has bf16 instructions (AVX512-BF16, AMX, Arm BF16), else float32.

Everything here is pure and torch-free: each function takes the facts (a compute capability,
the CPU's instructions, what torch reports on ROCm) and returns a `PrecisionPlan`, so a plan can
be made from a snapshot on a machine without the GPU, and `doctor` uses it without importing
torch. Acting on a plan (querying the live device, autocast, GradScaler, TF32, warning or raising
on a problem) is `torchplace.amp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import PrecisionError, PrecisionWarning

__all__ = ["PrecisionError", "PrecisionPlan", "PrecisionWarning", "bf16_native", "decide_cpu", "decide_cuda",
           "decide_other", "decide_rocm", "normalize_dtype"]

PRECISION_ENV = "TORCHPLACE_PRECISION"  # a run-wide request ("bf16", "fp16", "fp32") when dtype is not given
NATIVE_BF16_CAPABILITY = (8, 0)
TENSOR_CORE_CAPABILITY = (7, 0)
FAST_FP16_WITHOUT_TENSOR_CORES = frozenset({(5, 3), (6, 0), (6, 2)})

_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16", "16": "float16", "16-mixed": "float16",
    "bf16-mixed": "bfloat16",
    "fp32": "float32", "float32": "float32", "float": "float32", "32": "float32",
    "32-true": "float32",  # Lightning's default Trainer(precision=...), as trainer.precision reports it
}

@dataclass(frozen=True)
class PrecisionPlan:
    """What to compute in on one device, and why. Pure data, no torch types."""

    dtype: str  # "bfloat16", "float16" or "float32"
    grad_scaler: bool
    tf32: bool
    reason: str
    problem: str | None = None  # set when an explicit request cannot work well here


def normalize_dtype(dtype: Any) -> str | None:
    """'bf16', 'fp16', torch.bfloat16, ... -> 'bfloat16' / 'float16' / 'float32'; None or 'auto' -> None."""
    if dtype is None:
        return None
    text = str(dtype).removeprefix("torch.").strip().lower()
    if text == "auto":
        return None
    if text in ("16-true", "bf16-true", "64-true"):
        raise PrecisionError(f"Precision {dtype!r} is Lightning's: the weights themselves in that dtype, with no "
                             "autocast, which a precision policy does not do. Fix: cast the model yourself "
                             "(model.to(dtype)), or pass '16-mixed' / 'bf16-mixed' for autocast.")
    if text not in _ALIASES:
        raise PrecisionError(f"Precision {dtype!r} is not one of bf16/bfloat16, fp16/float16/half, "
                             "fp32/float32 or 'auto'. Fix: pass one of those, or None to let "
                             "torchplace choose from the device's capability.")
    return _ALIASES[text]


def bf16_native(capability: tuple[int, int] | list[int] | None) -> bool:
    """True where a CUDA compute capability has native bf16 (8.0 and up)."""
    return capability is not None and tuple(capability) >= NATIVE_BF16_CAPABILITY


def capability_label(capability: tuple[int, int]) -> str:
    """"8.0" for (8, 0)."""
    return f"{capability[0]}.{capability[1]}"


def decide_cuda(capability: tuple[int, int] | list[int] | None, requested: str | None = None,
                name: str | None = None, tf32: bool | None = None) -> PrecisionPlan:
    """The precision for a CUDA device of this compute capability (and an optional explicit request)."""
    what = name or "this GPU"
    if capability is None:
        auto = PrecisionPlan("float32", False, False,
                        f"the compute capability of {what} is unknown, so float32 is the only safe choice")
    else:
        cc = (int(capability[0]), int(capability[1]))
        label = f"{what} (compute capability {capability_label(cc)})"
        if cc >= NATIVE_BF16_CAPABILITY:
            auto = PrecisionPlan("bfloat16", False, True,
                            f"{label} has native bf16 tensor cores (8.0 and up); bf16 keeps fp32's "
                            "exponent range, so no GradScaler is needed; TF32 speeds up fp32 matmuls")
        elif cc >= TENSOR_CORE_CAPABILITY:
            auto = PrecisionPlan("float16", True, False,
                            f"{label} has fp16 tensor cores but only emulated bf16 (native from 8.0); "
                            "fp16 needs a GradScaler against gradient underflow; no TF32 before 8.0")
        elif cc in FAST_FP16_WITHOUT_TENSOR_CORES:
            auto = PrecisionPlan("float16", True, False,
                            f"{label} runs fp16 at twice the fp32 rate (no tensor cores); "
                            "fp16 needs a GradScaler")
        else:
            auto = PrecisionPlan("float32", False, False,
                            f"{label} has neither tensor cores nor fast fp16, so low precision "
                            "would only slow it down")
    return _apply_request(auto, requested, tf32, _cuda_problem(capability, requested, what))


def _cuda_problem(capability: Any, requested: str | None, what: str) -> str | None:
    if requested is None or requested == "float32" or capability is None:
        return None
    cc = (int(capability[0]), int(capability[1]))
    if requested == "bfloat16" and cc < NATIVE_BF16_CAPABILITY:
        return (f"bf16 was requested on {what} (compute capability {capability_label(cc)}), which has no native "
                "bf16 (it needs 8.0 or later): torch emulates it, slower than fp32 on many ops. "
                "Fix: use fp16 with a GradScaler (precision_for(device) without dtype picks it) or fp32.")
    if requested == "float16" and cc < TENSOR_CORE_CAPABILITY and cc not in FAST_FP16_WITHOUT_TENSOR_CORES:
        return (f"fp16 was requested on {what} (compute capability {capability_label(cc)}), which runs fp16 far "
                "slower than fp32 (no tensor cores, no double-rate fp16). Fix: use fp32 (dtype=None picks it).")
    return None


def decide_cpu(bf16_native_cpu: bool, fp16_native_cpu: bool = False, isa: str = "this CPU",
               requested: str | None = None) -> PrecisionPlan:
    """The precision for the CPU: fp32 unless REQUESTED (a CPU program trains in fp32; autocast would change
    its numerics), with what the CPU's bf16/fp16 instructions mean for a request."""
    if requested == "bfloat16" and bf16_native_cpu:
        return PrecisionPlan("bfloat16", False, False, f"bf16 was asked for; {isa} has native bf16 instructions, "
                                                       "no GradScaler needed")
    if bf16_native_cpu:
        auto = PrecisionPlan("float32", False, False,
                             f"the CPU default: {isa} has native bf16 instructions, but bf16 autocast would change "
                             "the program's numerics; precision='bf16' turns it on")
    else:
        auto = PrecisionPlan("float32", False, False,
                        f"{isa} has no bf16 instructions (AVX512-BF16, AMX or Arm BF16); bf16 would be "
                        "emulated through conversions, usually slower than fp32")
    problem = None
    if requested == "bfloat16" and not bf16_native_cpu:
        problem = (f"bf16 was requested on the CPU, but {isa} has no bf16 instructions (AVX512-BF16, AMX "
                   "or Arm BF16): it is emulated and usually slower than fp32. Fix: use fp32 (dtype=None).")
    elif requested == "float16" and not fp16_native_cpu:
        problem = (f"fp16 was requested on the CPU, but {isa} has no fp16 arithmetic (AMX-FP16 or "
                   "AVX512-FP16): it is emulated and usually slower than fp32. Fix: use fp32 (dtype=None)"
                   + (" or bf16, which this CPU has." if bf16_native_cpu else "."))
    return _apply_request(auto, requested, None, problem)


def _apply_request(auto: PrecisionPlan, requested: str | None, tf32: bool | None, problem: str | None) -> PrecisionPlan:
    if requested is None or requested == auto.dtype:
        final = auto
    else:
        final = PrecisionPlan(requested, requested == "float16", False,
                         f"{requested} was requested explicitly (the capability alone would pick "
                         f"{auto.dtype}: {auto.reason})", problem)
    if tf32 is not None and tf32 != final.tf32:
        final = PrecisionPlan(final.dtype, final.grad_scaler, tf32, final.reason + f"; TF32 set to {tf32} explicitly",
                         final.problem)
    return final


def decide_rocm(native_bf16: bool, name: str, requested: str | None = None, tf32: bool | None = None) -> PrecisionPlan:
    """The precision for a ROCm GPU, whose "capabilities" are gfx numbers: from torch's native-bf16 answer."""
    auto = (PrecisionPlan("bfloat16", False, False, f"{name} (ROCm): torch reports native bf16") if native_bf16 else
            PrecisionPlan("float16", True, False, f"{name} (ROCm): torch reports no native bf16; fp16 needs "
                                                  "a GradScaler"))
    problem = (f"bf16 was requested on {name}, which torch reports has no native bf16. Fix: use fp16 "
               "(dtype=None picks it)." if requested == "bfloat16" and not native_bf16 else None)
    return _apply_request(auto, requested, tf32, problem)


def decide_other(device: str, requested: str | None, autocast_available: bool) -> PrecisionPlan:
    """The precision for a device type without a capability table (mps, xpu, ...): only what was asked."""
    device_type = device.split(":")[0]
    if requested is None:
        return PrecisionPlan("float32", False, False,
                             f"torchplace has no capability table for {device_type} devices, so it does not guess; "
                             "pass dtype='bf16' or 'fp16' to choose")
    if requested != "float32" and not autocast_available:
        raise PrecisionError(f"{requested} autocast was requested on {device}, but this torch has no autocast "
                             f"for {device_type}. Fix: use dtype='fp32', or cast the model yourself.")
    return PrecisionPlan(requested, requested == "float16", False, f"{requested} was requested explicitly")
