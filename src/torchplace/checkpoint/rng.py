"""Capture and restore the random number generators a training step draws from.

Resuming bit for bit needs Python's `random`, numpy's global generator, torch's CPU generator and
the generator of the device the model runs on. Saving never starts CUDA: the CUDA generators are
captured only when CUDA is already initialized (if it is not, nothing has drawn from them).
Restoring does what makes sense on this machine and reports the rest: the saved generator of the
device the model ran on goes to the device it runs on now (cuda:1 on the big box -> cuda:0 on the
small one); other devices' generators, and all of them on a machine without CUDA, are skipped
with the reason.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The current states: python, numpy, cpu, and cuda (one per device) when CUDA is running."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any], device: torch.device, saved_device: str | None) -> tuple[list[str], dict[str, str]]:
    """Restore STATE for a run on DEVICE; SAVED_DEVICE is where the model was when it was saved.

    Returns (restored, skipped): the generators set, and those left alone with the reason.
    """
    restored: list[str] = []
    skipped: dict[str, str] = {}
    for name, setter in (("python", random.setstate), ("numpy", np.random.set_state),
                         ("cpu", lambda s: torch.set_rng_state(s.cpu()))):
        if name not in state:
            continue
        try:
            setter(state[name])
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, KeyError) as exc:
            skipped[name] = f"the saved state is not a {name} generator state ({type(exc).__name__}: {exc})"[:300]
        else:
            restored.append(name)
    saved = state.get("cuda")
    saved = [] if saved is None else saved
    if not isinstance(saved, (list, tuple)) or not all(isinstance(s, torch.Tensor) for s in saved):
        skipped["cuda"] = "the saved CUDA generator states are not a list of tensors"
        return restored, skipped
    if not saved:
        return restored, skipped
    names = [f"cuda:{i}" for i in range(len(saved))]
    if device.type != "cuda":
        for name in names:
            skipped[name] = (f"loading onto {device}; pass device='cuda:N' (or a model on a GPU) to restore it"
                             if torch.cuda.is_available() else "this machine has no usable CUDA device")
        return restored, skipped
    here = device.index if device.index is not None else torch.cuda.current_device()
    src = here
    if saved_device and saved_device.startswith("cuda:"):
        src = int(saved_device.split(":", 1)[1])
    if src >= len(saved):
        src = min(here, len(saved) - 1)
    torch.cuda.set_rng_state(saved[src].cpu(), here)
    restored.append(f"cuda:{here}" + (f" (saved from cuda:{src})" if src != here else ""))
    for i, name in enumerate(names):
        if i != src:
            skipped[name] = f"this run uses cuda:{here}, which got the generator of cuda:{src} (where the model was)"
    return restored, skipped
