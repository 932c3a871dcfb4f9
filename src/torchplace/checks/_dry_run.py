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
import re
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
from ._fixes import failed

_FRAMES = 3  # the function that called explain() and the two that called it
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_RUNNING: contextvars.ContextVar[Any] = contextvars.ContextVar("torchplace_dry_run", default=None)


@dataclass
class StepRun:
    """What the step's run showed: problems, where the model is called, where companions and optimizers are."""

    problems: list[dict[str, str]] = field(default_factory=list)
    model_calls: list[str] = field(default_factory=list)  # "train.py:40 in step(): `loss = model(x)`"
    used: dict[int, str] = field(default_factory=dict)  # id(module) -> its first call site, as above
    optimizers: list[tuple[torch.optim.Optimizer, str]] = field(default_factory=list)  # and where each steps
    ran: str = "not run"  # "ran", "device mismatch", or why it stopped
    in_model: bool = False  # the device error was raised inside the model's forward


class _Stop(BaseException):
    """The model was called a second time: one step has been seen."""


def running() -> Any:
    """Inside explain()'s own re-run of the step, the report being made (explain() called there returns it)."""
    return _RUNNING.get()


def read_callers(start: FrameType | None, model: torch.nn.Module, companions: list[Any], current: Any) -> StepRun:
    """Re-run the nearest user function from START outwards whose run calls the model, on fake tensors
    (never past a module's top level: what runs around a script is not the step). CURRENT: what explain()
    called again inside the run returns."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    wrapped = [type(m).__name__ for m in model.modules() if isinstance(m, (DataParallel, DistributedDataParallel))
               or type(m).__name__ == "OptimizedModule"]
    if wrapped:  # their replication, communication and compilation are not for fake tensors
        return StepRun(ran=f"not run: a {wrapped[0]} is not run on fake tensors")
    frame, seen = start, 0
    while frame is not None and seen < _FRAMES:
        filename = frame.f_code.co_filename
        if fr.is_users_own(filename) and not filename.startswith((_STDLIB, "<frozen")):
            seen += 1
            if frame.f_code.co_name == "<module>":
                return StepRun(ran="not run: explain() was called at the top level of a script")
            call = _call_of(frame)
            reading = StepRun()
            if call is not None and _run(call, model, companions, reading, current):
                return reading
        frame = frame.f_back
    return StepRun(ran="not run: no calling function of the user's calls the model")


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
        if func._schema.is_mutable:  # never write into a tensor of the user's that was not swapped for a fake
            from torch._subclasses.fake_tensor import FakeTensor

            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(a.name)
                    for t in value if isinstance(value, (list, tuple)) else [value]:
                        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
                            raise _Unreachable(f"the step writes into a tensor explain() could not copy ({func})")
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:  # torch before 2.12 words fake tensors' device check its own way
            found = _OLD_FAKE_MISMATCH.search(str(exc))
            if found is None:
                raise
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{found[1]} and {found[2]}!") from None


# FakeTensorMode's device check in torch < 2.12 (2.12 raises FakeTensorDeviceMismatchError with the eager text)
_OLD_FAKE_MISMATCH = re.compile(r"Unhandled FakeTensor Device Propagation for \S+, found two different devices "
                                r"([\w:]+), ([\w:]+)")


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
                gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # cuda-only: a cuda spec
                if index >= gpus:
                    raise _Unreachable(f"{spec} is not a device of this machine")
        return func(*args, **kwargs)


def _run(call: tuple[Any, tuple[Any, ...], dict[str, Any]], model: torch.nn.Module, companions: list[Any],
         reading: StepRun, current: Any) -> bool:
    """Run the call on fake tensors; whether it is the step (it called the model, or failed on a device)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from .mismatch import is_device_mismatch
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

    def before_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        swap.value(optimizer)  # one the step reaches otherwise (a global): swapped now, before it steps
        site = _user_site()
        if site:
            reading.optimizers.append((optimizer, site))

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swap = _Swap(mode)
    handles = [model.register_forward_pre_hook(before_model), model.register_forward_hook(after_model)]
    handles += [c.register_forward_pre_hook(before_companion) for c in companions if isinstance(c, torch.nn.Module)]
    handles.append(register_optimizer_step_pre_hook(before_step))
    token = _RUNNING.set(current)
    quiet = io.StringIO()
    try:
        swap.value(model)
        for companion in companions:
            swap.value(companion)
        fake_args, fake_kwargs = swap.value(args), swap.value(kwargs)
        with (warnings.catch_warnings(), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet),
              mode, _EagerChecks(), _Reachable(), watch(model)):
            warnings.simplefilter("ignore")
            func(*fake_args, **fake_kwargs)
        reading.ran = "ran"
    except _Stop:
        reading.ran = "ran"
    except DeviceMismatchError as exc:
        reading.ran, reading.in_model = "device mismatch", depth[0] > 0
        report = getattr(exc, "report", None)
        names = [(t.origin or t.label).split(" at ")[0].split(" in ")[0] for t in getattr(report, "culprits", [])]
        where = getattr(report, "module", None) or ", ".join(dict.fromkeys(names)) or "step"
        reading.problems.append({"kind": "step-device", "where": where, "severity": "error",
                                 "message": failed("the step fails (run on fake tensors)", exc)})
    except Exception as exc:  # an op fake tensors cannot run, or the step's own error: said, not guessed past
        if not calls[0] and not is_device_mismatch(exc) and not isinstance(exc, _Unreachable):
            return False  # it failed before reaching the model: not the step (a function around explain())
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
        swap.restore()
    return calls[0] > 0 or reading.ran != "ran"


