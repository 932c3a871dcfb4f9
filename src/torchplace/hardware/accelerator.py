"""Which accelerator this torch build drives and how many devices it shows: asked once, here.

torch is imported on the first call, not at import, so the fact-reading commands stay fast. What
each question costs, read in torch 2.13's source:
- `accelerator_type()`: `torch.accelerator.current_accelerator()` is the build's backend, known
  at compile time; it touches no driver.
- `accelerator()`: `is_available()` on CUDA calls `cudaGetDeviceCount`, which runs `cuInit` (the
  driver loads into this process and a later fork cannot use CUDA) but creates no context and
  takes no GPU memory; with PYTORCH_NVML_BASED_CUDA_CHECK=1 it asks NVML instead. The count,
  `torch.cuda.device_count()`, asks NVML first until CUDA is initialized, whatever that variable.
So code that must leave the driver alone (doctor, pick, map) reads NVML facts (topology, visible)
and never calls `accelerator()`; placement and distributed call it just before they use a device.
"""

from __future__ import annotations

from typing import Any


def accelerator_type() -> str | None:
    """"cuda", "xpu", "mps", ... as this torch build was compiled for, or None; touches no driver."""
    import torch

    acc = getattr(torch, "accelerator", None)
    try:
        found = acc.current_accelerator() if acc is not None else None
    except Exception:  # a torch build without the runtime piece of torch.accelerator
        return None
    return found.type if found is not None else None


def accelerator() -> tuple[str | None, int]:
    """(device type, device count) of the accelerator usable here, or (None, 0); creates no context."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator().type, int(acc.device_count())
    if torch.cuda.is_available():  # cuda-only: a torch whose torch.accelerator cannot answer still has CUDA's own query
        return "cuda", torch.cuda.device_count()  # cuda-only: the fallback for a torch without torch.accelerator
    return None, 0


# -- what a back end offers, asked of its device module ---------------------------------------------
# Every back end, CUDA or not, registers a device module (torch.cuda, torch.xpu, torch.mps, or a
# vendor's torch.npu through torch._register_device_module); torch.accelerator delegates to it.
# The questions below are asked of that module, so they hold for back ends torchplace never named.
# Why not torch.accelerator.current_device_index()/set_device_index()? They go through the C++
# device guard, which a back end written in Python cannot supply in torch 2.13 (its Python guard
# always answers device 0); the device module answers on every back end.

def device_module(device_type: str) -> Any:
    """torch.<device_type> as torch registered it (torch.get_device_module), or None for cpu, meta, or
    a type with no module."""
    import torch

    if device_type in ("cpu", "meta"):
        return None
    try:
        return torch.get_device_module(device_type)
    except (RuntimeError, ValueError, AttributeError):
        return None


def has_streams(device_type: str) -> bool:
    """True when the back end has streams and events to overlap copies with compute (cuda, xpu, npu ...)."""
    mod = device_module(device_type)
    return mod is not None and all(hasattr(mod, name) for name in ("Stream", "Event", "current_stream", "stream"))


def current_index(device_type: str) -> int | None:
    """The thread's current device index of DEVICE_TYPE, or None where the back end has none or is not started
    (asking does not start it)."""
    mod = device_module(device_type)
    if mod is None or not hasattr(mod, "current_device"):
        return None
    if not getattr(mod, "is_initialized", lambda: True)():
        return None
    return int(mod.current_device())


_said: set[tuple[str, str]] = set()


def say_once(device_type: str, feature: str, message: str) -> None:
    """Warn (TorchplaceWarning) that DEVICE_TYPE lacks FEATURE and what torchplace does instead, once per process."""
    import warnings

    from ..errors import TorchplaceWarning

    if (device_type, feature) in _said:
        return
    _said.add((device_type, feature))
    warnings.warn(message, TorchplaceWarning, stacklevel=3)
