"""Seeing through model wrappers: the user's module inside DDP, DataParallel, torch.compile, Fabric.

Checkpoints save the inner module's keys and the checks name the inner module's paths, so both
peel wrappers the same way.
"""

from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DataParallel / DistributedDataParallel / torch.compile / Fabric wrappers."""
    return reach(model)[1]


def reach(model: nn.Module) -> tuple[str, nn.Module]:
    """(how code reaches it, the module inside the wrappers): `.module` through DataParallel and DDP, nothing
    through torch.compile and Fabric, which pass attribute lookups on to the module they wrap."""
    path = ""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner, step = model.module, ".module"
        elif type(model).__name__ == "OptimizedModule":
            inner, step = getattr(model, "_orig_mod", None), ""
        elif type(model).__name__ == "_FabricModule":  # Lightning Fabric's wrapper (around DDP, FSDP, ...)
            inner, step = getattr(model, "_original_module", None), ""
        else:
            return path, model
        if not isinstance(inner, nn.Module):
            return path, model
        path, model = path + step, inner


def meta_names(model: nn.Module) -> list[str]:
    """MODEL's parameters and buffers (non-persistent ones too) that live on the meta device: a model
    built under `torch.device("meta")` or accelerate's init_empty_weights, waiting for its weights."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return [name for name, t in named if t.is_meta]
