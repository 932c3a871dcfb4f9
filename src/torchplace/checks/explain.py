"""`torchplace.explain(model, *inputs, optimizer=None)`: where everything lives, and what is wrong.

Reads, never runs: parameters and buffers grouped by module and device (layout.py), inputs by
their path in the batch, optimizer state by device, and the problems found:

- a module whose own parameters and buffers are on different devices;
- a model spread over devices (fine when deliberate, e.g. torchplace.place; a bug otherwise);
- tensors kept as plain attributes, which `.to()` does not move;
- inputs on a device that holds none of the model;
- optimizer state on another device than its parameter (state made before `model.to()`),
  and optimizer parameters that are not the model's;
- DataParallel / DistributedDataParallel whose first device does not hold the model.

The result is a dict (for code) that renders as rich tables (`print(result)`, `.print()`).
"""

from __future__ import annotations

import io
from collections import Counter
from typing import Any

import torch

from .layout import iter_tensors, model_devices, module_groups, own_tensors, plain_attributes

_CPU = torch.device("cpu")


class Explanation(dict):
    """explain()'s answer: a plain dict with a terminal rendering."""

    @property
    def problems(self) -> list[dict[str, str]]:
        return self["problems"]

    def __rich__(self) -> Any:
        from ._render import render

        return render(self)

    def print(self) -> None:
        """Print the tables to the terminal."""
        from rich.console import Console

        Console().print(self)

    def __str__(self) -> str:
        from rich.console import Console

        out = io.StringIO()
        Console(file=out, width=120, color_system=None).print(self)
        return out.getvalue()


