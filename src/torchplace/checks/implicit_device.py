"""Placement that depends on the current device: `.cuda()` without an index, `.to("cuda")`,
`.to(torch.device("cuda"))`, on tensors and modules; and, when asked, factory calls that leave the
device implicit (`strict(factories=True)`).

Which GPU "cuda" means is whatever the thread's current device is, and any helper's
`torch.cuda.set_device` changes it. The wrappers below replace `Tensor.to`, `Tensor.cuda`,
`Module.to` and `Module.cuda` only while strict mode is on; each costs a thread-local read and
a type check per call, and looks at frames only when it has found something to report. Calls
made by torch itself (Module.to moving each parameter) are skipped.

Factory calls: `torch.zeros(3)` lands on the default device (the CPU) whatever the model uses, and
`torch.zeros(3, device="cuda")` on whatever GPU is current. Calls made by torch itself, and
those in a module's `__init__` (its buffers move with `.to()`), are left alone. Factories are C functions that
other code calls from everywhere, so this check is a TorchFunctionMode, pushed for the block:
it sees every torch call and so costs what a per-op Python mode costs (35-120% on a launch-bound
step, docs/reference-measurements.md). Meant for a debugging run. (Swapping `torch.zeros` and friends for
Python wrappers would be cheaper but poisons caches torch keys by function identity, e.g. the
set of constructors `with torch.device(...)` redirects, and TorchScript's builtin table.)
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import DeviceError
from ..hardware.accelerator import current_index
from ..shared.strict_switch import active
from . import frames as fr
from ._fixes import DOCS
from .warn_or_raise import warn_or_raise

INDEX_FREE = frozenset({"cpu", "meta", "mps"})  # one device of the type: no index to get wrong


def implicit_device(spec: Any) -> torch.device | None:
    """The device `spec` names when it leaves the index to the current device, else None."""
    if isinstance(spec, str):
        if ":" in spec or spec in INDEX_FREE:
            return None
        try:
            spec = torch.device(spec)
        except RuntimeError:
            return None  # not a device (a dtype name?): torch will say so
    if isinstance(spec, torch.device) and spec.index is None and spec.type not in INDEX_FREE:
        return spec
    return None


def patches() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    """(owner, name, wrapper factory) for every function this check watches."""
    return [(owner, "to", _wrap_to) for owner in (torch.Tensor, torch.nn.Module)] + \
        [(owner, "cuda", _wrap_cuda) for owner in (torch.Tensor, torch.nn.Module)]


def _wrap_to(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = active()
        if config is not None and config.placement:
            device = implicit_device(kwargs.get("device", args[0] if args else None))
            if device is not None and user_called(sys._getframe(1)):
                report_implicit(config.placement, device, f".to({device.type!r})")
        return original(self, *args, **kwargs)

    return to


def _wrap_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = active()
        if config is not None and config.placement:
            spec = kwargs.get("device", args[0] if args else None)
            device = torch.device("cuda") if spec is None else implicit_device(spec)
            if device is not None and user_called(sys._getframe(1)):
                report_implicit(config.placement, device, ".cuda()")
        return original(self, *args, **kwargs)

    return cuda


def user_called(frame: Any) -> bool:
    """False for torch's own calls (Module.to moving each parameter, optimizers' step counters)."""
    return frame is not None and not frame.f_code.co_filename.startswith(fr.TORCH_DIR)


def report_implicit(action: str, device: torch.device, call: str) -> None:
    frame = fr.caller_frame()
    site = fr.site_of(frame) if frame is not None else None
    code = f"`{site.expression}`" if site and site.expression else f"`{call}`"
    index = current_index(device.type)
    now = f" ({device.type}:{index} at the moment)" if index is not None else ""
    message = (f"{code}{f' at {site}' if site else ''} puts it on whatever {device.type} device is current "
               f"in this thread{now}.\nFix: name the device: dev = torchplace.device('{device.type}:0') once, then "
               f".to(dev) or device=dev.\nWhy: any torch.{device.type}.set_device() elsewhere changes the current "
               "device silently; torchplace.strict() asks for named devices.")
    warn_or_raise(action, message, DeviceError, frame)


# --------------------------------------------------------------------------- factory calls

_LIKE_NAMES = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like")
FACTORIES = {getattr(torch, n): n for n in fr.FACTORY_NAMES if hasattr(torch, n)}
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
               "(the default device), whatever the model uses.\nFix: pass device= explicitly, e.g. device=x.device "
               "or a torchplace.device(...).\nWhy: a `with torch.cuda.device(n)` block does not change that.\n"
               f"More: {DOCS}#made-without-a-device")
    warn_or_raise(action, message, DeviceError, frame)
