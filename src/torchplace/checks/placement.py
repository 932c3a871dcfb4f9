"""Placement that depends on the current device: `.cuda()` without an index, `.to("cuda")`,
`.to(torch.device("cuda"))`, on tensors and modules.

Which GPU "cuda" means is whatever the thread's current device is, and any helper's
`torch.cuda.set_device` changes it. The wrappers below replace `Tensor.to`, `Tensor.cuda`,
`Module.to` and `Module.cuda` only while strict mode is on; each costs a thread-local read and
a type check per call, and looks at frames only when it has found something to report. Calls
made by torch itself (Module.to moving each parameter) are skipped. Factory calls are checked
by factories.py, on request.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..errors import DeviceError
from ..hardware.accelerator import current_index
from ..shared.strict_switch import active
from . import frames as fr
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
    return frame is not None and not fr.in_torch(frame.f_code.co_filename)


def report_implicit(action: str, device: torch.device, call: str) -> None:
    frame = fr.caller_frame()
    site = fr.site_of(frame) if frame is not None else None
    code = f"`{site.expression}`" if site and site.expression else f"`{call}`"
    index = current_index(device.type)
    now = f" ({device.type}:{index} at the moment)" if index is not None else ""
    message = (f"{code}{f' at {site}' if site else ''} puts it on whatever {device.type} device is current "
               f"in this thread{now}, and any torch.{device.type}.set_device() elsewhere changes that silently. "
               f"torchplace.strict() asks for named devices. Fix: name the device, e.g. "
               f"dev = torchplace.device('{device.type}:0') once, then .to(dev) or device=dev.")
    warn_or_raise(action, message, DeviceError, frame)
