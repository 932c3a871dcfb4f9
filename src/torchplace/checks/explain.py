"""`torchplace.explain(model, *inputs, optimizer=None)`: where everything lives, and what is wrong.

Parameters and buffers grouped by module and device (layout.py), inputs by their path in the
batch, optimizer state by device, and the problems found. Given inputs, it also runs the forward
once (under torch.no_grad(), buffers restored afterwards) and judges by what the forward does: a
device mismatch there is reported with its culprit (as watch() names it), and placement that
only looks odd (a CPU index or lengths tensor, a host-only attribute, a deliberate split) is a
note, not an alarm, when the forward ran. Problems looked for:

- a module whose own parameters and buffers are on different devices;
- a model spread over devices (fine when deliberate, e.g. torchplace.place; a bug otherwise);
- tensors kept as plain attributes, which `.to()` does not move;
- inputs on a device that holds none of the model;
- optimizer state on another device than its parameter (state made before `model.to()`),
  and optimizer parameters that are not the model's;
- DataParallel / DistributedDataParallel whose first device does not hold the model;
- modules kept in plain lists or dicts (model.to() skips them), and companions passed beside
  the inputs (a loss, a metric, a scheduler: any module or object holding tensors) that sit on
  another device than the model.

Called inside the user's training step, it also runs that step again on fake tensors (_dry_run.py):
what torch itself refuses there (a loss, metric, labels or a tensor made without a device) is named
as watch() names it, with the step's line; the line that calls the model; the optimizer that steps.

The result is a dict (for code) that renders as rich tables (`print(result)`, `.print()`).
"""

from __future__ import annotations

import io
import sys
from collections import Counter
from typing import Any

import torch

