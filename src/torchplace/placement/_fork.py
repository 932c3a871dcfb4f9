"""Fork-based DataLoader workers of a process whose accelerator is started (imported by loader.py for its hooks).

torch's CUDA cannot run in a forked child, and freeing a CUDA tensor (or CUDA-pinned memory) calls it,
so a worker whose garbage collector frees inherited garbage holding one aborts ("CUDA error:
initialization error" from ~TensorImpl). Such children leave alone what they inherited (gc.freeze, as
Python's docs advise for fork), and nothing is collected between the fork and that freeze. What a
worker makes itself is collected as ever; a child of a process whose accelerator is not started is
untouched.
"""

from __future__ import annotations

import gc
import os

from ..hardware.accelerator import accelerator_type, device_module

_fork_state = {"accelerator": False, "gc": True}


def _accelerator_started() -> bool:
    """Whether this process has started its accelerator's runtime (torch.cuda.is_initialized() and peers)."""
    kind = accelerator_type()
    is_initialized = getattr(device_module(kind), "is_initialized", None) if kind else None
    return bool(is_initialized()) if callable(is_initialized) else False


def _before_fork() -> None:
    _fork_state["accelerator"] = started = _accelerator_started()
    _fork_state["gc"] = gc.isenabled()
    if started:
        gc.disable()


def _after_fork_in_parent() -> None:
    if _fork_state["accelerator"] and _fork_state["gc"]:
        gc.enable()


def _after_fork_in_child() -> None:
    if _fork_state["accelerator"]:
        gc.freeze()
        if _fork_state["gc"]:
            gc.enable()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
