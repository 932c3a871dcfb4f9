"""Module-call boundary for the whole-program switch (TORCHPLACE_STRICT=1).

A `strict()` or `watch()` block converts a device mismatch when the block exits. A program run
under the environment switch has no block, so `nn.Module.__call__` is wrapped instead: the
innermost module call that sees PyTorch's mismatch error raises the DeviceMismatchError, named
from the live stack above it and the traceback below. The wrapper is one extra Python frame
per module call and is installed only while the switch is on.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..shared.strict_switch import active
from . import meta
from .mismatch import is_device_mismatch, to_error


def patches() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    return [(torch.nn.Module, "__call__", _wrap_call)]


def _wrap_call(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except RuntimeError as exc:
            config = active()
            if is_device_mismatch(exc):
                raise to_error(exc, config.model if config else None, outer=sys._getframe(1)) from exc
            if meta.is_meta_error(exc):
                raise meta.to_error(exc, config.model if config else None, outer=sys._getframe(1)) from exc
            raise

    return __call__