def explain(model: torch.nn.Module, *inputs: Any, optimizer: torch.optim.Optimizer | None = None) -> Explanation:
    """Where `model`'s parameters and buffers, the `inputs` and the `optimizer` state live, and the problems."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"explain() takes the model (an nn.Module) first, got {type(model).__name__}. "
                        "Fix: explain(model, batch, optimizer=opt).")
    problems: list[dict[str, str]] = []
    devices = model_devices(model)
    groups = module_groups(model, "model")
    result = Explanation(
        model={"type": type(model).__name__, "devices": devices,
               "parameters": sum(g.elements for g in groups if g.parameters),
               "bytes": sum(g.bytes for g in groups)},
        modules=[g.to_dict() for g in groups],
        plain_attributes=[],
        inputs=[],
        optimizer=None,
        problems=problems,
    )
    _check_modules(model, groups, devices, problems)
    result["plain_attributes"] = _check_attributes(model, problems)
    result["inputs"] = _check_inputs(inputs, devices, problems)
    if optimizer is not None:
        result["optimizer"] = _check_optimizer(model, optimizer, problems)
    _check_parallel(model, problems)
    return result


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"device": str(tensor.device), "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape)}


def _problem(problems: list[dict[str, str]], kind: str, where: str, severity: str, message: str) -> None:
    problems.append({"kind": kind, "where": where, "severity": severity, "message": message})


def _check_modules(model: torch.nn.Module, groups: list[Any], devices: list[str],
                   problems: list[dict[str, str]]) -> None:
    own_split = Counter(g.module for g in groups if g.own)
    for name, module in model.named_modules():
        path = f"model.{name}" if name else "model"
        if own_split.get(path, 0) < 2:
            continue
        where = ", ".join(f"{key} on {t.device}" for _, key, t in own_tensors(module))
        _problem(problems, "split-module", path, "error",
                 f"{path} ({type(module).__name__}) has its own tensors on different devices ({where}); its "
                 f"forward will fail with a device mismatch. Fix: move the whole module: {path}.to(device).")
    if len(devices) > 1:
        parts = "; ".join(f"{g.module} on {g.device}" for g in groups[:8])
        _problem(problems, "model-split", "model", "warning",
                 f"the model spans {', '.join(devices)} ({parts}). Fine if deliberate (pipeline or "
                 f"torchplace.place); otherwise a submodule missed model.to(device), e.g. one added or "
                 f"replaced after the move.")


def _check_attributes(model: torch.nn.Module, problems: list[dict[str, str]]) -> list[dict[str, Any]]:
    out = []
    devices = model_devices(model)
    for path, tensor in plain_attributes(model):
        entry = {"name": path, **describe(tensor)}
        out.append(entry)
        elsewhere = bool(devices) and str(tensor.device) not in devices
        _problem(problems, "plain-attribute", path, "error" if elsewhere else "warning",
                 f"{path} is a tensor kept as a plain attribute on {tensor.device}"
                 + (f", while the model is on {', '.join(devices)}" if elsewhere else "")
                 + "; model.to() does not move it. Fix: self.register_buffer(name, tensor, persistent=False) "
                 "in __init__ (persistent=True if it belongs in the state_dict).")
    return out


def _check_inputs(inputs: tuple[Any, ...], devices: list[str], problems: list[dict[str, str]]) -> list[dict[str, Any]]:
    out = []
    for path, tensor in iter_tensors(list(inputs), "inputs"):
        entry = {"path": path, **describe(tensor)}
        out.append(entry)
        scalar = tensor.device == _CPU and tensor.dim() == 0
        if devices and not scalar and str(tensor.device) not in devices:
            _problem(problems, "input-device", path, "error",
                     f"{path} is on {tensor.device}, but the model is on {', '.join(devices)}. Fix: move the batch "
                     f"first: torchplace.to_device(batch, {devices[0]!r}).")
    return out


def _check_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     problems: list[dict[str, str]]) -> dict[str, Any]:
    names = {id(p): f"model.{n}" for n, p in model.named_parameters(remove_duplicate=False)}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in params if id(p) not in names]
    by_device: Counter[str] = Counter()
    wrong: list[str] = []
    for param in params:
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            by_device[str(value.device)] += 1
            if value.device != param.device and not (value.device == _CPU and value.dim() == 0):
                wrong.append(f"{names.get(id(param), 'a parameter')}['{key}'] on {value.device} "
                             f"(parameter on {param.device})")
    if wrong:
        shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        _problem(problems, "optimizer-state-device", "optimizer", "error",
                 f"{len(wrong)} optimizer state tensor(s) are on another device than their parameter: {shown}. "
                 f"This happens when the optimizer stepped (or loaded a state_dict) before model.to(device): "
                 f"Module.to moves parameters in place, not the optimizer's state. Fix: move the model before "
                 f"the first step, or load the optimizer's state_dict after the move (it follows each parameter).")
    if foreign:
        _problem(problems, "optimizer-foreign-parameters", "optimizer", "warning",
                 f"the optimizer updates {len(foreign)} tensor(s) that are not parameters of this model (of "
                 f"{len(params)}); a model rebuilt or replaced after the optimizer was made is not trained. "
                 f"Fix: build the optimizer from model.parameters() after the model is final.")
    return {"type": type(optimizer).__name__, "parameters": len(params), "foreign_parameters": len(foreign),
            "state_devices": dict(sorted(by_device.items())), "misplaced_state": wrong}


def _check_parallel(model: torch.nn.Module, problems: list[dict[str, str]]) -> None:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    for name, module in model.named_modules():
        if not isinstance(module, (DataParallel, DistributedDataParallel)):
            continue
        ids = getattr(module, "device_ids", None) or []
        if not ids:
            continue
        first = ids[0] if isinstance(ids[0], torch.device) else torch.device("cuda", int(ids[0]))
        held = model_devices(module.module)
        if held and held != [str(first)]:
            path = f"model.{name}" if name else "model"
            _problem(problems, "parallel-first-device", path, "error",
                     f"{path} is a {type(module).__name__} over devices {[str(d) for d in ids]}, whose first "
                     f"device {first} must hold the whole model, but it is on {', '.join(held)}. Fix: "
                     f"model.to({str(first)!r}) before wrapping (or list that device first in device_ids).")