from ..shared.tree import tensors_with_paths
from ..shared.wrappers import unwrap
from . import _dry_run as dry_run
from ._fixes import failed
from .layout import _MODULE_INTERNALS, model_devices, module_groups, own_tensors, plain_attributes
from .meta import annotate as annotate_meta

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
    """Where a model's parameters and buffers, the inputs and the optimizer state live, and the problems.

    Looks without changing anything: each module's devices, plain tensor attributes that `.to()`
    would not move, inputs on another device than the layers that read them, optimizer state on
    another device than its parameters, DataParallel pitfalls; with inputs, one forward is run and
    its outcome reported. Called at the top of the training step, it also runs that step again on
    fake tensors (no data, no kernels; the user's tensors and objects are put back): what torch
    refuses there (a loss, metric, labels or tensors mixed with the model's output) is named with its
    line; the step's Python side effects beyond its arguments are not undone (see docs/strict-mode.md).

    Args:
        model: the model to examine.
        *inputs: a batch as the model takes it (tensors or nested containers), optional.
        optimizer: its state is checked against the parameters' devices.

    Returns:
        An `Explanation`: a plain dict (`model`, `modules`, `inputs`, `optimizer`, `forward`, `step`,
        `problems`) that prints as tables (`print()`) or text (`str()`).

    Raises:
        TypeError: `model` is not an `nn.Module`.

    Example:
        ```python
        import torch
        import torchplace as tp

        model = torch.nn.Linear(8, 2)
        report = tp.explain(model, torch.randn(2, 8), optimizer=torch.optim.Adam(model.parameters()))
        print(report.problems or "no problems")
        ```
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"explain() takes the model (an nn.Module) first, got {type(model).__name__}. "
                        "Fix: explain(model, batch, optimizer=opt).")
    if dry_run.running() is not None:  # explain()'s own re-run of the step that called it: the report being made
        return dry_run.running()  # type: ignore[no-any-return]
    problems: list[dict[str, str]] = []
    inner = unwrap(model)  # through DDP, DataParallel, torch.compile, Fabric: the paths the user's class has
    devices = model_devices(inner)
    groups = module_groups(inner, "model")
    result = Explanation(
        model={"type": type(inner).__name__, "devices": devices,
               "parameters": sum(g.elements for g in groups if g.parameters),
               "bytes": sum(g.bytes for g in groups)},
        modules=[g.to_dict() for g in groups],
        plain_attributes=[],
        inputs=[],
        optimizer=None,
        problems=problems,
    )
    companions = [(i, v) for i, v in enumerate(inputs) if _is_companion(v)]
    args = tuple(v for v in inputs if not _is_companion(v))
    _check_modules(inner, groups, devices, problems)
    result["plain_attributes"] = _check_attributes(inner, problems)
    result["inputs"] = _check_inputs(args, devices, problems)
    _check_unregistered(inner, devices, problems)
    _check_parallel(model, problems)
    result["forward"] = _run_forward(model, args, problems) if args else "not run: no inputs given"
    reading = dry_run.read_callers(sys._getframe(1), model, [v for _, v in companions], result)
    result["step"] = reading.ran
    _check_companions(companions, devices, problems, reading.used)
    if reading.ran == "ran":  # torch ran the step: placement that looked odd is fine
        _accepted(problems, "The step ran on fake tensors with these devices", (*_LOOKS_ODD, "companion-device"))
    params = {id(p) for p in model.parameters()}
    steps = {id(o): site for o, site in reversed(reading.optimizers)}  # the nearest frame's line
    if optimizer is None:  # the optimizer that steps in the caller's code, when all its parameters are the model's
        optimizer = next((o for o, _ in reading.optimizers
                          if all(id(p) in params for g in o.param_groups for p in g["params"])), None)
    if optimizer is not None:
        result["optimizer"] = _check_optimizer(model, optimizer, problems)
    for p in problems:  # the user's lines: where the model is called, where the optimizer steps
        if p["kind"] in _FAILS_IN_CALL and p["severity"] == "error" and reading.model_calls:
            p["message"] += f"\nThe model is called at {reading.model_calls[0]}."
        elif p["kind"] == "optimizer-state-device" and id(optimizer) in steps:
            p["message"] += f"\nThe optimizer steps at {steps[id(optimizer)]}."
    forward_failed = result["forward"] in ("device mismatch", "meta tensor used for its data")
    problems += [p for p in reading.problems if not (forward_failed and reading.in_model)]  # said once
    annotate_meta(inner, problems)
    return result


_FAILS_IN_CALL = ("mismatch", "input-device", "parallel-first-device")


_LOOKS_ODD = ("input-device", "plain-attribute", "model-split")


def _is_companion(value: Any) -> bool:
    """A loss, metric or scheduler passed beside the inputs: a module, or an object holding tensors."""
    if isinstance(value, torch.nn.Module):
        return True
    if isinstance(value, (torch.Tensor, dict, list, tuple)) or not hasattr(value, "__dict__"):
        return False
    return any(isinstance(v, torch.Tensor) for v in vars(value).values())


def _run_forward(model: torch.nn.Module, args: tuple[Any, ...], problems: list[dict[str, str]]) -> str:
    """Run model(*args) once; a device mismatch becomes a problem naming its culprit, and placement that
    only looked odd becomes a note when the forward ran (torch accepted it)."""
    from ..errors import DeviceMismatchError, MetaTensorError
    from .watch import watch

    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad(), watch(model):
            model(*args)
    except (DeviceMismatchError, MetaTensorError) as exc:  # a meta tensor used for its data: named as watch() does
        report = getattr(exc, "report", None)
        where = getattr(report, "module", None) or "model"
        no_data = isinstance(exc, MetaTensorError)
        _problem(problems, "meta-tensor" if no_data else "mismatch", where, "error", failed("the forward fails", exc))
        return "meta tensor used for its data" if no_data else "device mismatch"
    except Exception as exc:  # inputs the forward does not take (a whole batch): the static findings stand
        return f"not run: model(*inputs) raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                if buffer.device == value.device and buffer.shape == value.shape:
                    buffer.copy_(value)
    _accepted(problems, "The forward ran with these inputs")
    return "ran"


def _accepted(problems: list[dict[str, str]], how: str, kinds: tuple[str, ...] = _LOOKS_ODD) -> None:
    """Placement that only looked odd becomes a note once torch ran the code with it."""
    for p in problems:
        if p["kind"] in kinds and p["severity"] != "note":
            p["severity"] = "note"
            first, nl, rest = p["message"].partition("\n")
            p["message"] = f"{first} ({how}, so torch accepts this placement.){nl}{rest}"


def _companion_names(values: list[Any]) -> dict[int, str]:
    """The caller's names for the companions (`criterion`), read from the frames that called explain()."""
    out: dict[int, str] = {}
    frame = sys._getframe(3)
    for _ in range(4):
        if frame is None:
            break
        for name, value in frame.f_locals.items():
            if name not in ("inputs", "args", "self") and any(value is v for v in values):
                out.setdefault(id(value), name)
        frame = frame.f_back
    return out


