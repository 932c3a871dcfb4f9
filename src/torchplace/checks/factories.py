"""Factory calls that leave the device implicit, checked only when asked (`strict(factories=True)`).

`torch.zeros(3)` lands on the default device (the CPU) whatever the model uses, and
`torch.zeros(3, device="cuda")` on whatever GPU is current. Calls made by torch itself, and
those in a module's `__init__` (its buffers move with `.to()`), are left alone. Factories are C functions that
other code calls from everywhere, so this check is a TorchFunctionMode, pushed for the block:
it sees every torch call and so costs what a per-op Python mode costs (35-120% on a launch-bound
step, docs/reference-measurements.md). Meant for a debugging run. (Swapping `torch.zeros` and friends for
Python wrappers would be cheaper but poisons caches torch keys by function identity, e.g. the
set of constructors `with torch.device(...)` redirects, and TorchScript's builtin table.)
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import DeviceError
from . import frames as fr
from .placement import implicit_device, report_implicit, user_called
from .warn_or_raise import warn_or_raise

_NAMES = ("tensor", "as_tensor", "asarray", "empty", "zeros", "ones", "full", "rand", "randn", "randint",
          "randperm", "arange", "linspace", "logspace", "eye", "empty_strided", "scalar_tensor")
_LIKE_NAMES = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like")
FACTORIES = {getattr(torch, n): n for n in _NAMES if hasattr(torch, n)}
LIKE = {getattr(torch, n): n for n in _LIKE_NAMES if hasattr(torch, n)}  # no device: follows the input


class FactoryCheck(TorchFunctionMode):
    """Reports factory calls with an index-less device, and (omitted=action) without a device."""

    def __init__(self, implicit: str | None, omitted: str | None) -> None:
        super().__init__()
        self.implicit, self.omitted = implicit, omitted

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = FACTORIES.get(func) or LIKE.get(func)
        if name is not None and user_called(sys._getframe(1)):
            spec = kwargs.get("device")
            if spec is not None:
                device = implicit_device(spec)
                if device is not None and self.implicit:
                    report_implicit(self.implicit, device, f"torch.{name}(..., device={device.type!r})")
            elif self.omitted and func in FACTORIES and not (args and isinstance(args[0], torch.Tensor)):
                caller = sys._getframe(1)
                if torch.get_default_device().type == "cpu" and not _in_module_init(caller) \
                        and not _in_data_loading(caller):
                    _report_omitted(self.omitted, name)
        return func(*args, **kwargs)


def _in_module_init(frame: Any) -> bool:
    """Tensors made while a module is built become its buffers and move with .to(): not a mistake."""
    return frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), torch.nn.Module)


_DATA_LOADING = f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}"


def _in_data_loading(frame: Any) -> bool:
    """A Dataset's __getitem__, a collate_fn or a sampler, run by the DataLoader: batches are made on the
    CPU (worker processes cannot make CUDA tensors) and moved by the loop, so the CPU is right there."""
    while frame is not None:
        if _DATA_LOADING in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _report_omitted(action: str, name: str) -> None:
    frame = fr.caller_frame()
    site = fr.site_of(frame) if frame is not None else None
    code = f"`{site.expression}`" if site and site.expression else f"`torch.{name}(...)`"
    message = (f"{code}{f' at {site}' if site else ''} omits the device, so the tensor is made on the CPU "
               f"(the default device) whatever the model uses; a `with torch.cuda.device(n)` block does not "
               f"change that. Fix: pass device= explicitly, e.g. device=x.device or a torchplace.device(...).")
    warn_or_raise(action, message, DeviceError, frame)
