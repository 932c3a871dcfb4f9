"""Naming the culprits of a device mismatch: each tensor of the failing op with where it came from
(parameter, buffer, plain attribute, batch key, local and the line that made it), the module path
the user wrote, and optimizer state left on another device. Runs only after an error.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from types import FrameType, FunctionType, MethodType, ModuleType
from typing import Any, TypeVar

import torch

from ..shared.tree import tensors_with_paths
from ..shared.wrappers import reach, unwrap
from . import frames as fr
from .layout import MODULE_INTERNALS, own_tensors, plain_attributes

ErrorT = TypeVar("ErrorT", bound=Exception)


@dataclass
class Operand:
    """One tensor taking part in the failing op."""

    label: str
    device: str
    dtype: str
    shape: tuple[int, ...]
    kind: str = "value"  # parameter | buffer | attribute | batch | local | value
    origin: str | None = None  # e.g. "model.fc.weight", "batch['x'] in step()"
    scalar: bool = False  # a 0-dim CPU tensor, which PyTorch lets elementwise ops use
    made: str | None = None  # "`h0 = torch.zeros(...)` at file:line", where a local was assigned
    factory: str | None = None  # the torch factory of that line, when it gives no device
    refused_scalar: bool = False  # a 0-dim CPU tensor this op does not accept (torch.stack, torch.cat)

    @property
    def source(self) -> str:
        """Where the tensor came from, in words."""
        if self.kind in ("parameter", "buffer"):
            return f"{self.kind} {self.origin}"
        if self.kind == "attribute":
            return f"plain attribute {self.origin}, not moved by .to()"
        return self.origin or self.label

    def describe(self) -> str:
        shape = "[" + ", ".join(map(str, self.shape)) + "]"
        text = f"{self.label}: {self.device}" + (f" {self.dtype} {shape}" if self.kind != "inline" else "")
        if self.source != self.label:
            text += f" ({self.source})"
        if self.made:
            text += f", made by {self.made}"
            if self.factory:
                text += f": {self.factory}"
        if self.refused_scalar:
            text += " - a 0-dim CPU tensor, which elementwise ops accept on any device but this op does not"
        return text + (" - a CPU scalar, allowed" if self.scalar else "")


def reported(error: type[ErrorT], diagnose: Callable[..., Any], fallback: Callable[[str], Any], exc: BaseException,
             model: torch.nn.Module | None, outer: FrameType | None) -> ErrorT:
    """ERROR carrying the report DIAGNOSE reads from EXC (as `.report`), to raise `from exc`; FALLBACK(text)
    makes a bare report when the diagnosis itself fails, which must never hide the original error."""
    try:
        report = diagnose(exc, model, outer)
    except Exception as inner:
        report = fallback(f"{exc} (torchplace could not read more: {inner!r})")
    err = error(report.message())
    err.report = report  # type: ignore[attr-defined]
    return err


def module_path(chain: list[torch.nn.Module], root: torch.nn.Module | None, root_label: str) -> str:
    """`Outer.encoder.attn`: the innermost called module, named along the chain of calls (where ModuleNames
    finds no name for it)."""
    parts = [root_label if chain[0] is root else type(chain[0]).__name__]
    for parent, child in zip(chain, chain[1:]):
        name = next((n for n, m in parent.named_modules(remove_duplicate=False) if m is child and n), None)
        parts.append(name or type(child).__name__)
    return ".".join(parts)


class ModuleNames:
    """Names modules the way the user wrote them. The root (the given model, else the outermost running module,
    seen through DDP, DataParallel, torch.compile and Fabric so paths follow the user's class) is named as the
    user's code holds it (`t_net`, `predictor.net`, `net.module`), else "model" (a module not given: its class);
    other modules from what the user's code holds (`criterion`, `ema.ema_model`); plain lists and dicts too
    (`model.heads[1]`). FRAMES: the error's, outermost first; their callers, still running (watch's block,
    explain's caller), are read too. Runs only after an error."""

    def __init__(self, model: torch.nn.Module | None, chain: list[torch.nn.Module], frames: list[FrameType]) -> None:
        held = list(user_modules([e[0] for e in fr.stack_entries(frames[0].f_back)] + frames if frames else []))
        self.root = unwrap(model) if model is not None else unwrap(chain[0]) if chain else None
        self.spaces, self.label, self.holders = held, "model", dict[int, str]()
        if self.root is not None:
            self.label = self.path(self.root) or ("model" if model is not None else type(self.root).__name__)
            self.spaces = [(self.label, self.root), *held]

    def path(self, target: torch.nn.Module) -> str | None:
        """TARGET's path; where a plain attribute, list or dict hides it from .to(), that is kept in `holders`."""
        found = next((f for label, module in self.spaces if (f := _find_module(module, label, target, set()))), None)
        if found is not None and found[1]:
            self.holders[id(target)] = found[1]
        return found[0] if found else None


def user_modules(user_frames: list[FrameType]) -> Iterator[tuple[str, torch.nn.Module]]:
    """(the user's name, module) for each module the user's own frames hold, outermost frame first (the names the
    program knows them by, not a helper's parameter or a loop's variable), then the globals of the user's files: a
    variable (`criterion`), an attribute of a plain object (`solver.mrstftloss`, `self.net` in a method of the
    user's class), the module inside a wrapper as code reaches it (`net.module` of a DataParallel). A module's own
    `self` and names starting with `_` are no names."""
    frames = [f for f in user_frames if fr.is_users_own(f.f_code.co_filename)]
    spaces = [f.f_locals for f in frames] + list({id(f.f_globals): f.f_globals for f in frames}.values())
    for space in spaces:
        for name, value in list(space.items()):
            if name.startswith("_") or (name == "self" and isinstance(value, torch.nn.Module)):
                continue
            for label, module in [(name, value)] if isinstance(value, torch.nn.Module) else _attributes(name, value):
                suffix, inner = reach(module)
                yield from [(label + suffix, inner)] if inner is not module else []
                yield label, module


def _attributes(name: str, value: Any, kind: type = torch.nn.Module) -> list[tuple[str, Any]]:
    """(`name.key`, module) for each module (or KIND) a plain object holds as an attribute."""
    held = getattr(value, "__dict__", None)  # a class's is no dict
    if not isinstance(held, dict) or isinstance(value, (ModuleType, FunctionType, MethodType)):
        return []
    return [(f"{name}.{k}", v) for k, v in list(held.items())[:256] if isinstance(v, kind)]


def _find_module(root: torch.nn.Module, label: str, target: torch.nn.Module,
                 seen: set[int]) -> tuple[str, str | None] | None:
    """(path of TARGET under ROOT, the plain attribute that hides it from ROOT.to() or None): through registered
    submodules, then modules kept in plain attributes, lists, tuples and dicts (`model.teacher`, `model.heads[0]`)."""
    seen.add(id(root))
    for name, module in root.named_modules(remove_duplicate=False):
        if module is target:
            return (f"{label}.{name}" if name else label), None
    for name, module in root.named_modules():
        prefix = f"{label}.{name}" if name else label
        for key, value in vars(module).items():
            if key in MODULE_INTERNALS:
                continue
            holder = f"{prefix}.{key}"
            items = [(holder, value)] if isinstance(value, torch.nn.Module) else [
                (f"{holder}[{k!r}]", v) for k, v in list(value.items() if isinstance(value, dict) else enumerate(
                    value) if isinstance(value, (list, tuple)) else ())[:256]]
            for item_label, item in items:
                found = _find_module(item, item_label, target, seen) if isinstance(
                    item, torch.nn.Module) and id(item) not in seen else None
                if found is not None:
                    return found[0], found[1] or holder
    return None


def origins_of(chain: list[torch.nn.Module], user_frames: list[FrameType],
               names: ModuleNames) -> dict[int, tuple[str, str]]:
    """id(tensor) -> (kind, where it came from); the modules' own tensors first (the model's, then those of the
    modules the user's code holds: an EMA copy, a loss), then the batch."""
    out: dict[int, tuple[str, str]] = {}
    modules = names.spaces + [(names.path(m) or type(m).__name__, m) for m in chain]  # those hidden from .to() too
    for label, module in modules:
        for name, sub in module.named_modules():
            prefix = f"{label}.{name}" if name else label
            for kind, key, tensor in own_tensors(sub):
                out.setdefault(id(tensor), (kind, f"{prefix}.{key}"))
                out.setdefault(storage_key(tensor), (kind, f"{prefix}.{key}"))
        for path, tensor in plain_attributes(module, label):
            out.setdefault(id(tensor), ("attribute", path))
            out.setdefault(storage_key(tensor), ("attribute", path))
    # keyed paths first (`batch['x']` says more than `x`), then variables, then positions (`zero_tensor` says more
    # than `word_embeddings[2]`, the list it was appended to); each from the innermost frame that holds it
    found: list[list[tuple[int, tuple[str, str]]]] = [[], [], []]
    for frame in reversed(user_frames):
        where = _where(frame)
        for name, value in frame.f_locals.items():
            if name == "self":
                continue
            plain = isinstance(value, torch.Tensor)
            for path, tensor in _flatten(value, name):
                tier = 1 if plain else 2 if _POSITION.search(path) else 0
                found[tier].append((id(tensor), ("local" if plain else "batch", f"{path} {where}")))
    for key, origin in itertools.chain(*found):
        out.setdefault(key, origin)
    return out


_POSITION = re.compile(r"\[\d+\]")  # an index into a list or tuple, not a key
_NO_NAME = re.compile(r"\._|\(")  # a private attribute, or a key that prints as a call (a tensor's repr)


def trace_assignment(info: Operand, op_frame: FrameType, frames: Sequence[FrameType] = ()) -> None:
    """Where a local culprit was assigned (`h0 = torch.zeros(...)` at file:line), and whether that is a
    torch factory call without a device. Reads the function's source; runs only after an error."""
    if info.made:  # already found where the user's code further out made it
        return
    # the variable the origin names (`edge_index at net.py:12`, `state[0] in BiLSTM.forward()`) in the frames of
    # that file that hold it; then the op's own name for it
    name, _, where = (info.origin or "").partition(" at ")
    name, where = re.split(r"[\[.( ]", name, maxsplit=1)[0], where.rpartition(":")[0]
    held = [(name, f) for f in frames if name in f.f_locals and where in ("", fr.short_path(f.f_code.co_filename))]
    for name, frame in held + [(info.label, op_frame)] if where else [(info.label, op_frame)] + held:
        if not name.isidentifier() or fr.is_library(frame.f_code.co_filename):
            continue
        found = fr.assignment_of(name, frame)
        if found is not None:
            line, text, factory = found
            info.made = f"`{text}` at {fr.short_path(frame.f_code.co_filename)}:{line}"
            info.factory = factory
            return


def misplaced_state(optimizer: torch.optim.Optimizer, root: torch.nn.Module | None,
                    root_label: str = "model") -> list[str]:
    """`model.fc.weight['exp_avg'] on cpu (parameter on cuda:0)` for each state tensor elsewhere than its
    parameter (0-dim CPU counters such as Adam's 'step' are where torch keeps them)."""
    names = {id(p): f"{root_label}.{n}" for n, p in root.named_parameters(remove_duplicate=False)} if root else {}
    out = []
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor) or value.device == param.device or (
                    value.device.type == "cpu" and value.dim() == 0):
                continue
            out.append(f"{names.get(id(param), 'a parameter')}[{key!r}] on {value.device} "
                       f"(parameter on {param.device})")
    return out


