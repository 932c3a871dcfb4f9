"""Where a model's parameters and buffers live, grouped by module and device.

The view is collapsed: a module whose whole subtree sits on one device is one row; only
subtrees that span devices are opened, down to the modules that own tensors on several
devices. A model on one device is one row however deep it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..shared.tree import tensors_with_paths


@dataclass
class ModuleGroup:
    """The tensors of one module (its whole subtree, or only its own when `own`) on one device."""

    module: str
    type: str
    device: str
    parameters: int = 0  # tensors
    buffers: int = 0
    elements: int = 0
    bytes: int = 0
    own: bool = False  # only the module's own tensors (its subtree spans devices)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def own_tensors(module: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) for the parameters and buffers a module registers itself."""
    for name, p in module._parameters.items():
        if p is not None:
            yield "parameter", name, p
    for name, b in module._buffers.items():
        if b is not None:
            yield "buffer", name, b


def subtree_devices(root: torch.nn.Module) -> dict[int, frozenset[str]]:
    """id(module) -> the devices its subtree's tensors are on."""
    out: dict[int, frozenset[str]] = {}
    _visit(root, out)
    return out


def _visit(module: torch.nn.Module, out: dict[int, frozenset[str]]) -> frozenset[str]:
    """MODULE's subtree devices, recorded in OUT (a module function: a recursive closure is a reference cycle)."""
    if id(module) in out:
        return out[id(module)]
    devices = {str(t.device) for _, _, t in own_tensors(module)}
    for child in module._modules.values():
        if child is not None:
            devices |= _visit(child, out)
    out[id(module)] = frozenset(devices)
    return out[id(module)]


def module_groups(root: torch.nn.Module, label: str = "model") -> list[ModuleGroup]:
    """The collapsed placement view of `root` (see the module docstring)."""
    devices = subtree_devices(root)
    seen: set[int] = set()
    rows: list[ModuleGroup] = []

    def add(module: torch.nn.Module, path: str, recurse: bool) -> dict[str, ModuleGroup]:
        by_device: dict[str, ModuleGroup] = {}
        modules = module.modules() if recurse else iter([module])
        for sub in modules:
            for kind, _, tensor in own_tensors(sub):
                if id(tensor) in seen:
                    continue  # tied weights count once
                seen.add(id(tensor))
                device = str(tensor.device)
                row = by_device.setdefault(device, ModuleGroup(path, type(module).__name__, device, own=not recurse))
                if kind == "parameter":
                    row.parameters += 1
                else:
                    row.buffers += 1
                row.elements += tensor.numel()
                row.bytes += tensor.numel() * tensor.element_size()
        return by_device

    def visit(module: torch.nn.Module, path: str) -> None:
        if len(devices[id(module)]) <= 1:
            rows.extend(add(module, path, recurse=True).values())
            return
        rows.extend(add(module, path, recurse=False).values())
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{path}.{name}")

    visit(root, label)
    return rows


def model_devices(root: torch.nn.Module) -> list[str]:
    """The devices a model's parameters and buffers are on, sorted."""
    return sorted(subtree_devices(root)[id(root)])


MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # _parameters, _buffers, hooks: torch's own


def plain_attributes(root: torch.nn.Module, label: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors kept on modules as plain attributes (not parameters or buffers): `.to()` skips them."""
    for name, module in root.named_modules():
        prefix = f"{label}.{name}" if name else label
        for key, value in vars(module).items():
            if key in MODULE_INTERNALS:
                continue
            for path, tensor in tensors_with_paths(value, f"{prefix}.{key}", depth=1, items=256):
                if not isinstance(tensor, torch.nn.Parameter):
                    yield path, tensor
