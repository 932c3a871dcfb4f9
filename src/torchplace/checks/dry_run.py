"""explain()'s look at the user's step: run it again on fake tensors and report what torch itself raises.

Called inside the user's training step, explain() re-runs that function (the nearest of its callers
whose run calls the model) under torch's FakeTensorMode: every tensor the step touches becomes a fake
tensor on the same device, with no data and no kernel, so torch's own device checks decide, and
nothing the user holds changes (module attributes, gradients and optimizer state are put back; the
step's prints and warnings are swallowed). A device error there is named by the same diagnosis as
watch(); an op fake tensors cannot run (one whose output depends on data: `.item()`, `.tolist()`,
packing sequences) ends the run early and is said, never guessed past. The run stops when the model
is called a second time (the next iteration of a loop).

What torch accepts is never flagged here: CPU index and lengths tensors, 0-dim CPU scalars, values only
read on the host, deliberate splits with `.to()` between the parts.
"""

from __future__ import annotations

import contextlib
import contextvars
import dis
import inspect
import io
import linecache
import os
import sysconfig
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import DeviceMismatchError
from . import frames as fr

_FRAMES = 3  # the function that called explain() and the two that called it
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("torchplace_dry_run", default=False)


@dataclass
class Reading:
    """What the step's run showed: problems, where the model is called, where companions and optimizers are."""

    problems: list[dict[str, str]] = field(default_factory=list)
    model_calls: list[str] = field(default_factory=list)  # "train.py:40 in step(): `loss = model(x)`"
    used: dict[int, str] = field(default_factory=dict)  # id(module) -> its first call site, as above
    optimizers: list[tuple[torch.optim.Optimizer, str]] = field(default_factory=list)  # and where each steps
    ran: str = "not run"  # "ran", "device mismatch", or why it stopped
    in_model: bool = False  # the device error was raised inside the model's forward


class _Stop(BaseException):
    """The model was called a second time: one step has been seen."""


def running() -> bool:
    """Whether this is explain()'s own re-run of the step (explain() called there returns at once)."""
    return _RUNNING.get()


def read_callers(start: FrameType | None, model: torch.nn.Module, companions: list[Any]) -> Reading:
    """Re-run the nearest user function from START outwards whose run calls the model, on fake tensors."""
    frame, seen = start, 0
    while frame is not None and seen < _FRAMES:
        filename = frame.f_code.co_filename
        if fr.is_user(filename) and not filename.startswith((*fr._SITE_DIRS, _STDLIB, "<frozen")):
            seen += 1
            call = _call_of(frame)
            reading = Reading()
            if call is not None and _run(call, model, companions, reading):
                return reading
        frame = frame.f_back
    return Reading(ran="not run: no calling function of the user's calls the model")


def _call_of(frame: FrameType) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """The function running in FRAME and the arguments it was called with, or None (module level, generators)."""
    code = frame.f_code
    if code.co_name == "<module>" or code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE
                                                      | inspect.CO_ASYNC_GENERATOR):
        return None
    local = frame.f_locals
    candidates = [frame.f_globals.get(code.co_name)]
    if "self" in local:
        candidates.append(getattr(type(local["self"]), code.co_name, None))
    if frame.f_back is not None:
        candidates += list(frame.f_back.f_locals.values())
    func = next((f for f in candidates if isinstance(f, types.FunctionType) and f.__code__ is code), None)
    if func is None:
        return None
    n = code.co_argcount + code.co_kwonlyargcount
    names = code.co_varnames[: code.co_argcount]
    kwonly = code.co_varnames[code.co_argcount: n]
    varargs = code.co_varnames[n] if code.co_flags & inspect.CO_VARARGS else None
    varkw = code.co_varnames[n + bool(varargs)] if code.co_flags & inspect.CO_VARKEYWORDS else None
    wanted = [*names, *kwonly, *(v for v in (varargs, varkw) if v)]
    if any(name not in local for name in wanted) or _rebound(code, frame.f_lasti, set(wanted)):
        return None  # an argument the function reassigned before this line: its value at the call is lost
    args = tuple(local[a] for a in names) + tuple(local[varargs] if varargs else ())
    return func, args, {**{k: local[k] for k in kwonly}, **(local[varkw] if varkw else {})}


