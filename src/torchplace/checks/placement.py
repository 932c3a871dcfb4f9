"""Placement that depends on the current device: `.cuda()` without an index, `.to("cuda")`,
`device=torch.device("cuda")` in a factory, and (when asked) factories that omit the device.

Which GPU "cuda" means is whatever the thread's current device is, and any helper's
`torch.cuda.set_device` changes it. The wrappers below replace `Tensor.to`, `Tensor.cuda`,
`Module.to`, `Module.cuda` and the tensor factories only while strict mode is on; each costs a
thread-local read and a type check per call, and looks at frames only when it has found
something to report. Calls made by torch itself (Module.to moving each parameter) are skipped.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch

from ..errors import DeviceError
from ..placement.scope import current_index
from . import frames as fr
from .report import report
from .state import active

INDEX_FREE = frozenset({"cpu", "meta", "mps"})  # one device of the type: no index to get wrong
FACTORIES = ("tensor", "as_tensor", "empty", "zeros", "ones", "full", "rand", "randn", "randint",
             "randperm", "arange", "linspace", "logspace", "eye", "empty_strided", "scalar_tensor")
LIKE_FACTORIES = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                  "randint_like")  # without a device they follow their input: never "omitted"


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
    out: list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = [
        (torch.Tensor, "to", lambda f: _wrap_to(f, "to")),
        (torch.Tensor, "cuda", lambda f: _wrap_cuda(f, "cuda")),
        (torch.nn.Module, "to", lambda f: _wrap_to(f, "to")),
        (torch.nn.Module, "cuda", lambda f: _wrap_cuda(f, "cuda")),
    ]
    for name in FACTORIES + LIKE_FACTORIES:
        if hasattr(torch, name):
            out.append((torch, name, functools.partial(_wrap_factory, name=name, like=name in LIKE_FACTORIES)))
    return out


def _wrap_to(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = active()
        if config is not None and config.placement:
            device = implicit_device(kwargs.get("device", args[0] if args else None))
            if device is not None and _user_called(sys._getframe(1)):
                _report_implicit(config.placement, device, f".{name}({device.type!r})")
        return original(self, *args, **kwargs)

    return to


def _wrap_cuda(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = active()
        if config is not None and config.placement:
            spec = kwargs.get("device", args[0] if args else None)
            device = torch.device("cuda") if spec is None else implicit_device(spec)
            if device is not None and _user_called(sys._getframe(1)):
                _report_implicit(config.placement, device, f".{name}()")
        return original(self, *args, **kwargs)

    return cuda


def _wrap_factory(original: Callable[..., Any], name: str, like: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def factory(*args: Any, **kwargs: Any) -> Any:
        config = active()
        if config is not None:
            spec = kwargs.get("device")
            if spec is not None:
                device = implicit_device(spec) if config.placement else None
                if device is not None and _user_called(sys._getframe(1)):
                    _report_implicit(config.placement, device, f"torch.{name}(..., device={device.type!r})")
            elif config.factories and not like and _user_called(sys._getframe(1)):
                if not (args and isinstance(args[0], torch.Tensor)) and torch.get_default_device().type == "cpu":
                    _report_omitted(config.factories, name)
        return original(*args, **kwargs)

    return factory


def _user_called(frame: Any) -> bool:
    """False for torch's own calls (Module.to moving each parameter, optimizers' step counters)."""
    return frame is not None and not fr.in_torch(frame.f_code.co_filename)


def _report_implicit(action: str, device: torch.device, call: str) -> None:
    frame = fr.caller_frame()
    site = fr.site_of(frame) if frame is not None else None
    code = f"`{site.expression}`" if site and site.expression else f"`{call}`"
    index = current_index(device.type)
    now = f" ({device.type}:{index} at the moment)" if index is not None else ""
    message = (f"{code}{f' at {site}' if site else ''} places the tensor on whatever {device.type} device is current "
               f"in this thread{now}, and any torch.{device.type}.set_device() elsewhere changes that silently. "
               f"torchplace.strict() asks for named devices. Fix: name the device, e.g. "
               f"dev = torchplace.device('{device.type}:0') once, then .to(dev) or device=dev.")
    report(action, message, DeviceError, frame)


def _report_omitted(action: str, name: str) -> None:
    frame = fr.caller_frame()
    site = fr.site_of(frame) if frame is not None else None
    code = f"`{site.expression}`" if site and site.expression else f"`torch.{name}(...)`"
    message = (f"{code}{f' at {site}' if site else ''} omits the device, so the tensor is made on the CPU "
               f"(the default device) whatever the model uses; a `with torch.cuda.device(n)` block does not "
               f"change that. Fix: pass device= explicitly, e.g. device=x.device or a torchplace.device(...).")
    report(action, message, DeviceError, frame)
