"""Capture and restore the random number generators a training step draws from.

Resuming bit for bit needs Python's `random`, numpy's global generator, torch's CPU generator and
the generator of the device the model runs on. Saving never starts CUDA: the CUDA generators are
captured only when CUDA is already initialized (if it is not, nothing has drawn from them).
Restoring does what makes sense on this machine and reports the rest: the saved generator of the
device the model ran on goes to the device it runs on now (cuda:1 on the big box -> cuda:0 on the
small one); other devices' generators, and all of them on a machine without CUDA, are skipped
with the reason. Another accelerator's generators (xpu, a vendor's npu) are kept the same way,
under its device type, through its device module.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..hardware.accelerator import accelerator_type, device_module


def capture() -> dict[str, Any]:
    """The current states: python, numpy, cpu, and the accelerator's (one per device) when it is running:
    "cuda", or the type of another back end ("xpu", a vendor's "npu" ...)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "cpu": torch.get_rng_state()}
    # cuda-only: CUDA's states are kept under 'cuda' beside another back end's, as before
    if torch.cuda.is_initialized():  # cuda-only: CUDA's states are kept under 'cuda'
        state["cuda"] = torch.cuda.get_rng_state_all()  # cuda-only: CUDA's states are kept under 'cuda'
    kind = accelerator_type()
    mod = device_module(kind) if kind not in (None, "cuda") else None
    if mod is not None and hasattr(mod, "get_rng_state_all") and getattr(mod, "is_initialized", lambda: True)():
        state[kind] = mod.get_rng_state_all()
    return state


def restore(state: dict[str, Any], device: torch.device, saved_device: str | None) -> tuple[list[str], dict[str, str]]:
    """Restore STATE for a run on DEVICE; SAVED_DEVICE is where the model was when it was saved.

    Returns (restored, skipped): the generators set, and those left alone with the reason.
    """
    restored: list[str] = []
    skipped: dict[str, str] = {}
    for name, setter in (("python", random.setstate), ("numpy", _set_numpy),
                         ("cpu", lambda s: torch.set_rng_state(s.cpu()))):
        if name not in state:
            continue
        try:
            setter(state[name])
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, KeyError) as exc:
            skipped[name] = f"the saved state is not a {name} generator state ({type(exc).__name__}: {exc})"[:300]
        else:
            restored.append(name)
    for kind in [k for k in state if k not in ("python", "numpy", "cpu")]:
        _restore_device(kind, state[kind], device, saved_device, restored, skipped)
    return restored, skipped


def _set_numpy(state: Any) -> None:
    """numpy's global state; its key array may come as a tensor (a torch.save file holds no numpy array)."""
    if isinstance(state, (tuple, list)) and len(state) > 1 and isinstance(state[1], torch.Tensor):
        state = (state[0], state[1].numpy().astype(np.uint32), *state[2:])
    np.random.set_state(state)


def _restore_device(kind: str, saved: Any, device: torch.device, saved_device: str | None,
                    restored: list[str], skipped: dict[str, str]) -> None:
    """The generator of the device the model ran on (of back end KIND) onto DEVICE, if it is one of KIND."""
    label = "CUDA" if kind == "cuda" else kind
    saved = [] if saved is None else saved
    if not isinstance(saved, (list, tuple)) or not all(isinstance(s, torch.Tensor) for s in saved):
        skipped[kind] = f"the saved {label} generator states are not a list of tensors"
        return
    if not saved:
        return
    names = [f"{kind}:{i}" for i in range(len(saved))]
    mod = device_module(kind)
    usable = mod is not None and hasattr(mod, "set_rng_state") and mod.is_available()
    if device.type != kind or not usable:
        for name in names:
            skipped[name] = (f"loading onto {device}; pass device='{kind}:N' (or a model on a {label} device) to "
                             f"restore it" if usable else f"this machine has no usable {label} device")
        return
    here = device.index if device.index is not None else int(mod.current_device())
    src = here
    index = saved_device.split(":", 1)[1] if saved_device and saved_device.startswith(f"{kind}:") else ""
    if index.isascii() and index.isdigit() and len(index) < 6:  # the file's word: 'cuda:x' is no index
        src = int(index)
    if src >= len(saved):
        src = min(here, len(saved) - 1)
    try:
        mod.set_rng_state(saved[src].cpu(), here)
    except (TypeError, ValueError, RuntimeError) as exc:
        why = f"the saved state is not a {label} generator state ({type(exc).__name__}: {exc})"
        skipped[f"{kind}:{here}"] = why[:300]
        return
    restored.append(f"{kind}:{here}" + (f" (saved from {kind}:{src})" if src != here else ""))
    for i, name in enumerate(names):
        if i != src:
            skipped[name] = (f"this run uses {kind}:{here}, which got the generator of {kind}:{src} "
                             "(where the model was)")