def _rebound(code: types.CodeType, before: int, names: set[str]) -> bool:
    """Whether the function stores to one of NAMES before bytecode offset BEFORE."""
    return any(i.opname in ("STORE_FAST", "STORE_DEREF", "DELETE_FAST") and i.argval in names and i.offset < before
               for i in dis.get_instructions(code))


class _EagerChecks(TorchDispatchMode):
    """The device checks eager kernels make and fake tensors skip: a list of tensors (torch.cat, torch.stack)
    takes no 0-dim CPU tensor among tensors elsewhere, and a CPU tensor takes no index on another device."""

    def __torch_dispatch__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten.cat.default, torch.ops.aten.stack.default) and args:
            devices = list(dict.fromkeys(str(t.device) for t in args[0] if isinstance(t, torch.Tensor)))
            if len(devices) > 1:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"{devices[0]} and {devices[1]}!")
        elif func is torch.ops.aten.index.Tensor and args and args[0].device.type == "cpu":
            if any(isinstance(i, torch.Tensor) and i.device.type != "cpu" for i in args[1]):
                raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
        return func(*args, **kwargs)


class _Reachable(TorchFunctionMode):
    """A device this machine lacks (cuda on a CPU-only torch, cuda:1 with one GPU) fails the run as the real step
    would, before a fake tensor is made there (torch aborts the process for a device it was built without)."""

    def __torch_function__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        specs = [*(args[1:] if name in ("to", "cuda") else ()), kwargs.get("device")]
        if name == "cuda" and not any(isinstance(v, (int, str, torch.device)) for v in specs[:-1]):
            specs.append("cuda")
        for spec in specs:
            if isinstance(spec, (str, torch.device)) and str(spec).startswith("cuda"):
                index = torch.device(spec).index or 0
                if index >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
                    raise RuntimeError(f"{spec} is not a device of this machine")
        return func(*args, **kwargs)


