"""The first-step check behind `PrecisionPolicy.autocast()`: what actually ran under autocast.

A `TorchDispatchMode` sees every aten op after autocast has cast its inputs, so it observes the
kernels that really ran: it counts floating-point ops by output dtype and notes inputs on a
device type other than the autocast's (CPU tensors under CUDA autocast are untouched by it and
run in fp32). Copy ops and views are neither counted nor checked; 0-dim CPU tensors (wrapped scalars) are allowed.
The mode is active for one step only, because a Python mode on every op costs 35-120% on
launch-bound steps (docs/reference-measurements.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


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
            if tensor.device.type != self.device_type and not (tensor.device.type == "cpu" and tensor.dim() == 0):
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
