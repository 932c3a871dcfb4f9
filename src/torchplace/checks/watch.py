"""`torchplace.watch(model)`: turn a device-mismatch error into one that names the culprit.

A context manager (or decorator) with no hooks and no per-op work: a step that succeeds pays
nothing. When PyTorch raises "Expected all tensors to be on the same device" inside the block,
the exception's own traceback is read (see mismatch.py) and a `DeviceMismatchError` naming the
module path, the op, each tensor and the file and line is raised from it.
"""

from __future__ import annotations

from contextlib import ContextDecorator
from types import TracebackType

import torch

from . import meta
from .mismatch import is_device_mismatch, to_error


class Watch(ContextDecorator):
    """The context `watch(model)` returns; stateless, so one instance may be entered anywhere."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.model = model

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is not None and is_device_mismatch(exc):
            raise to_error(exc, self.model) from exc
        if exc is not None and meta.is_meta_error(exc):
            raise meta.to_error(exc, self.model) from exc
        return False


def watch(model: torch.nn.Module | None = None) -> Watch:
    """Report device mismatches raised in the block as `DeviceMismatchError` naming the culprit.

    The lightest check: nothing runs until PyTorch itself raises "Expected all tensors to be on the
    same device"; then the error is rewritten to name the op, each tensor (device, dtype, shape,
    parameter, buffer or batch key) and the module path.

    Args:
        model: the root of module paths (`model.encoder.layers.3.attn`) and of parameter and
            buffer names; without it, paths start at the outermost module that was running.

    Returns:
        A `Watch` context manager.

    Raises:
        DeviceMismatchError: inside the block, an op mixed devices.

    Example:
        ```python
        import torch
        import torchplace as tp

        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        try:
            with tp.watch(model):
                model(torch.randn(2, 4, device="meta"))
        except tp.DeviceMismatchError as err:
            print(err)
        ```
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"watch() takes an nn.Module (or nothing), got {type(model).__name__}. "
                        "Fix: pass the model whose calls you run inside the block.")
    return Watch(model)
