"""Precision policy from the device's real capability, and an autocast that checks itself.

`precision_for(device)` answers three questions from what the hardware does natively:
which dtype to compute in under autocast, whether a GradScaler is needed, and whether TF32
helps fp32 matmuls. The rules (CUDA C Programming Guide, arithmetic throughput tables):

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

The decision functions are pure and torch-free (`decide_cuda`, `decide_cpu`), so a policy can
be computed from a snapshot's compute capability on a machine without the GPU, and `doctor`
can use them without importing torch. `PrecisionPolicy.autocast()` enters autocast for the
right device type and, on its first entry only, runs a dispatch mode (`autocast_check.py`)
that counts the ops that ran by dtype and flags tensors on another device type (CPU tensors
under CUDA autocast run in fp32 without a word). Later entries are plain `torch.autocast`: zero steady-state cost.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import DeviceError, DeviceMismatchError, PrecisionError, PrecisionWarning
from . import strict_enabled

if TYPE_CHECKING:
    import torch

    from .autocast_check import AutocastCheck

PRECISION_ENV = "TORCHPLACE_PRECISION"  # a run-wide request ("bf16", "fp16", "fp32") when dtype is not given
NATIVE_BF16_CAPABILITY = (8, 0)
TENSOR_CORE_CAPABILITY = (7, 0)
FAST_FP16_WITHOUT_TENSOR_CORES = frozenset({(5, 3), (6, 0), (6, 2)})

_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16", "16": "float16", "16-mixed": "float16",
    "bf16-mixed": "bfloat16",
    "fp32": "float32", "float32": "float32", "float": "float32", "32": "float32",
}

@dataclass(frozen=True)
class Decision:
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
    if text not in _ALIASES:
        raise PrecisionError(f"Precision {dtype!r} is not one of bf16/bfloat16, fp16/float16/half, "
                             "fp32/float32 or 'auto'. Fix: pass one of those, or None to let "
                             "torchplace choose from the device's capability.")
    return _ALIASES[text]


def bf16_native(capability: tuple[int, int] | list[int] | None) -> bool:
    """True where a CUDA compute capability has native bf16 (8.0 and up)."""
    return capability is not None and tuple(capability) >= NATIVE_BF16_CAPABILITY


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def decide_cuda(capability: tuple[int, int] | list[int] | None, requested: str | None = None,
                name: str | None = None, tf32: bool | None = None) -> Decision:
    """The precision for a CUDA device of this compute capability (and an optional explicit request)."""
    what = name or "this GPU"
    if capability is None:
        auto = Decision("float32", False, False,
                        f"the compute capability of {what} is unknown, so float32 is the only safe choice")
    else:
        cc = (int(capability[0]), int(capability[1]))
        label = f"{what} (compute capability {_cc(cc)})"
        if cc >= NATIVE_BF16_CAPABILITY:
            auto = Decision("bfloat16", False, True,
                            f"{label} has native bf16 tensor cores (8.0 and up); bf16 keeps fp32's "
                            "exponent range, so no GradScaler is needed; TF32 speeds up fp32 matmuls")
        elif cc >= TENSOR_CORE_CAPABILITY:
            auto = Decision("float16", True, False,
                            f"{label} has fp16 tensor cores but only emulated bf16 (native from 8.0); "
                            "fp16 needs a GradScaler against gradient underflow; no TF32 before 8.0")
        elif cc in FAST_FP16_WITHOUT_TENSOR_CORES:
            auto = Decision("float16", True, False,
                            f"{label} runs fp16 at twice the fp32 rate (no tensor cores); "
                            "fp16 needs a GradScaler")
        else:
            auto = Decision("float32", False, False,
                            f"{label} has neither tensor cores nor fast fp16, so low precision "
                            "would only slow it down")
    return _apply_request(auto, requested, tf32, _cuda_problem(capability, requested, what))


def _cuda_problem(capability: Any, requested: str | None, what: str) -> str | None:
    if requested is None or requested == "float32" or capability is None:
        return None
    cc = (int(capability[0]), int(capability[1]))
    if requested == "bfloat16" and cc < NATIVE_BF16_CAPABILITY:
        return (f"bf16 was requested on {what} (compute capability {_cc(cc)}), which has no native bf16 "
                "(it needs 8.0 or later): torch emulates it, slower than fp32 on many ops. "
                "Fix: use fp16 with a GradScaler (precision_for(device) without dtype picks it) or fp32.")
    if requested == "float16" and cc < TENSOR_CORE_CAPABILITY and cc not in FAST_FP16_WITHOUT_TENSOR_CORES:
        return (f"fp16 was requested on {what} (compute capability {_cc(cc)}), which runs fp16 far slower "
                "than fp32 (no tensor cores, no double-rate fp16). Fix: use fp32 (dtype=None picks it).")
    return None


def decide_cpu(bf16_native_cpu: bool, fp16_native_cpu: bool = False, isa: str = "this CPU",
               requested: str | None = None) -> Decision:
    """The precision for the CPU, from whether it has bf16/fp16 instructions."""
    if bf16_native_cpu:
        auto = Decision("bfloat16", False, False, f"{isa} has native bf16 instructions; no GradScaler needed")
    else:
        auto = Decision("float32", False, False,
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


def _apply_request(auto: Decision, requested: str | None, tf32: bool | None, problem: str | None) -> Decision:
    if requested is None or requested == auto.dtype:
        final = auto
    else:
        final = Decision(requested, requested == "float16", False,
                         f"{requested} was requested explicitly (the capability alone would pick "
                         f"{auto.dtype}: {auto.reason})", problem)
    if tf32 is not None and tf32 != final.tf32:
        final = Decision(final.dtype, final.grad_scaler, tf32, final.reason + f"; TF32 set to {tf32} explicitly",
                         final.problem)
    return final


# --------------------------------------------------------------------------- live queries


def cpu_features() -> tuple[bool, bool, str]:
    """(native bf16, native fp16, a label) for this CPU, from torch's own CPU capability queries."""
    import platform

    import torch

    cpu = getattr(torch, "cpu", None)

    def query(name: str) -> bool:
        fn = getattr(cpu, name, None)
        try:
            return bool(fn()) if fn is not None else False
        except Exception:  # a query torch cannot answer here is a "no"
            return False

    isa = torch.backends.cpu.get_cpu_capability()
    bf16, fp16, names = False, False, []
    if query("_is_amx_tile_supported"):
        bf16, names = True, [*names, "AMX"]
    if query("_is_avx512_bf16_supported"):
        bf16, names = True, [*names, "AVX512-BF16"]
    if query("_is_amx_fp16_supported"):
        fp16, names = True, [*names, "AMX-FP16"]
    if platform.machine().lower() in ("aarch64", "arm64"):
        try:  # on Arm, oneDNN's check reads the BF16 instruction flag (on x86 it counts emulation)
            arm_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            arm_bf16 = False
        if arm_bf16:
            bf16, names = True, [*names, "Arm BF16"]
    label = f"this CPU ({isa}{', ' + ', '.join(names) if names else ''})"
    return bf16, fp16, label


