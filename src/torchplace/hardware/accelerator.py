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
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    return None, 0