def _check_companions(companions: list[tuple[int, Any]], devices: list[str],
                      problems: list[dict[str, str]], called: dict[int, str]) -> None:
    if not companions or not devices:
        return
    names = _companion_names([v for _, v in companions])
    for index, value in companions:
        label = names.get(id(value), f"inputs[{index}]")
        if isinstance(value, torch.nn.Module):
            tensors = [(f"{label}.{n}", t) for n, t in [*value.named_parameters(), *value.named_buffers()]]
            tensors += list(plain_attributes(value, label))
        else:
            tensors = [(f"{label}.{k}", t) for k, t in vars(value).items() if isinstance(t, torch.Tensor)]
        away = [(path, t) for path, t in tensors if str(t.device) not in devices and t.dim() > 0]
        if away:
            shown = ", ".join(f"{path} on {t.device}" for path, t in away[:4])
            used = [f"{label}.{key} at {at}" for key in dict.fromkeys(path.split(".")[1] for path, _ in away[:4])
                    if (at := _used_at(type(value), key))]
            _problem(problems, "companion-device", label, "error",
                     f"{label} ({type(value).__name__}) keeps {shown}, while the model is on {', '.join(devices)}. "
                     f"Fix: {label}.to({devices[0]!r}).\nIt is not part of the model, so model.to() does not move it "
                     "(or make it a submodule of the model)"
                     + (f"; its own code uses {'; '.join(used)}" if used else "")
                     + (f"; it is called at {called[id(value)]}" if id(value) in called else "") + ".")


def _check_unregistered(model: torch.nn.Module, devices: list[str], problems: list[dict[str, str]]) -> None:
    """Modules kept in plain lists, tuples or dicts: model.to() and model.parameters() skip them."""
    for name, module in model.named_modules():
        prefix = f"model.{name}" if name else "model"
        for key, value in vars(module).items():
            if key in _MODULE_INTERNALS or not isinstance(value, (list, tuple, dict)):
                continue
            items = list(value.items() if isinstance(value, dict) else enumerate(value))[:256]
            held = [(f"{prefix}.{key}[{k!r}]", m) for k, m in items if isinstance(m, torch.nn.Module)]
            if not held:
                continue
            kind = "dict" if isinstance(value, dict) else type(value).__name__
            wrapper = "nn.ModuleDict" if isinstance(value, dict) else "nn.ModuleList"
            away = [(f"{path}.{n}", t.device) for path, m in held
                    for n, t in [*m.named_parameters(), *m.named_buffers()] if devices and str(t.device) not in devices]
            where = "; ".join(f"{path} on {d}" for path, d in away[:4])
            used = _used_at(type(module), key)
            _problem(problems, "unregistered-module", f"{prefix}.{key}", "error" if away else "warning",
                     f"{prefix}.{key} is a plain Python {kind} of {len(held)} module(s), which model.to() does not "
                     f"see. Fix: {prefix}.{key} = {wrapper}(...).\n{', '.join(p for p, _ in held[:4])}: "
                     "model.to(), model.parameters() and the state_dict do not see them"
                     + (f", and they are elsewhere: {where}" if away else "") + (f"; used at {used}" if used else "")
                     + ".")