def _cuda_decision(dev: "torch.device", requested: str | None, name: str | None,
                   tf32: bool | None) -> tuple[Decision, tuple[int, int] | None]:
    """Decide for a live CUDA (or ROCm) device; returns the decision and the capability used."""
    import torch

    name = name or torch.cuda.get_device_name(dev)
    if torch.version.hip:  # ROCm's "capabilities" are gfx numbers: ask torch about native bf16 instead
        with torch.cuda.device(dev):
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        auto = (Decision("bfloat16", False, False, f"{name} (ROCm): torch reports native bf16") if native else
                Decision("float16", True, False, f"{name} (ROCm): torch reports no native bf16; fp16 needs "
                                                 "a GradScaler"))
        problem = (f"bf16 was requested on {name}, which torch reports has no native bf16. Fix: use fp16 "
                   "(dtype=None picks it)." if requested == "bfloat16" and not native else None)
        return _apply_request(auto, requested, tf32, problem), None
    major, minor = torch.cuda.get_device_capability(dev)
    return decide_cuda((major, minor), requested, name, tf32), (major, minor)


# --------------------------------------------------------------------------- the policy


@dataclass
class PrecisionPolicy:
    """The precision to use on one device. Build it with `precision_for`.

    `dtype` is what autocast computes in, `grad_scaler` whether fp16's gradients need scaling,
    `tf32` whether fp32 matmuls may use TF32. `last_check` holds the first autocast step's check.
    """

    device: "torch.device"
    dtype: "torch.dtype"
    grad_scaler: bool
    tf32: bool
    reason: str
    capability: tuple[int, int] | None = None
    requested: str | None = None
    problem: str | None = None
    strict: bool | None = None
    last_check: AutocastCheck | None = field(default=None, compare=False)
    _checked: bool = field(default=False, repr=False, compare=False)

    @property
    def autocast_enabled(self) -> bool:
        import torch

        return self.dtype != torch.float32

    def make_grad_scaler(self, **kwargs: Any) -> "torch.amp.GradScaler":
        """A `torch.amp.GradScaler` for this device, enabled only when the policy needs one."""
        import torch

        return torch.amp.GradScaler(self.device.type, enabled=self.grad_scaler, **kwargs)

    def apply_tf32(self) -> str:
        """Set torch's float32 matmul precision from the policy ('high' = TF32, 'highest' = off).

        Uses `torch.set_float32_matmul_precision`, which torch 2.9+ maps onto its new
        fp32_precision settings; mixing the legacy `allow_tf32` flags with those makes torch
        raise, so torchplace never touches the legacy flags. Returns the previous setting.
        """
        import torch

        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if self.tf32 else "highest")
        return previous

    @contextmanager
    def autocast(self, *, check: bool = True, strict: bool | None = None) -> Iterator[None]:
        """Enter `torch.autocast` for this policy; check the first step's ops (see module docstring).

        A problem found on the first step warns (`PrecisionWarning`), or raises under strict mode
        (`strict=True`, the policy's own `strict`, or TORCHPLACE_STRICT=1): `DeviceMismatchError`
        for tensors on another device type, `PrecisionError` when no op ran in low precision.
        """
        import torch

        self._ensure_available()
        ctx = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast_enabled)
        if not check or self._checked:
            with ctx:
                yield
            return
        self._checked = True
        from .autocast_check import FirstStepCheck

        mode = FirstStepCheck(self.device.type, str(self.dtype).removeprefix("torch."),
                               self.autocast_enabled)
        with ctx, mode:
            yield
        self.last_check = mode.result()
        self._report(self.last_check, strict if strict is not None else self.strict)

    def _ensure_available(self) -> None:
        import torch

        kind = self.device.type
        if kind == "cpu":
            return
        if kind == "cuda":
            available = torch.cuda.is_available()
        else:
            accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            available = accelerator is not None and accelerator.type == kind
        if not available:
            made = f" (computed from compute capability {_cc(self.capability)})" if self.capability else ""
            raise DeviceError(f"The precision policy for {self.device}{made} cannot enter autocast: this "
                              f"process has no {kind} device. "
                              "Fix: run on a machine with that device, or use precision_for('cpu').")

    def _report(self, result: AutocastCheck, strict: bool | None) -> None:
        if result.ok:
            return
        message = " ".join(result.problems)
        if strict_enabled(strict):
            if result.wrong_device_count:
                raise DeviceMismatchError(message)
            raise PrecisionError(message)
        warnings.warn(message, PrecisionWarning, stacklevel=4)


