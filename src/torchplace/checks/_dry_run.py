"""explain()'s run of the step (or the forward) on fake tensors: torch's own device checks decide.

The function runs under torch's FakeTensorMode: every tensor it reaches is a fake one (no data, no kernel)
on the same device, or, for a dry run for another machine, the model's on that device; the user's objects
are put back after. A device error is named by watch()'s diagnosis; data an op makes (nonzero's size, item())
is a symbol, and code that branches on one ends the run, said, never guessed past; a loop stops at the model's
call after an optimizer stepped, on the tensors of an earlier call, or at its 16th.
"""

from __future__ import annotations

import contextlib
import contextvars
import dis
import functools
import inspect
import io
import linecache
import logging
import os
import sysconfig
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torchgen  # type: ignore[import-untyped]
from torch._subclasses import fake_tensor as ft
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributions import Distribution
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

from ..errors import DeviceMismatchError, MetaTensorError
from . import frames as fr
from ._fixes import failed
from .culprits import BIRTHS, note_birth
from .implicit_device import FACTORIES
from .mismatch import is_device_mismatch
from .watch import watch

_FRAMES = 3  # the function that called explain() and the two that called it
_CALLS = 16  # the model's calls a run follows (a generation loop's) when no optimizer steps
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_RUNNING: contextvars.ContextVar[Any] = contextvars.ContextVar("torchplace_dry_run", default=None)
WORLD: contextvars.ContextVar[FakeDevices | None] = contextvars.ContextVar("torchplace_fake_cuda", default=None)  # set:
# inside fake_cuda(), whose tensors are fake (so the real forward is no fallback)


@dataclass
class StepRun:
    """What a run showed: its problems, the optimizers that stepped (and where), how it ended."""

    problems: list[dict[str, str]] = field(default_factory=list)
    optimizers: list[tuple[torch.optim.Optimizer, str]] = field(default_factory=list)  # and where each steps
    ran: str = "not run"  # "ran", "device mismatch", or why it stopped
    model_ran: bool = False  # the model's forward returned: torch accepted the model's own placement


class _Stop(BaseException):
    """The model was called after an optimizer stepped, again on the same tensors, or _CALLS times."""


def running() -> Any:
    """Inside explain()'s own re-run of the step, the report being made (explain() called there returns it)."""
    return _RUNNING.get()


def read_callers(start: FrameType | None, model: torch.nn.Module, companions: list[Any], current: Any,
                 device: torch.device | None = None) -> StepRun:
    """Re-run on fake tensors the nearest user function from START outwards whose run calls the model (never
    past a module's top level). CURRENT: what explain() called in the run returns; DEVICE: see run()."""
    frame, seen = start, 0
    while frame is not None and seen < _FRAMES:
        filename = frame.f_code.co_filename
        if fr.is_users_own(filename) and not filename.startswith((_STDLIB, "<frozen")):
            seen += 1
            if frame.f_code.co_name == "<module>":
                return StepRun(ran="not run: explain() was called at the top level of a script")
            call = _call_of(frame)
            if call is not None:
                reading = run(call, model, companions, current, device, must_call_model=True)
                if reading is not None:
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
    kinds = {p.name: p.kind for p in inspect.signature(func, follow_wrapped=False).parameters.values()}
    stored = {i.argval for i in dis.get_instructions(code)
              if i.opname in ("STORE_FAST", "STORE_DEREF", "DELETE_FAST") and i.offset < frame.f_lasti}
    if any(name not in local or name in stored for name in kinds):
        return None  # an argument the function reassigned before this line: its value at the call is lost
    one, many = inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD  # *args, **kwargs
    return func, tuple(v for n, k in kinds.items() if k <= one for v in (local[n] if k == one else (local[n],))), {
        key: v for n, k in kinds.items() if k > one for key, v in (local[n] if k == many else {n: local[n]}).items()}


_NO_CPU_SCALAR = {"cat.default", "stack.default", *(f"clamp{k}.Tensor" for k in ("", "_", "_min", "_max"))}


