"""A tensor subclass that carries metadata the way torchvision's tv_tensors do.

torchvision's wheel for this torch cannot be imported here (its compiled ops are built for
another torch), so the interop tests use this stand-in: `Boxes` keeps `format` and `canvas_size`
through `.to()`, `.clone()`, `.detach()` and `.pin_memory()` and unwraps to a plain tensor for
every other op, as torchvision's `TVTensor.__torch_function__` does (`BoundingBoxes` is the model).
A real torch subclass, not a mock: every op runs torch's own kernels.
"""

from __future__ import annotations

from typing import Any

import torch

_KEEP = {torch.Tensor.to, torch.Tensor.clone, torch.Tensor.detach, torch.Tensor.pin_memory,
         torch.Tensor.requires_grad_}


class Boxes(torch.Tensor):
    format: str
    canvas_size: tuple[int, int]

    @staticmethod
    def __new__(cls, data: Any, *, format: str, canvas_size: tuple[int, int]) -> Boxes:  # noqa: A002
        t = torch.as_tensor(data).as_subclass(cls)
        t.format, t.canvas_size = format, canvas_size
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _KEEP and isinstance(out, torch.Tensor):
            first = args[0]
            out = out.as_subclass(cls)
            out.format, out.canvas_size = first.format, first.canvas_size
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:  # across DataLoader workers, metadata included
        return (_rebuild, (torch.Tensor(self.as_subclass(torch.Tensor)), self.format, self.canvas_size))


def _rebuild(data: torch.Tensor, fmt: str, canvas_size: tuple[int, int]) -> Boxes:
    return Boxes(data, format=fmt, canvas_size=canvas_size)
