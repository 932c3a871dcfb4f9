"""Seeing through model wrappers: the user's module inside DDP, DataParallel, torch.compile, Fabric.

Checkpoints save the inner module's keys and the checks name the inner module's paths, so both
peel wrappers the same way.
"""

from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DataParallel / DistributedDataParallel / torch.compile / Fabric wrappers."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner = model.module
        elif type(model).__name__ == "OptimizedModule":
            inner = getattr(model, "_orig_mod", None)
        elif type(model).__name__ == "_FabricModule":  # Lightning Fabric's wrapper (around DDP, FSDP, ...)
            inner = getattr(model, "_original_module", None)
        else:
            return model
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def meta_names(model: nn.Module) -> list[str]:
    """MODEL's parameters and buffers (non-persistent ones too) that live on the meta device: a model
    built under `torch.device("meta")` or accelerate's init_empty_weights, waiting for its weights."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return [name for name, t in named if t.is_meta]