def _where(frame: FrameType) -> str:
    owner, name = frame.f_locals.get("self"), frame.f_code.co_name
    if name == "<module>":
        return f"in {fr.short_path(frame.f_code.co_filename)}"
    return f"in {type(owner).__name__}.{name}()" if isinstance(owner, torch.nn.Module) else f"in {name}()"


def _flatten(value: Any, path: str, depth: int = 4) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in nested containers, leaving out parameters (those are named by the model)."""
    found = tensors_with_paths(value, path, depth=depth, items=256)
    return ((p, t) for p, t in found if not isinstance(t, torch.nn.Parameter))


def operands(op_frame: FrameType, expression: str | None, user: tuple[FrameType, int, int] | None,
             origins: dict[int, tuple[str, str]], outer: Sequence[FrameType] = (),
             at: dict[int, tuple[int, int]] | None = None) -> list[Operand]:
    at = at or {}
    found: dict[int, Operand] = {}
    named = fr.named_values(expression, op_frame)
    if not named:  # no expression to read: every tensor the frame holds
        named = [(k, v) for k, v in op_frame.f_locals.items() if isinstance(v, (torch.Tensor, list, tuple))]
    for label, value in named:
        if isinstance(value, torch.Generator) and id(value) not in found:
            found[id(value)] = Operand(label=label, device=str(value.device), dtype="generator", shape=(),
                                          kind="generator", origin=f"generator {label}")
            continue
        pairs = [(label, value)] if isinstance(value, torch.nn.Parameter) else _flatten(value, label, 1)
        for path, tensor in pairs:
            if id(tensor) not in found:
                found[id(tensor)] = operand_info(path, tensor, origins)
    present = {t.device for t in found.values() if not t.scalar}
    for source, device in fr.inline_factories(expression):  # `x * torch.tensor([1., 2.])`: made in the op itself
        if present and device not in present and len(found) < 64:
            found[-len(found) - 1] = Operand(label=source, device=device, dtype="?", shape=(), kind="inline",
                                             origin="made inside the expression")
    tensors = {id(v): v for _, v in named if isinstance(v, torch.Tensor)}
    for key, info in found.items():
        passed = key in tensors and info.kind in ("local", "value") and _name_passed(info, tensors[key], op_frame, at)
        if key in tensors and info.kind in ("local", "value", "batch") and not passed:
            _made_outside(info, tensors[key], [f for f in outer if f is not op_frame and not (user and f is user[0])])
        tensor, own = tensors.get(key), (info.origin or "").split(" ")[0]  # a library's local, or a loop variable
        loop = info.kind == "local" and any(g.f_locals.get(own) is tensor and _iterated(own, g) for g in outer)
        if tensor is not None and (loop or info.origin is None and fr.is_library(op_frame.f_code.co_filename)):
            info.origin = held_path(tensor, reversed(outer)) or info.origin
    return list(found.values())


def passed_in(tensor: torch.Tensor, frame: FrameType, at: dict[int, tuple[int, int]]) -> tuple[str, FrameType,
                                                                                              int] | None:
    """What the user's code passed into the call FRAME runs for TENSOR, as it wrote it, followed out through the
    callers that pass it (or the object holding it) on as an argument: `images` of `image_step(model, images)`,
    `sent1.ids` for a forward's `inputs.ids`, `torch.from_numpy(state)`; with the frame and line that wrote it.
    AT: id(frame) -> (line, instruction) where the traceback has them (a frame still running has moved on)."""
    found, target, suffix, want = None, tensor, "", None
    while True:
        code = frame.f_code
        name = next((n for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
                     if frame.f_locals.get(n) is target and want in (None, n)), None)
        caller = frame.f_back  # past the call machinery, and a torch function mode's re-run of the same function
        while caller is not None and (fr.is_plumbing(caller) or fr.is_internal(caller.f_code.co_filename)):
            caller = caller.f_back
        if name and caller is not None and caller.f_code is code:
            frame = caller
            continue
        line, lasti = at.get(id(caller), (caller.f_lineno, caller.f_lasti)) if caller is not None else (0, 0)
        node = fr.argument_source(caller, line, lasti, frame, name) if name and caller is not None else None
        text = ast.unparse(node) if node is not None else ""
        since = fr.assignment_of(name, frame) if node is not None else None  # but for the running line's own
        if node is None or since and since[0] != frame.f_lineno and dict(fr.named_values(text, caller)).get(text) \
                is not target:  # an argument assigned since: only where the caller's text reads so
            return found
        found = (text + suffix, caller, line) if fr.is_users_own(caller.f_code.co_filename) else found
        head = node
        while isinstance(head, (ast.Attribute, ast.Subscript)):  # `inputs.ids`: where `inputs` came from
            head = head.value
        if not (isinstance(head, ast.Name) and head.id in caller.f_locals) or head is not node and isinstance(
                caller.f_locals[head.id], torch.Tensor):  # a tensor's slice is no name for it further out
            return found
        target, suffix, frame, want = caller.f_locals[head.id], text[len(head.id):] + suffix, caller, head.id


def _name_passed(info: Operand, tensor: torch.Tensor, frame: FrameType, at: dict[int, tuple[int, int]]) -> bool:
    """INFO named by what the user's code passed into FRAME's call, and where that code made it (False: not passed)."""
    step = passed_in(tensor, frame, at)
    if step is None or info.made:
        return False
    source, caller, line = " ".join(step[0].split()), step[1], step[2]
    where, node = fr.short_path(caller.f_code.co_filename), fr.parse_expression(source)
    head = node.body if isinstance(node, ast.Expression) else None
    while isinstance(head, (ast.Call, ast.Attribute, ast.Subscript)):  # `target_new.float()`: target_new
        head = head.func if isinstance(head, ast.Call) else head.value
    found = fr.assignment_of(head.id, caller) if isinstance(head, ast.Name) and head.id in caller.f_locals else None
    if found is None and fr.factory_note(source):  # made in the call itself
        info.made, info.factory = f"`{source}` at {where}:{line}", fr.factory_note(source)
        return True
    info.origin = f"{source} at {where}:{line}"
    if found is not None and found[2]:  # made without a device
        info.made, info.factory = f"`{found[1]}` at {where}:{found[0]}", found[2]
    return True


def held_path(target: torch.Tensor, frames: Iterator[FrameType]) -> str | None:
    """Where the user's objects hold TARGET itself (`self.preconditioner[0][0] in step()`), innermost frame first:
    modules' tensors and locals' attributes two deep, and the containers those are; a loop variable holds nothing."""
    for frame in frames:
        for name, value in list(frame.f_locals.items())[:256]:
            attrs = _attributes(name, value, object)  # through an attribute: a list of batches says no more than a loop
            for label, obj in [(name, value)] * isinstance(value, torch.nn.Module) + attrs + [
                    a for n, v in attrs[:16] for a in _attributes(n, v, object)][:512]:
                g = itertools.chain(obj.named_parameters(label), obj.named_buffers(label)) if isinstance(
                    obj, torch.nn.Module) else tensors_with_paths(obj, label, depth=3, items=64)
                at = next((p for p, t in g if t is target and not _NO_NAME.search(p)), "")
                if at and not _iterated(name, frame):
                    return f"{at} {_where(frame)}"
    return None


def _iterated(name: str, frame: FrameType) -> bool:
    """Whether NAME is a loop's (or with's, or comprehension's) variable: no argument, no assignment."""
    code = frame.f_code
    return code.co_name != "<module>" and name not in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount] \
        and fr.assignment_of(name, frame) is None


