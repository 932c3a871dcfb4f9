"""Autocast whose device type matches none of the tensors it wraps.

`torch.autocast("cuda")` around a model on the CPU changes nothing: its ops run in fp32 and
no one says a word. Entering autocast under strict mode asks for a deferred check (deferred.py):
at the first module call inside the block, the module's inputs and parameters are compared
with the autocast's device type, once per block. A steady step pays one hook call per block.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..errors import DeviceMismatchError
from . import deferred
from . import frames as fr
from .layout import iter_tensors
from .strict_config import active
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
        tensors = [t for t in _tensors(args) if not (t.device.type == "cpu" and t.dim() == 0)]
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
                   f"on {', '.join(devices)} (first module called: {type(module).__name__}), so autocast changes "
                   f"nothing and those ops run in their own dtype, usually float32. Fix: autocast for the device the "
                   f"model runs on: torch.autocast(device_type=x.device.type, ...), or move the model and batch "
                   f"to {self.device_type}.")
        frame, lineno = (self.where[0], self.where[1]) if self.where else (None, None)
        warn_or_raise(self.action, message, DeviceMismatchError, frame, lineno)


def _tensors(args: tuple[Any, ...]) -> list[torch.Tensor]:
    return [t for _, t in iter_tensors(args, "args", 3)]