class _EagerChecks(TorchDispatchMode):
    """The device checks eager kernels make and fake tensors skip: a CUDA op's tensors on one device unless torch
    marks it mixed (_no_check()), no 0-dim CPU tensor in cat, stack, clamp's bounds (meta too), a foreach op's at
    each index, a generator of the op's device type, no index off a CPU tensor, packing's lengths on the CPU."""

    def __torch_dispatch__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.__name__ in _NO_CPU_SCALAR and args:
            _one_device([*(args[0] if isinstance(args[0], (list, tuple)) else args), *kwargs.values()], False)
        elif func.__name__.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
            for row in zip(*(a for a in args if isinstance(a, (list, tuple)))):  # one op per index, as torch runs it
                _one_device(row)
        elif isinstance(kwargs.get("generator"), torch.Generator):  # a random op draws from its device's generator
            made = kwargs.get("device") or next((a.device for a in args if isinstance(a, torch.Tensor)), None)
            kind, found = torch.device(made).type if made is not None else "cpu", kwargs["generator"].device.type
            if found != kind:
                raise RuntimeError(f"Expected a '{kind}' device type for generator but found '{found}'")
        elif func is torch.ops.aten._pack_padded_sequence.default:  # the lengths are read on the host
            if args[1].device.type != "cpu":
                raise RuntimeError(f"'lengths' argument should be a 1D CPU int64 tensor, but got 1D {args[1].device}")
            raise ft.DynamicOutputShapeException(func)  # its sizes are data (torch's fake kernel puts them off the CPU)
        elif func is torch.ops.aten.index.Tensor and args and args[0].device.type == "cpu":
            if any(isinstance(i, torch.Tensor) and i.device.type != "cpu" for i in args[1]):
                raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
        elif getattr(func, "namespace", "") == "aten" and _no_check() and func.__name__ not in _no_check() and any(
                isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tree_flatten((args, kwargs))[0]):
            _one_device(tree_flatten((args, kwargs))[0], False)  # as CUDA kernels check (meta ones do not)
        return func(*args, **kwargs)


@functools.cache
def _no_check() -> frozenset[str]:
    """The aten ops torch lets take tensors on several devices (`device_check: NoCheck` in native_functions.yaml,
    and the CTC ops' `Tensor input_lengths` forms: lengths read on the host); empty where that file is missing."""
    yaml = Path(torchgen.__file__).parent / "packaged/ATen/native/native_functions.yaml"  # shipped with torch
    names = [e.split("(", 1)[0] for e in yaml.read_text().split("\n- func: ") if "device_check: NoCheck" in e
             or "Tensor input_lengths" in e.split("\n", 1)[0]] if yaml.is_file() else []
    return frozenset(n if "." in n else f"{n}.default" for n in names)


_TWO = "Expected all tensors to be on the same device, but found at least two devices, {} and {}!"  # torch's words


def _one_device(tensors: Any, cpu_scalars: bool = True) -> str | None:
    """The one device of TENSORS (0-dim CPU tensors aside, with CPU_SCALARS), as torch wants; else torch's error."""
    devices = list(dict.fromkeys(str(t.device) for t in tensors if isinstance(t, torch.Tensor)
                                 and not (cpu_scalars and t.device.type == "cpu" and t.dim() == 0)))
    if len(devices) > 1:
        raise RuntimeError(_TWO.format(devices[0], devices[1]))
    return devices[0] if devices else None


