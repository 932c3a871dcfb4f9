"""Autocast that changes nothing: its device type matches none of the tensors it wraps, or no op runs
in its dtype. `torch.autocast("cuda")` around a model on the CPU runs its ops in fp32 without a word.

Two checks, one for each way in:
- strict mode: entering any `torch.autocast` asks for a deferred check (deferred.py): at the first
  module call inside the block, the module's inputs and parameters are compared with the
  autocast's device type, once per block. A steady step pays one hook call per block.
- `PrecisionPolicy.autocast()` (torchplace.amp): on its first entry only, `FirstStepCheck`, a
  `TorchDispatchMode`, sees every aten op after autocast has cast its inputs, so it observes the
  kernels that really ran: it counts floating-point ops by output dtype and notes inputs on another
  device type. Copy ops and views are neither counted nor checked. A Python mode on every op costs
  35-120% on launch-bound steps (docs/reference-measurements.md), hence the first step only.
Both allow 0-dim CPU tensors (wrapped scalars), which autocast and every device accept.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..errors import DeviceMismatchError, PrecisionError, PrecisionWarning
from ..shared.strict_switch import active
from ..shared.tree import tensors_with_paths
from . import deferred
from . import frames as fr
from .warn_or_raise import warn_or_raise


def patches() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    return [(torch.amp.autocast_mode.autocast, "__enter__", _wrap_enter)]


def _wrap_enter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __enter__(self: Any) -> Any:
        result = original(self)
        config = active()
        if config is not None and config.autocast and getattr(self, "_enabled", False):
            frame = fr.caller_frame()
            where = (frame, frame.f_lineno, frame.f_lasti) if frame is not None else None
            check = _Check(self.device, str(self.fast_dtype).removeprefix("torch."), config.autocast, where)
            deferred.request(check, key=("autocast", self.device))
        return result

    return __enter__


class _Check:
    """The pending comparison for one autocast block."""

    def __init__(self, device_type: str, dtype: str, action: str, where: tuple[Any, int, int] | None) -> None:
        self.device_type, self.dtype, self.action, self.where = device_type, dtype, action, where

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> bool:
        if not torch.is_autocast_enabled(self.device_type):
            return True  # the block has ended
        tensors = [t for t in _tensors(args) if not _wrapped_scalar(t)]
        tensors += [p for p in (next(module.parameters(), None), next(module.buffers(), None)) if p is not None]
        if not tensors:
            return False  # nothing to judge yet: look at the next module call
        if any(t.device.type == self.device_type for t in tensors):
            return True
        self._report(module, sorted({str(t.device) for t in tensors}))
        return True

    def _report(self, module: torch.nn.Module, devices: list[str]) -> None:
        site = fr.site_of(*self.where) if self.where else None
        where = f" at {site}" if site else ""
        code = f"`{site.line}`" if site and site.line else f"torch.autocast({self.device_type!r})"
        message = (f"{code}{where} turns on {self.device_type} autocast ({self.dtype}), but the tensors it wraps are "
                   f"on {', '.join(devices)} (first module called: {type(module).__name__}).\nFix: autocast for the "
                   "device the model runs on: torch.autocast(device_type=x.device.type, ...).\nOr: move the model "
                   f"and batch to {self.device_type}.\nWhy: autocast changes nothing there; those ops run in their own "
                   "dtype, usually float32.")
        frame, lineno = (self.where[0], self.where[1]) if self.where else (None, None)
        warn_or_raise(self.action, message, DeviceMismatchError, frame, lineno)


def _tensors(args: tuple[Any, ...]) -> list[torch.Tensor]:
    return [t for _, t in tensors_with_paths(args, "args", depth=3, items=256)]


def _wrapped_scalar(tensor: torch.Tensor) -> bool:
    """A 0-dim CPU tensor: a Python number torch wrapped, which any device and autocast accept."""
    return tensor.device.type == "cpu" and tensor.dim() == 0


# --------------------------------------------------------------------------- the first step of a policy's autocast


@dataclass
class AutocastCheck:
    """What the first autocast step ran: ops by output dtype and tensors on another device type."""

    device_type: str
    dtype: str
    ops_by_dtype: dict[str, int] = field(default_factory=dict)
    matmuls_by_dtype: dict[str, int] = field(default_factory=dict)
    wrong_device: list[str] = field(default_factory=list)  # the first few, described
    wrong_device_count: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def low_precision_ops(self) -> int:
        return self.ops_by_dtype.get(self.dtype, 0)


_COPY_OPS = frozenset({"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "to", "lift_fresh",
                       "lift_fresh_copy", "_local_scalar_dense", "_pin_memory", "set_"})
_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "convolution",
                         "_convolution", "cudnn_convolution", "mkldnn_convolution", "_addmm_activation",
                         "addmv", "mv", "_scaled_dot_product_flash_attention",
                         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                         "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm"})
_MAX_LISTED = 5


class FirstStepCheck(TorchDispatchMode):
    """Counts ops by output dtype and collects tensors on another device type (first step only)."""

    def __init__(self, device_type: str, dtype: str, low_precision: bool) -> None:
        super().__init__()
        self.device_type, self.dtype, self.low_precision = device_type, dtype, low_precision
        self.ops: Counter[str] = Counter()
        self.matmuls: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.wrong_count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        op = func._opname
        if op in _COPY_OPS or self._is_view(func):
            return out
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        for tensor in inputs:
            if tensor.device.type != self.device_type and not _wrapped_scalar(tensor):
                self.wrong_count += 1
                if len(self.wrong) < _MAX_LISTED:
                    self.wrong.append(f"{func} got a {str(tensor.dtype).removeprefix('torch.')} tensor of "
                                      f"shape {tuple(tensor.shape)} on {tensor.device}")
                break
        floats = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if floats:
            kind = str(floats[0].dtype).removeprefix("torch.")
            self.ops[kind] += 1
            if op in _MATMUL_OPS:
                self.matmuls[kind] += 1
        return out

    @staticmethod
    def _is_view(func: Any) -> bool:
        schema = func._schema
        return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)

    def result(self) -> AutocastCheck:
        check = AutocastCheck(self.device_type, self.dtype, dict(self.ops), dict(self.matmuls),
                              list(self.wrong), self.wrong_count)
        if self.wrong_count:
            check.problems.append(
                f"Under {self.device_type} autocast ({self.dtype}), {self.wrong_count} op(s) in the first step "
                f"received tensors on another device type; autocast does not touch them, so they run in "
                f"their own dtype (usually float32). First: {'; '.join(self.wrong)}. Fix: move the model "
                f"and batch to the policy's device before the step (torchplace.to_device(batch, device)).")
        total = sum(self.ops.values())
        if self.low_precision and total and not self.ops.get(self.dtype):
            by = ", ".join(f"{k}: {v}" for k, v in sorted(self.ops.items()))
            check.problems.append(
                f"Under {self.device_type} autocast ({self.dtype}), none of the {total} floating-point ops of the "
                f"first step ran in {self.dtype} (ops by dtype: {by}), so autocast changed nothing. Fix: run the "
                f"model's matmuls/convolutions inside the autocast block, on a {self.device_type} device.")
        return check


def report_first_step(check: AutocastCheck, strict: bool, stacklevel: int = 2) -> None:
    """Say what the first step found: raise under strict (DeviceMismatchError for tensors on another
    device type, else PrecisionError), warn (PrecisionWarning) otherwise."""
    if check.ok:
        return
    message = " ".join(check.problems)
    if strict:
        if check.wrong_device_count:
            raise DeviceMismatchError(message)
        raise PrecisionError(message)
    warnings.warn(message, PrecisionWarning, stacklevel=stacklevel + 1)