def _made_outside(info: Operand, tensor: torch.Tensor, frames: list[FrameType]) -> None:
    """A local passed in from the user's code further out: named where that code made it (`probe =
    torch.rand(...)` in the caller of the model), the variable and call line as the user wrote them."""
    for frame in frames:  # outermost first
        for name, value in frame.f_locals.items():
            key = next((f".{k}" for k, v in getattr(value, "__dict__", {}).items() if v is tensor), "")  # `data.x`
            if not (value is tensor or key) or name == "self" or fr.is_library(frame.f_code.co_filename):
                continue
            found = fr.assignment_of(name, frame)
            if found is not None and (found[2] or info.kind != "batch"):  # a batch key says more, but a factory
                where = fr.short_path(frame.f_code.co_filename)
                info.origin = f"{name}{key} at {where}:{frame.f_lineno}"
                info.made, info.factory = f"`{found[1]}` at {where}:{found[0]}", found[2]
                return


def storage_key(tensor: torch.Tensor) -> int:
    """A key for the memory a tensor views (negative, apart from ids): `.data` and views of a parameter or
    attribute share it; 0 where there is none to read."""
    try:
        return -tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return 0


def operand_info(label: str, tensor: torch.Tensor, origins: dict[int, tuple[str, str]]) -> Operand:
    kind, origin = origins.get(id(tensor)) or origins.get(id(tensor._base)) or ("value", None)
    if kind in ("value", "local", "batch"):  # `.data` or a view of a parameter or attribute: named by it
        kind, origin = origins.get(storage_key(tensor) or 1, (kind, origin))
    if isinstance(tensor, torch.nn.Parameter) and kind == "value":
        kind = "parameter"
    _, made, factory = (BIRTHS.get() or {}).get(id(tensor), (None, None, None))
    return Operand(label=label, device=str(tensor.device), dtype=str(tensor.dtype).removeprefix("torch."),
                   shape=tuple(tensor.shape), kind=kind, origin=origin, made=made, factory=factory,
                   scalar=tensor.device.type == "cpu" and tensor.dim() == 0)


# where the dry run saw each tensor made by a factory: id -> (tensor, "`code` at file:line", factory note)
BIRTHS: ContextVar[dict[int, tuple[torch.Tensor, str, str | None]] | None] = ContextVar("torchplace_births",
                                                                                       default=None)


def note_birth(tensor: torch.Tensor, name: str, device: Any) -> None:
    """Inside a dry run: TENSOR was just made by torch.NAME(..., device=DEVICE), at the user's line."""
    births, frame = BIRTHS.get(), fr.caller_frame()
    if births is not None and frame is not None:
        site = fr.site_of(frame)
        tree = fr.parse_expression(site.line)  # the statement, as trace_assignment() gives one
        code = " ".join(ast.unparse(tree).split()) if tree is not None else site.expression
        where = f" in {site.function}()" if code.startswith("return ") else ""  # a helper's result: which helper
        births[id(tensor)] = (tensor, f"`{code}`{where} at {fr.short_path(site.filename)}:{site.lineno}",
                              None if device is not None else
                              f"torch.{name}(...) without a device, so on the {tensor.device.type.upper()}")