class FakeDevices(TorchFunctionMode):
    """Devices as a run on fake tensors sees them: the one home of "run this on fake devices". With SWAP
    (explain()'s dry run) every tensor a torch call reaches is its fake copy; without (fake_cuda()) what the code
    puts on cuda is fake there, the rest real. Without a TARGET, a device this machine lacks fails the run as the
    real step would (torch aborts the process for a device it was built without). With one, every device exists,
    "cuda" is cuda:0, and where this torch has no cuda code an op is worked out on meta without autograd, a
    backward simulated (a zero gradient for each leaf used) and pinning skipped: torch's device rules kept."""

    def __init__(self, target: torch.device | None, swap: _Swap | None = None) -> None:
        super().__init__()
        self.target, self.swap = target, swap
        self.fake = swap.mode if swap is not None else _fake_mode()
        self.simulated = target is not None and target.type == "cuda" and not _has(target)
        self.leaves: dict[int, torch.Tensor] = {}  # not weak: a weak reference stops Module.to() swapping a fake

    def __torch_function__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = tuple(args), dict(kwargs or {})
        if self.swap is not None:  # a tensor of the user's the run did not reach through the step's arguments (a
            # global, a closure): its fake copy, so the run reads it where it is and never writes into it
            args, kwargs = tree_map_only(torch.Tensor, self.swap.tensor, (args, kwargs))
        name = getattr(func, "__name__", "")
        specs = [*(args[1:] if name in ("to", "cuda") else ()), kwargs.get("device")]
        fake = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, FakeTensor)]
        if self.swap is None and not (name in ("cuda", "pin_memory") or fake or any(map(_names_cuda, specs))):
            return func(*args, **kwargs)  # nothing on cuda: the real op
        if self.target is None:
            if name == "cuda" and not any(isinstance(v, (int, str, torch.device)) for v in specs[:-1]):
                specs.append("cuda")
            for spec in specs:
                if _names_cuda(spec) and not _has(spec):
                    raise _Unreachable(f"{spec} is not a device of this machine")
        elif name == "cuda":  # tensor.cuda(), tensor.cuda(1): a .to() with the index made explicit
            spec = args[1] if len(args) > 1 else kwargs.pop("device", None)
            index = spec.index if isinstance(spec, torch.device) else spec if isinstance(spec, int) else None
            func, args = torch.Tensor.to, (args[0], torch.device("cuda", index or 0))
        else:
            args = tuple(_indexed(a) for a in args)
            kwargs.update({"device": _indexed(kwargs["device"])} if "device" in kwargs else {})
        self.leaves.update({id(t): t for t in fake if t.requires_grad and t.is_leaf})  # what a backward reaches
        if self.simulated and name in ("backward", "pin_memory"):  # no cuda code for either here
            return self._backward() if name == "backward" else args[0]
        outside = (self.fake, _EagerChecks()) if self.swap is None else ()
        with contextlib.ExitStack() as stack:
            for mode in (*outside, *((torch.no_grad(),) if self.simulated else ())):
                stack.enter_context(mode)  # autograd needs the device's code
            try:
                out = func(*args, **kwargs)
            except RuntimeError as exc:  # no cuda code for this op here: worked out on meta
                if not (self.simulated and "not linked with support for cuda" in str(exc)):
                    raise
                out = _on_meta(func, args, kwargs)
        if name in ("to", "requires_grad_"):  # Module.to() swaps the parameter for the moved one (a Parameter made
            self._forget()  # of it): a weak reference to either from fake tensors' caches would refuse that
        if func in FACTORIES and isinstance(out, torch.Tensor):  # where it was made, should it be a culprit
            note_birth(out, FACTORIES[func], kwargs.get("device"))
        return out

    def _backward(self) -> None:
        """What a backward pass leaves: a gradient (zeros) for each fake leaf an op used that wants one."""
        with self.fake:
            for leaf in (t for t in self.leaves.values() if t.requires_grad and t.grad is None):
                leaf.grad = torch.zeros_like(leaf)

    def _forget(self) -> None:
        """Empty fake tensors' caches of the tensors they converted (weak references to the real and the fake)."""
        converter = getattr(self.fake.fake_tensor_converter, "meta_converter", None)
        for memo in (getattr(converter, "tensor_memo", None), getattr(converter.describer, "lookup_tensor", None)
                     if converter is not None else None):
            if memo is not None:
                memo.clear()


@contextlib.contextmanager
def fake_cuda() -> Any:
    """The block builds and runs as if this machine had a cuda:0 (`bench diagnose --fake-gpu`: strict() and
    watch() judged on cuda vs cpu): what it puts there is fake, torch's own device checks raise torch's errors."""
    from ..hardware.visible import map_visible
    from ..policy.devices import ASSUMED, Machine

    swap = torch.__future__.get_swap_module_params_on_conversion()  # a parameter moved there stays the same object,
    torch.__future__.set_swap_module_params_on_conversion(True)  # as Module.to's `.data =` keeps it on a GPU: the
    # optimizer's; torch.save() keeps tensors' shapes and devices, not their values (fake ones have none)
    with FakeDevices(torch.device("cuda", 0)) as mode, torch.serialization.skip_data(materialize_fake_tensors=True):
        tokens = WORLD.set(mode), ASSUMED.set(Machine(1, map_visible()))  # torchplace.device() resolves cuda:0
        try:
            yield mode
        finally:
            WORLD.reset(tokens[0])
            ASSUMED.reset(tokens[1])
            torch.__future__.set_swap_module_params_on_conversion(swap)


def _fake_mode(meta: bool = False) -> FakeTensorMode:
    """Fake tensors of the user's shapes; what an op makes from data (nonzero's size, item()) is a symbol, but
    for a META model (it has no data: such an op fails, as it would)."""
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=None if meta else ShapeEnv(), static_shapes=True)


def _names_cuda(spec: Any) -> bool:
    """Whether SPEC names a cuda device."""
    try:
        return isinstance(spec, (str, torch.device)) and torch.device(spec).type == "cuda"
    except RuntimeError:
        return False


def _has(spec: Any) -> bool:
    """Whether this machine has the cuda device SPEC."""
    return (torch.device(spec).index or 0) < torch.cuda.device_count()  # cuda-only: a cuda spec (0 without cuda)