def _run(call: tuple[Any, tuple[Any, ...], dict[str, Any]], model: torch.nn.Module, companions: list[Any],
         reading: Reading) -> bool:
    """Run the call on fake tensors; whether it is the step (it called the model or failed: READING says how)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from .watch import watch

    func, args, kwargs = call
    calls = [0]
    depth = [0]

    def before_model(module: torch.nn.Module, _: Any) -> None:
        calls[0] += 1
        if calls[0] > 1:
            raise _Stop
        depth[0] += 1
        site = _user_site()
        if site:
            reading.model_calls.append(site)

    def after_model(*_: Any) -> None:
        depth[0] -= 1

    def before_companion(module: torch.nn.Module, _: Any) -> None:
        site = _user_site()
        if site:
            reading.used.setdefault(id(module), site)

    saved = _Saved([model, *companions, *args, *kwargs.values()])

    def before_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        saved.optimizer(optimizer)
        site = _user_site()
        if site:
            reading.optimizers.append((optimizer, site))

    handles = [model.register_forward_pre_hook(before_model), model.register_forward_hook(after_model)]
    handles += [c.register_forward_pre_hook(before_companion) for c in companions if isinstance(c, torch.nn.Module)]
    handles.append(register_optimizer_step_pre_hook(before_step))
    token = _RUNNING.set(True)
    quiet = io.StringIO()
    try:
        with (warnings.catch_warnings(), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet),
              FakeTensorMode(allow_non_fake_inputs=True), _EagerChecks(), _Reachable(), watch(model)):
            warnings.simplefilter("ignore")
            func(*args, **kwargs)
        reading.ran = "ran"
    except _Stop:
        reading.ran = "ran"
    except DeviceMismatchError as exc:
        reading.ran, reading.in_model = "device mismatch", depth[0] > 0
        report = getattr(exc, "report", None)
        names = [(t.origin or t.label).split(" at ")[0].split(" in ")[0] for t in getattr(report, "culprits", [])]
        where = getattr(report, "module", None) or ", ".join(dict.fromkeys(names)) or "step"
        reading.problems.append({"kind": "step-device", "where": where, "severity": "error",
                                 "message": f"the step fails (run on fake tensors, as torch checks devices): {exc}"})
    except Exception as exc:  # an op fake tensors cannot run, or the step's own error: said, not guessed past
        at = _stopped_at(exc)
        what = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
        reading.ran = f"stopped{' at ' + at if at else ''}: {what}"
        reading.problems.append({"kind": "step-not-checked", "where": "step", "severity": "note",
                                 "message": f"the step was checked on fake tensors up to {at or 'an op'}, "
                                            f"where it stopped ({what}); the rest of it was not checked."})
    finally:
        _RUNNING.reset(token)
        for handle in handles:
            handle.remove()
        saved.restore()
    return calls[0] > 0 or reading.ran != "ran"  # it called the model, or failed: this is the step


class _Saved:
    """What a run of the step could change in the user's objects, to put back: module attributes, parameters,
    buffers and gradients, plain objects' attributes, optimizer state."""

    def __init__(self, roots: list[Any]) -> None:
        self.modules: dict[int, tuple[torch.nn.Module, dict[str, Any], dict[str, Any], dict[str, Any]]] = {}
        self.grads: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.objects: dict[int, tuple[Any, dict[str, Any]]] = {}
        self.optimizers: dict[int, tuple[torch.optim.Optimizer, Any, list[dict[str, Any]]]] = {}
        for root in roots:
            for value in self._around(root):
                self._take(value)

    @staticmethod
    def _around(root: Any) -> list[Any]:
        values = [root]
        if isinstance(root, (list, tuple)):
            values += list(root)[:64]
        elif isinstance(root, dict):
            values += list(root.values())[:64]
        elif hasattr(root, "__dict__") and not isinstance(root, (torch.nn.Module, type, types.FunctionType)):
            values += [v for v in vars(root).values() if isinstance(v, (torch.nn.Module, torch.optim.Optimizer))]
        return values

    def _take(self, value: Any) -> None:
        if isinstance(value, torch.nn.Module):
            for m in value.modules():
                if id(m) not in self.modules:
                    self.modules[id(m)] = (m, dict(vars(m)), dict(m._parameters), dict(m._buffers))
                    for p in m._parameters.values():
                        if p is not None:
                            self.grads[id(p)] = (p, p.grad)
        elif isinstance(value, torch.optim.Optimizer):
            self.optimizer(value)
        elif hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, type, types.FunctionType,
                                                                    types.ModuleType)):
            self.objects.setdefault(id(value), (value, dict(vars(value))))

    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self.optimizers:
            state = {p: dict(s) for p, s in optimizer.state.items()}
            self.optimizers[id(optimizer)] = (optimizer, state, [dict(g) for g in optimizer.param_groups])

    def restore(self) -> None:
        for m, attributes, parameters, buffers in self.modules.values():
            vars(m).clear()
            vars(m).update(attributes)
            m._parameters.clear()
            m._parameters.update(parameters)
            m._buffers.clear()
            m._buffers.update(buffers)
        for p, grad in self.grads.values():
            p.grad = grad
        for obj, attributes in self.objects.values():
            with contextlib.suppress(Exception):
                vars(obj).clear()
                vars(obj).update(attributes)
        for optimizer, state, groups in self.optimizers.values():
            optimizer.state = defaultdict(dict, state)
            for group, old in zip(optimizer.param_groups, groups):
                group.clear()
                group.update(old)


def _user_site() -> str | None:
    """The user's line that made the current call: `train.py:40 in step(): `loss = model(x)``."""
    frame = fr.caller_frame()
    while frame is not None and not fr.is_user(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    function = "" if frame.f_code.co_name == "<module>" else f" in {frame.f_code.co_name}()"
    return f"{fr.short_path(frame.f_code.co_filename)}:{frame.f_lineno}{function}: `{text[:160]}`"


def _stopped_at(exc: BaseException) -> str | None:
    """The user's innermost line in EXC's traceback."""
    entries = [e for e in fr.traceback_entries(exc.__traceback__) if fr.is_user(e[0].f_code.co_filename)]
    if not entries:
        return None
    frame, line, _ = entries[-1]
    return f"{fr.short_path(frame.f_code.co_filename)}:{line}"
