"""`torchplace.explain(model, *inputs, optimizer=None, step=None, device=None)`: where everything lives, and
what torch refuses.

Parameters and buffers grouped by module and device (layout.py), inputs by their path in the batch,
optimizer state by device. The step (given, or the user's function that called explain()), else the
forward, runs once on fake tensors (_dry_run.py): what torch refuses is an error named as watch() names it;
where tensors only sit oddly (plain attributes, inputs elsewhere, split modules, optimizer state left
behind) is a note, or the explanation beside a failure it caused.
"""

from __future__ import annotations

import io
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ..shared.tree import tensors_with_paths
from ..shared.wrappers import unwrap
from . import _dry_run as dry_run
from .culprits import misplaced_state
from .layout import model_devices, module_groups, own_tensors, plain_attributes
from .meta import annotate as annotate_meta


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


def explain(model: torch.nn.Module, *inputs: Any, optimizer: torch.optim.Optimizer | None = None,
            step: Callable[..., Any] | None = None, device: str | torch.device | None = None) -> Explanation:
    """Where a model's parameters and buffers, the inputs and the optimizer state live, and what torch refuses.

    Runs the step (STEP, else the function of the user's that called explain()), or else the forward
    `model(*inputs)`, once on fake tensors (no data, no kernels; the user's tensors and objects are put back),
    so torch's own device checks decide: what it refuses is an error naming its culprit and line; where tensors
    only sit oddly (CPU index or lengths tensors, host-only attributes, a deliberate split) is a note once torch
    ran the code. The step's Python side effects beyond its arguments are not undone (see docs/strict-mode.md).

    Args:
        model: the model to examine.
        *inputs: a batch as the model takes it (tensors or nested containers), optional; with STEP, the step's
            arguments. Modules and objects holding tensors among them (a loss, a metric) are checked too.
        optimizer: its state is checked against the parameters' devices.
        step: a training step, run as `step(*inputs)` (bind the model, optimizer and loss with a lambda or
            functools.partial).
        device: a dry run for another machine: the model's parameters and buffers are put on DEVICE (as
            `model.to(device)` would there, e.g. "cuda:1" on a laptop without GPUs); everything else keeps its
            device (a batch from the loader, plain attributes, optimizer state, modules outside the model).

    Returns:
        An `Explanation`: a plain dict (`model`, `modules`, `inputs`, `optimizer`, `forward`, `step`,
        `problems`) that prints as tables (`print()`) or text (`str()`).

    Raises:
        TypeError: `model` is not an `nn.Module`, or `step` is not callable.

    Example:
        ```python
        import torch
        import torchplace as tp

        model = torch.nn.Linear(8, 2)
        report = tp.explain(model, torch.randn(2, 8), device="cuda:1")
        print(report.problems or "no problems")
        ```
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"explain() takes the model (an nn.Module) first, got {type(model).__name__}. "
                        "Fix: explain(model, batch, optimizer=opt).")
    if step is not None and not callable(step):
        raise TypeError(f"explain(step=...) takes the training step, a function, got {type(step).__name__}. "
                        "Fix: explain(model, batch, step=lambda batch: train_step(model, batch)).")
    if dry_run.running() is not None:  # explain()'s own re-run of the step that called it: the report being made
        return dry_run.running()  # type: ignore[no-any-return]
    target = torch.device(device) if device is not None else None
    inner = unwrap(model)  # through DDP, DataParallel, torch.compile, Fabric: the paths the user's class has
    devices = [str(target)] if target is not None else model_devices(inner)
    groups = module_groups(inner, "model")
    near = [v for v in inputs if _is_companion(v)]  # a loss, a metric: swapped for the run too
    args = tuple(v for v in inputs if not _is_companion(v))
    result = Explanation(
        model={"type": type(inner).__name__, "devices": model_devices(inner),
               "parameters": sum(g.elements for g in groups if g.parameters),
               "bytes": sum(g.bytes for g in groups)},
        modules=[g.to_dict() for g in groups],
        plain_attributes=[{"name": path, **describe(t)} for path, t in plain_attributes(inner)],
        inputs=[{"path": p, **describe(t)} for p, t in tensors_with_paths(list(args), "inputs", depth=4, items=256)],
        optimizer=None,
        problems=[],
    )
    if target is not None:
        result["device"] = str(target)
    if step is not None:
        reading = dry_run.run((step, inputs, {}), model, near, result, target) or dry_run.StepRun()
    else:
        reading = dry_run.read_callers(sys._getframe(1), model, near, result, target)
    result["step"] = reading.ran
    params = {id(p) for p in model.parameters()}
    if optimizer is None:  # the optimizer that steps in the caller's code, when all its parameters are the model's
        optimizer = next((o for o, _ in reading.optimizers
                          if all(id(p) in params for g in o.param_groups for p in g["params"])), None)
    steps = {id(o): site for o, site in reversed(reading.optimizers)}  # the nearest frame's line
    found = _findings(model, groups, devices if target is None else [], devices, result, optimizer,
                      steps.get(id(optimizer)))
    forward = None
    if args and step is None and not reading.model_ran and reading.ran != "device mismatch":
        forward = dry_run.run((model, args, {}), model, [], result, target, kind="mismatch") or dry_run.StepRun()
    stopped = forward is not None and forward.ran.startswith(("stopped", "not run"))
    failing = any(r.ran == "device mismatch" for r in (reading, forward) if r is not None)
    if args and target is None and dry_run.WORLD.get() is None and (stopped or (found and not failing)):
        # the real forward: fake tensors stopped (data, torch.compile) or accepted what placement calls odd
        real = dry_run.run((model, args, {}), model, [], result, kind="mismatch", real=True) or dry_run.StepRun()
        if stopped and real.ran == "ran" and forward is not None:
            real.problems = [{**p, "message": p["message"].replace("the rest was not checked",
                                                                   "the forward ran on the real tensors")}
                             for p in forward.problems]
        if stopped or real.ran == "device mismatch":
            forward = real
    result["forward"] = forward.ran if forward else "not run: " + ("the step ran it" if reading.model_ran else
                                                                   "the step was given" if step else "no inputs given")
    runs = [r for r in (reading, forward) if r is not None]
    problems = result["problems"] = _judge(found, runs) + [p for r in runs for p in r.problems]
    if reading.ran.startswith("not run") and not any(r.model_ran or r.ran == "device mismatch" for r in runs):
        problems.append({"kind": "not-checked", "where": "step", "severity": "note", "message":
                         f"could not check this ({reading.ran}; forward {result['forward']}): only where tensors sit "
                         "was looked at. Give me the step: explain(model, batch, step=train_step), or call explain() "
                         "in it."})
    annotate_meta(inner, problems)
    return result


Finding = tuple[str, str, str]  # (kind, where, message: what and the fix on its first line, the details after)
_MAYBE_DELIBERATE = frozenset({"model-split", "optimizer-foreign-parameters"})


def _judge(found: list[Finding], runs: list[Any]) -> list[dict[str, str]]:
    """Where tensors sit is a hint, never an error by itself: torch judges (it accepts CPU indices, lengths,
    0-dim scalars, host-only values, a deliberate split), so a finding is a note. One that names a culprit of a
    failure torch raised stays beside that failure as its explanation: an error (a warning where the layout
    may be deliberate)."""
    failure = " ".join(p["message"] for r in runs for p in r.problems if p["severity"] == "error")
    return [{"kind": kind, "where": where, "message": message,
             "severity": "note" if not (failure and where in failure) else
             "warning" if kind in _MAYBE_DELIBERATE else "error"} for kind, where, message in found]


def _is_companion(value: Any) -> bool:
    """A loss, metric or scheduler passed beside the inputs: a module, or an object holding tensors."""
    return isinstance(value, torch.nn.Module) or not isinstance(value, (torch.Tensor, dict, list, tuple)) and any(
        isinstance(v, torch.Tensor) for v in getattr(value, "__dict__", {}).values())


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"device": str(tensor.device), "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape)}


def _findings(model: torch.nn.Module, groups: list[Any], split: list[str], devices: list[str], result: dict[str, Any],
              optimizer: torch.optim.Optimizer | None, site: str | None) -> list[Finding]:
    """What looks odd in where tensors sit (torch judges: _judge): a module with its own tensors on several
    devices and a model that spans SPLIT, plain tensor attributes (model.to() skips them), inputs elsewhere than
    the model (0-dim CPU ones aside), the optimizer's state elsewhere than its parameter (SITE: the user's line
    where it steps) and parameters not the model's; RESULT gets the optimizer's table."""
    own_split, inner = Counter(g.module for g in groups if g.own), unwrap(model)
    found = []
    for name, module in inner.named_modules() if split else ():
        path = f"model.{name}" if name else "model"
        if own_split.get(path, 0) > 1:
            where = ", ".join(f"{key} on {t.device}" for _, key, t in own_tensors(module))
            found.append(("split-module", path, f"{path} ({type(module).__name__}) has its own tensors on different "
                          f"devices: its forward will fail. Fix: move the whole module: {path}.to(device).\nIts "
                          f"tensors: {where}."))
    if len(split) > 1:
        parts = "; ".join(f"{g.module} on {g.device}" for g in groups[:8])
        found.append(("model-split", "model", f"the model spans {', '.join(split)} (fine if deliberate: a pipeline, "
                      f"torchplace.place). Fix: call model.to(device) once it is built.\nWhere: {parts}. A submodule "
                      "added or replaced after the move stays behind."))
    for a in result["plain_attributes"]:
        elsewhere = f" (the model on {', '.join(devices)})" if devices and a["device"] not in devices else ""
        found.append(("plain-attribute", a["name"], f"{a['name']} is a plain tensor attribute on {a['device']}"
                      f"{elsewhere}: model.to() skips it. Fix: self.register_buffer(name, tensor, persistent=False)."
                      "\nRegister it in __init__; persistent=True puts it in the state_dict too."))
    for i in result["inputs"]:
        if devices and i["device"] not in devices and not (i["device"] == "cpu" and not i["shape"]):
            found.append(("input-device", i["path"], f"{i['path']} is on {i['device']}, but the model is on "
                          f"{', '.join(devices)}. Fix: move the batch first: torchplace.to_device(batch, "
                          f"{devices[0]!r})."))
    if optimizer is None:
        return found
    names = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in params if id(p) not in names]
    by_device = Counter(str(v.device) for p in params for v in optimizer.state.get(p, {}).values()
                        if isinstance(v, torch.Tensor))
    wrong = misplaced_state(optimizer, model)
    result["optimizer"] = {"type": type(optimizer).__name__, "parameters": len(params),
                           "foreign_parameters": len(foreign), "state_devices": dict(sorted(by_device.items())),
                           "misplaced_state": wrong}
    if wrong:
        shown = "; ".join(wrong[:4]) + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        found.append(("optimizer-state-device", "optimizer", f"{len(wrong)} optimizer state tensor(s) are on another "
                      f"device than their parameter. Fix: move the model before the first step.\nFirst: {shown}. The "
                      "optimizer stepped (or loaded a state_dict) before model.to(device), which moves parameters, "
                      "not the optimizer's state. Or load the optimizer's state_dict after the move (it follows each "
                      "parameter)." + (f"\nThe optimizer steps at {site}." if site else "")))
    if foreign:
        found.append(("optimizer-foreign-parameters", "optimizer", f"the optimizer updates {len(foreign)} of "
                      f"{len(params)} tensor(s) that are not this model's. Fix: build the optimizer from "
                      "model.parameters() once the model is final.\nA model rebuilt or replaced after the optimizer "
                      "was made is not trained."))
    return found