def _used_at(cls: type, attr: str) -> str | None:
    """Where the user's class CLS first reads `self.ATTR` outside __init__ ('corpus.py:322 in
    validation_step()'), from its source; None for library classes or when no method uses it."""
    import ast
    import inspect

    from .frames import TORCH_DIR, is_installed, short_path

    for klass in cls.__mro__:
        try:
            filename = inspect.getsourcefile(klass) or ""
            lines, first = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        if not filename or filename.startswith(TORCH_DIR) or is_installed(filename):
            continue
        try:
            tree = ast.parse(inspect.cleandoc("\n" + "".join(lines)) if lines[0][:1].isspace() else "".join(lines))
        except SyntaxError:
            continue
        found = [node.lineno for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and fn.name != "__init__" for node in ast.walk(fn)
                 if isinstance(node, ast.Attribute) and node.attr == attr
                 and isinstance(node.value, ast.Name) and node.value.id == "self"]
        if found:
            lineno = first + min(found) - 1
            method = next(fn.name for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and fn.lineno <= min(found) <= (fn.end_lineno or fn.lineno))
            return f"{short_path(filename)}:{lineno} in {method}()"
    return None


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"device": str(tensor.device), "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape)}


def _problem(problems: list[dict[str, str]], kind: str, where: str, severity: str, message: str) -> None:
    """MESSAGE: what and the fix on its first line (a table cell), the details on the lines after it."""
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
                 f"{path} ({type(module).__name__}) has its own tensors on different devices: its forward will fail. "
                 f"Fix: move the whole module: {path}.to(device).\nIts tensors: {where}.")
    if len(devices) > 1:
        parts = "; ".join(f"{g.module} on {g.device}" for g in groups[:8])
        _problem(problems, "model-split", "model", "warning",
                 f"the model spans {', '.join(devices)} (fine if deliberate: a pipeline, torchplace.place). Fix: "
                 f"call model.to(device) once it is built.\nWhere: {parts}. A submodule added or replaced after "
                 "the move stays behind.")


def _check_attributes(model: torch.nn.Module, problems: list[dict[str, str]]) -> list[dict[str, Any]]:
    out = []
    devices = model_devices(model)
    for path, tensor in plain_attributes(model):
        entry = {"name": path, **describe(tensor)}
        out.append(entry)
        elsewhere = bool(devices) and str(tensor.device) not in devices
        _problem(problems, "plain-attribute", path, "error" if elsewhere else "warning",
                 f"{path} is a plain tensor attribute on {tensor.device}"
                 + (f" (the model on {', '.join(devices)})" if elsewhere else "")
                 + ": model.to() skips it. Fix: self.register_buffer(name, tensor, persistent=False).\nRegister it in "
                 "__init__; persistent=True puts it in the state_dict too.")
    return out


def _check_inputs(inputs: tuple[Any, ...], devices: list[str], problems: list[dict[str, str]]) -> list[dict[str, Any]]:
    out = []
    for path, tensor in tensors_with_paths(list(inputs), "inputs", depth=4, items=256):
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
                 f"{len(wrong)} optimizer state tensor(s) are on another device than their parameter. Fix: move the "
                 f"model before the first step.\nFirst: {shown}. The optimizer stepped (or loaded a state_dict) "
                 "before model.to(device), which moves parameters, not the optimizer's state. Or load the "
                 "optimizer's state_dict after the move (it follows each parameter).")
    if foreign:
        _problem(problems, "optimizer-foreign-parameters", "optimizer", "warning",
                 f"the optimizer updates {len(foreign)} of {len(params)} tensor(s) that are not this model's. Fix: "
                 "build the optimizer from model.parameters() once the model is final.\nA model rebuilt or "
                 "replaced after the optimizer was made is not trained.")
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
                     f"{path} is a {type(module).__name__} whose first device {first} must hold the model, but it "
                     f"is on {', '.join(held)}. Fix: model.to({str(first)!r}) before wrapping.\nIts devices: "
                     f"{[str(d) for d in ids]}; or list the model's device first in device_ids.")