def _indexed(spec: Any) -> Any:
    """"cuda" or torch.device("cuda") as cuda:0 (torch's current device when nothing set another), else SPEC."""
    return torch.device("cuda", 0) if isinstance(spec, (str, torch.device)) and str(spec) == "cuda" else spec


def _on_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """FUNC for fake cuda tensors where this torch has no cuda code for it (a composite op such as cross_entropy,
    indexing): torch's device rule checked (one device, 0-dim CPU tensors and CPU indices aside), the result
    worked out on meta and made on that device."""
    index = getattr(func, "__name__", "") in ("__getitem__", "__setitem__")  # CPU index tensors are fine
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    device = _one_device([t for t in tensors if not (index and t is not args[0] and t.device.type == "cpu")])
    on_meta, kw_on_meta = tree_map_only(torch.Tensor, lambda t: torch.empty_strided(
        t.shape, t.stride(), dtype=t.dtype, device="meta") if t.device.type == "cuda" else t, (args, kwargs))
    return tree_map_only(torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                         if t.device.type == "meta" else t, func(*on_meta, **kw_on_meta))


def run(call: tuple[Any, tuple[Any, ...], dict[str, Any]], model: torch.nn.Module, companions: list[Any],
        current: Any, device: torch.device | None = None, must_call_model: bool = False,
        kind: str = "step-device", real: bool = False) -> StepRun | None:
    """Run CALL (function, args, kwargs) on fake tensors and say what torch did. DEVICE: the model's parameters
    and buffers are made there (as model.to(device) would); the rest keeps its device. With MUST_CALL_MODEL, None
    when the call is not the step (it failed before calling the model, or never did). REAL: on the real tensors
    (where fake tensors cannot run an op), without autograd, the model's buffers and random streams put back."""
    wrapped = [type(m).__name__ for m in model.modules() if isinstance(m, DistributedDataParallel)
               or type(m).__name__ == "OptimizedModule"]
    if wrapped and not real:  # their communication and compilation are not for fake tensors
        return StepRun(ran=f"not run: a {wrapped[0]} is not run on fake tensors")
    func, args, kwargs = call
    reading = StepRun()
    calls, stepped = list[list[int]](), [False]  # the tensors of each call (a generation loop's calls go on)

    def before_model(_: Any, args: Any, kwargs: Any) -> None:  # a training loop's next step, or the same call again
        tensors = [id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if stepped[0] or tensors in calls or len(calls) >= _CALLS:
            raise _Stop
        calls.append(tensors)

    def after_model(*_: Any) -> None:
        reading.model_ran = True

    def before_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        swap.value(optimizer)  # one the step reaches otherwise (a global): swapped now, before it steps
        stepped[0] = True
        if site := _user_site():
            reading.optimizers.append((optimizer, site))

    meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    mode = world.fake if (world := WORLD.get()) is not None else _fake_mode(meta)  # inside fake_cuda(): its mode
    swap = _Swap(mode, device)
    saved = [(b, b.detach().clone()) for b in model.buffers()] if real else []
    handles = [model.register_forward_pre_hook(before_model, with_kwargs=True), model.register_forward_hook(
        after_model), *([] if real else [register_optimizer_step_pre_hook(before_step)])]
    token, births = _RUNNING.set(current), BIRTHS.set({})
    quiet = io.StringIO()
    try:
        if real:  # its dropout draws from generators of its own: the training's random streams stay as they were
            cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
            modes: list[Any] = [torch.no_grad(), torch.random.fork_rng(devices=cuda)]
        else:
            swap.value(model, move=True)
            for companion in companions:
                swap.value(companion)
            args, kwargs = swap.value(args), swap.value(kwargs)
            modes = [mode, _EagerChecks(), FakeDevices(device or (world.target if world else None), swap)]
        with contextlib.ExitStack() as stack:
            log = logging.getLogger("torch._subclasses.fake_tensor")  # it logs each meta kernel that fails, as errors
            stack.callback(setattr, log, "disabled", log.disabled)
            log.disabled = True
            stack.callback(Distribution.set_default_validate_args, Distribution._validate_args)
            Distribution.set_default_validate_args(False)  # it checks values (data fake tensors lack), not devices
            for entered in (warnings.catch_warnings(), contextlib.redirect_stdout(quiet),
                            contextlib.redirect_stderr(quiet), *modes, watch(model)):
                stack.enter_context(entered)
            warnings.simplefilter("ignore")
            func(*args, **kwargs)
        reading.ran = "ran"
    except _Stop:
        reading.ran = "ran"
    except (DeviceMismatchError, MetaTensorError) as exc:  # a meta tensor used for its data: named as watch() does
        no_data = isinstance(exc, MetaTensorError)
        reading.ran = "meta tensor used for its data" if no_data else "device mismatch"
        report = getattr(exc, "report", None)
        names = [(t.origin or t.label).split(" at ")[0].split(" in ")[0] for t in getattr(report, "culprits", [])]
        where = getattr(report, "module", None) or ", ".join(dict.fromkeys(names)) or "step"
        what = "the forward fails" if kind == "mismatch" else "the step fails (run on fake tensors)"
        reading.problems.append({"kind": "meta-tensor" if no_data else kind, "where": where, "severity": "error",
                                 "message": failed(what, exc)})
    except Exception as exc:  # an op fake tensors cannot run, or the step's own error: said, not guessed past
        if must_call_model and not calls and not is_device_mismatch(exc) and not isinstance(exc, _NO_FAKE):
            return None  # it failed before reaching the model: not the step (a function around explain())
        at = _stopped_at(exc)
        what = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
        if real:  # inputs the forward does not take (a whole batch): the static findings stand
            reading.ran = f"not run: model(*inputs) raised {what}"
            return reading
        reading.ran = f"stopped{' at ' + at if at else ''}: {what}"
        reading.problems.append({"kind": "step-not-checked", "where": "step", "severity": "note",
                                 "message": f"fake tensors ran the step up to {at or 'an op'} and stopped there "
                                            f"({what}); the rest was not checked."})
    finally:
        _RUNNING.reset(token)
        BIRTHS.reset(births)
        for handle in handles:
            handle.remove()
        swap.restore()
        with torch.no_grad():
            for buffer, value in saved:
                if buffer.device == value.device and buffer.shape == value.shape:
                    buffer.copy_(value)
    return reading if calls or reading.ran != "ran" or not must_call_model else None


class _Unreachable(RuntimeError):
    """The run met a device this machine lacks."""


# what fake tensors raise for an op they cannot run (its output depends on data), and _Unreachable
_NO_FAKE = (_Unreachable, ft.DataDependentOutputException, ft.DynamicOutputShapeException,
            ft.UnsupportedOperatorException, GuardOnDataDependentSymNode)


class _Swap:
    """The user's tensors the step reaches through its arguments, the model and its companions, swapped for
    fake ones for the run and put back after: parameters, buffers and tensor attributes of modules (and the
    lists, tuples and dicts of tensors they keep), attributes of plain objects, optimizers' parameters and
    state, and tensors in the arguments' containers (which the step gets as copies)."""

    def __init__(self, mode: Any, device: torch.device | None = None) -> None:
        self.mode, self.device = mode, device
        self.fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(real) -> (real, fake)
        self.undo: list[Any] = []
        self.seen: set[int] = set()

    def tensor(self, t: torch.Tensor, move: bool = False) -> torch.Tensor:
        if isinstance(t, FakeTensor):
            return t
        if id(t) not in self.fakes:
            to = self.device if move else None
            if t.numel() == 1 and t.device.type == "cpu" and to is None:  # a CPU scalar keeps (a copy of) its value:
                with _disable_current_modes(), torch._C.DisableTorchFunction():  # code reading it (a step count) runs
                    fake = self.mode.fake_tensor_converter.from_real_tensor(self.mode, t.detach().clone(), True)
            else:
                fake = self.mode.from_tensor(t)
            if to is not None and fake.device != to:
                with self.mode, torch.no_grad():
                    fake = fake.to(to)
            if isinstance(t, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
            self.fakes[id(t)] = (t, fake)
        return self.fakes[id(t)][1]

    def value(self, v: Any, depth: int = 0, move: bool = False) -> Any:
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
        if isinstance(v, torch.nn.Module):  # MOVE: the model's own tensors go to the run's device
            for m in v.modules():
                self._module(m, depth, move)
        elif isinstance(v, torch.optim.Optimizer):
            self._optimizer(v)
        elif hasattr(v, "__dict__") and not isinstance(v, (type, types.FunctionType, types.ModuleType,
                                                           types.MethodType)):
            self._attributes(v, vars(v), depth)
        return v

    def _module(self, m: torch.nn.Module, depth: int, move: bool = False) -> None:
        for registry in (vars(m)["_parameters"], vars(m)["_buffers"]):
            self.undo.append((registry, dict(registry)))
            registry.update({k: self.tensor(t, move) for k, t in registry.items() if t is not None})
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
    entries = [(f.f_code.co_filename, n) for f, n, _ in fr.traceback_entries(exc.__traceback__)
               if fr.is_user(f.f_code.co_filename)]
    return f"{fr.short_path(entries[-1][0])}:{entries[-1][1]}" if entries else None
