"""Automatic mixed precision, acted on: `precision_for(device)` and the `PrecisionPolicy` it returns.

`precision_for` reads the live device (its compute capability, the CPU's bf16/fp16 instructions,
torch's answer on ROCm), takes the decision from `policy.precision` (pure, torch-free), and warns
(`PrecisionWarning`) or, under strict mode, raises (`PrecisionError`) when an explicit request
cannot run well here. The policy enters `torch.autocast` for the right device type, makes the
GradScaler and sets TF32. On its first entry only, `autocast()` runs the first-step check of
checks' face (checks/autocast.py), which counts the ops that ran by dtype and flags tensors on another device
type (CPU tensors under CUDA autocast run in fp32 without a word). Later entries are plain
`torch.autocast`: zero steady-state cost.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import DeviceError, PrecisionError, PrecisionWarning
from .hardware.accelerator import device_module
from .policy.precision import (
    PRECISION_ENV,
    PrecisionPlan,
    capability_label,
    decide_cpu,
    decide_cuda,
    decide_other,
    decide_rocm,
    normalize_dtype,
)
from .shared.strict_switch import should_raise

if TYPE_CHECKING:
    import torch

    from .checks import AutocastCheck
    from .policy.devices import DeviceSpec


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
    bf16, fp16 = False, False
    names: list[str] = []
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


def _cuda_plan(dev: torch.device, requested: str | None, name: str | None,
               tf32: bool | None) -> tuple[PrecisionPlan, tuple[int, int] | None]:
    """Plan for a live CUDA (or ROCm) device; returns the plan and the capability used."""
    import torch

    # cuda-only (each torch.cuda line below): compute capabilities (and ROCm's bf16 query) describe CUDA devices;
    # the precision table is per CUDA architecture
    name = name or torch.cuda.get_device_name(dev)  # cuda-only: precision table is per CUDA architecture
    if torch.version.hip:  # ROCm's "capabilities" are gfx numbers: ask torch about native bf16 instead
        with torch.cuda.device(dev):  # cuda-only: ROCm's bf16 query goes through torch.cuda
            native = torch.cuda.is_bf16_supported(including_emulation=False)  # cuda-only: ROCm's bf16 query
        return decide_rocm(native, name, requested, tf32), None
    major, minor = torch.cuda.get_device_capability(dev)  # cuda-only: precision table is per CUDA architecture
    return decide_cuda((major, minor), requested, name, tf32), (major, minor)


@dataclass
class PrecisionPolicy:
    """The precision to use on one device. Build it with `precision_for`.

    `dtype` is what autocast computes in, `grad_scaler` whether fp16's gradients need scaling,
    `tf32` whether fp32 matmuls may use TF32. `last_check` holds the first autocast step's check.
    """

    device: torch.device
    dtype: torch.dtype
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

    def make_grad_scaler(self, **kwargs: Any) -> torch.amp.GradScaler:
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

    def autocast(self, *, check: bool = True, strict: bool | None = None) -> PolicyAutocast:
        """`torch.autocast` for this policy, as a context that may be entered again and again (as
        `torch.autocast` may: `ctx = policy.autocast()` once, `with ctx:` each step); the first entry
        checks the step's ops (see module docstring).

        A problem found on the first step warns (`PrecisionWarning`), or raises under strict mode
        (`strict=True`, the policy's own `strict`, or TORCHPLACE_STRICT=1): `DeviceMismatchError`
        for tensors on another device type, `PrecisionError` when no op ran in low precision.
        """
        self._ensure_available()
        return PolicyAutocast(self, check, strict)

    def _ensure_available(self) -> None:

        kind = self.device.type
        if kind == "cpu":
            return
        mod = device_module(kind)  # cuda, or any other back end (torch.accelerator may name another one)
        available = mod is not None and bool(mod.is_available())
        if not available:
            made = f" (computed from compute capability {capability_label(self.capability)})" if self.capability else ""
            raise DeviceError(f"The precision policy for {self.device}{made} cannot enter autocast: this "
                              f"process has no {kind} device. "
                              "Fix: run on a machine with that device, or use precision_for('cpu').")


def precision_for(device: DeviceSpec, dtype: str | torch.dtype | None = None, *,
                  capability: tuple[int, int] | list[int] | None = None, name: str | None = None,
                  tf32: bool | None = None, strict: bool | None = None) -> PrecisionPolicy:
    """The precision policy for DEVICE from its real capability; DTYPE forces a choice.

    bf16 where the hardware runs it natively (Ampere and later, recent CPUs), fp16 with a
    GradScaler where only fp16 is fast (Volta, Turing), fp32 where neither helps; TF32 matmuls on
    where supported.

    Args:
        device: any `torchplace.device` spec.
        dtype: "bf16", "fp16", "fp32" or a torch dtype to force; by default TORCHPLACE_PRECISION
            from the environment, else the best for the device.
        capability: `(major, minor)` to plan for a CUDA device without touching it (from a
            snapshot's `GpuRecord.compute_capability`).
        name: the GPU's name, for the reasons given (with `capability`).
        tf32: force TF32 matmuls on or off (default: on where the hardware has it).
        strict: raise `PrecisionError` instead of warning when DTYPE cannot run natively
            (default: follow strict mode).

    Returns:
        A `PrecisionPolicy`: `dtype`, `grad_scaler` (needed or not), `reason`, `autocast()`
        (checked on its first use), `make_grad_scaler()` and `apply_tf32()`.

    Raises:
        DeviceError: the device does not exist, or `capability` was given for a non-CUDA device.
        PrecisionError: DTYPE cannot run natively here, under strict mode.

    Example:
        ```python
        import torch
        import torchplace as tp

        policy = tp.precision_for("cpu")
        print(policy.dtype, policy.grad_scaler, policy.reason)
        planned = tp.precision_for("cuda:0", capability=(7, 0), name="Tesla V100")  # fp16 + GradScaler
        print(planned.dtype, planned.grad_scaler)
        with policy.autocast():
            torch.nn.Linear(4, 2)(torch.randn(3, 4))
        ```
    """
    import torch

    requested = normalize_dtype(dtype if dtype is not None else os.environ.get(PRECISION_ENV) or None)
    if capability is not None:
        dev = torch.device("cuda" if device is None else device)
        if dev.type != "cuda":
            raise DeviceError(f"capability={tuple(capability)} was given for {dev}, but compute capabilities "
                              "describe CUDA devices. Fix: pass a 'cuda' device, or drop capability=.")
        cc: tuple[int, int] | None = (int(capability[0]), int(capability[1]))
        plan = decide_cuda(cc, requested, name, tf32)
    else:
        from .policy.devices import device as resolve_device

        dev = resolve_device(device)
        cc = None
        if dev.type == "cuda":
            plan, cc = _cuda_plan(dev, requested, name, tf32)
        elif dev.type == "cpu":
            bf16, fp16, isa = cpu_features()
            plan = decide_cpu(bf16, fp16, isa, requested)
        else:
            plan = decide_other(str(dev), requested, torch.amp.is_autocast_available(dev.type))
    policy = PrecisionPolicy(device=dev, dtype=getattr(torch, plan.dtype), grad_scaler=plan.grad_scaler,
                             tf32=plan.tf32, reason=plan.reason, capability=cc, requested=requested,
                             problem=plan.problem, strict=strict)
    if plan.problem:
        if should_raise(strict):
            raise PrecisionError(plan.problem)
        warnings.warn(plan.problem, PrecisionWarning, stacklevel=2)
    return policy


class PolicyAutocast:
    """What `PrecisionPolicy.autocast()` returns: each `with` enters a fresh `torch.autocast` (nested and
    repeated entries each get their own), the policy's first one under the first-step check."""

    def __init__(self, policy: PrecisionPolicy, check: bool, strict: bool | None) -> None:
        self.policy, self.check, self.strict = policy, check, strict
        self._entered: list[tuple[Any, Any]] = []  # (torch.autocast, the first-step check or None) per entry

    def __enter__(self) -> None:
        import torch

        policy = self.policy
        ctx = torch.autocast(policy.device.type, dtype=policy.dtype, enabled=policy.autocast_enabled)
        mode = None
        if self.check and not policy._checked:
            policy._checked = True
            from .checks import FirstStepCheck

            mode = FirstStepCheck(policy.device.type, str(policy.dtype).removeprefix("torch."),
                                  policy.autocast_enabled)
        ctx.__enter__()
        if mode is not None:
            try:
                mode.__enter__()
            except BaseException:
                ctx.__exit__(None, None, None)
                raise
        self._entered.append((ctx, mode))

    def __exit__(self, *exc: Any) -> None:
        ctx, mode = self._entered.pop()
        if mode is not None:
            mode.__exit__(*exc)
        ctx.__exit__(*exc)
        if mode is not None and exc[0] is None:
            from .checks import report_first_step

            self.policy.last_check = mode.result()
            strict = self.strict if self.strict is not None else self.policy.strict
            report_first_step(self.policy.last_check, should_raise(strict), stacklevel=2)