def precision_for(device: Any, dtype: Any = None, *, capability: tuple[int, int] | list[int] | None = None,
                  name: str | None = None, tf32: bool | None = None, strict: bool | None = None) -> PrecisionPolicy:
    """The precision policy for DEVICE from its real capability; DTYPE forces a choice.

    `capability=(major, minor)` plans for a CUDA device without touching it (from a snapshot's
    `GpuRecord.compute_capability`); otherwise the device is resolved and queried. An explicit
    DTYPE (or, without one, TORCHPLACE_PRECISION=bf16/fp16/fp32 in the environment) is
    respected; when it cannot run natively here the policy says so with a `PrecisionWarning`
    (a `PrecisionError` under strict mode).
    """
    import torch

    requested = normalize_dtype(dtype if dtype is not None else os.environ.get(PRECISION_ENV) or None)
    if capability is not None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise DeviceError(f"capability={tuple(capability)} was given for {dev}, but compute capabilities "
                              "describe CUDA devices. Fix: pass a 'cuda' device, or drop capability=.")
        cc: tuple[int, int] | None = (int(capability[0]), int(capability[1]))
        decision = decide_cuda(cc, requested, name, tf32)
    else:
        from ..placement.resolve import device as resolve_device

        dev = resolve_device(device)
        cc = None
        if dev.type == "cuda":
            decision, cc = _cuda_decision(dev, requested, name, tf32)
        elif dev.type == "cpu":
            bf16, fp16, isa = cpu_features()
            decision = decide_cpu(bf16, fp16, isa, requested)
        else:
            decision = _other_device(dev, requested)
    policy = PrecisionPolicy(device=dev, dtype=getattr(torch, decision.dtype), grad_scaler=decision.grad_scaler,
                             tf32=decision.tf32, reason=decision.reason, capability=cc, requested=requested,
                             problem=decision.problem, strict=strict)
    if decision.problem:
        if strict_enabled(strict):
            raise PrecisionError(decision.problem)
        warnings.warn(decision.problem, PrecisionWarning, stacklevel=2)
    return policy


def _other_device(dev: "torch.device", requested: str | None) -> Decision:
    import torch

    if requested is None:
        return Decision("float32", False, False,
                        f"torchplace has no capability table for {dev.type} devices, so it does not guess; "
                        "pass dtype='bf16' or 'fp16' to choose")
    if requested != "float32" and not torch.amp.is_autocast_available(dev.type):
        raise PrecisionError(f"{requested} autocast was requested on {dev}, but this torch has no autocast "
                             f"for {dev.type}. Fix: use dtype='fp32', or cast the model yourself.")
    return Decision(requested, requested == "float16", False, f"{requested} was requested explicitly")