class _Unreachable(RuntimeError):
    """The run met something it must not do: write into a tensor it could not swap, or use a device this
    machine lacks."""


class _Swap:
    """The user's tensors the step reaches through its arguments, the model and its companions, swapped for
    fake ones for the run and put back after: parameters, buffers and tensor attributes of modules (and the
    lists, tuples and dicts of tensors they keep), attributes of plain objects, optimizers' parameters and
    state, and tensors in the arguments' containers (which the step gets as copies)."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self.fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(real) -> (real, fake)
        self.undo: list[Any] = []
        self.seen: set[int] = set()

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t, FakeTensor):
            return t
        if id(t) not in self.fakes:
            fake = self.mode.from_tensor(t)
            if isinstance(t, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
            self.fakes[id(t)] = (t, fake)
        return self.fakes[id(t)][1]

    def value(self, v: Any, depth: int = 0) -> Any:
        """V with its tensors fake: containers as copies (depth 4), modules, optimizers and objects in place."""
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if depth > 4:
            return v
        if type(v) in (list, tuple) or (isinstance(v, tuple) and hasattr(v, "_fields")):
            items = [self.value(x, depth + 1) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
        if type(v) is dict:
            return {k: self.value(x, depth + 1) for k, x in v.items()}
        if id(v) in self.seen:
            return v
        self.seen.add(id(v))
        if isinstance(v, torch.nn.Module):
            for m in v.modules():
                self._module(m, depth)
        elif isinstance(v, torch.optim.Optimizer):
            self._optimizer(v)
        elif hasattr(v, "__dict__") and not isinstance(v, (type, types.FunctionType, types.ModuleType,
                                                           types.MethodType)):
            self._attributes(v, vars(v), depth)
        return v

    def _module(self, m: torch.nn.Module, depth: int) -> None:
        registries: tuple[dict[str, Any], ...] = (m._parameters, m._buffers)
        for registry in registries:
            old = dict(registry)
            self.undo.append((registry, old))
            for k, t in old.items():
                if t is not None:
                    registry[k] = self.tensor(t)
        self._attributes(m, {k: v for k, v in vars(m).items() if k not in _MODULE_STATE}, depth)

    def _attributes(self, owner: Any, attributes: dict[str, Any], depth: int) -> None:
        with contextlib.suppress(Exception):  # an object whose __dict__ cannot be written: left as it is
            space = vars(owner)
            self.undo.append((space, dict(space)))
            for k, v in attributes.items():
                if isinstance(v, (torch.Tensor, list, tuple, dict, torch.nn.Module, torch.optim.Optimizer)):
                    space[k] = self.value(v, depth + 1)

    def _optimizer(self, o: torch.optim.Optimizer) -> None:
        self.undo.append((o, (o.state, [dict(g) for g in o.param_groups])))
        for group in o.param_groups:
            group["params"] = [self.tensor(p) for p in group["params"]]
        o.state = defaultdict(dict, {self.tensor(p): {k: self.value(v) for k, v in s.items()}
                                     for p, s in o.state.items()})

    def restore(self) -> None:
        for target, old in reversed(self.undo):
            if isinstance(target, torch.optim.Optimizer):
                target.state = old[0]
                for group, saved in zip(target.param_groups, old[1]):
                    group.clear()
                    group.update(saved)
            else:
                target.clear()
                target.update(old)


_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules"})


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
