"""Reading Python frames after the fact: which frame ran the failing op, its exact expression,
and the tensors that expression names.

Everything here runs only when something already went wrong (or is about to be reported), so
it may be thorough; nothing here is on a hot path. Expressions come from the instruction
positions Python 3.11+ keeps (`co_positions`), so `F.linear(input, self.weight, self.bias)`
is cut out of its line exactly; on 3.10 the whole line is used.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import inspect
import linecache
import os
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import torch

from ..shared import frames as user_code
from ..shared.frames import PACKAGE_DIR, TORCH_DIR, is_installed, is_user, user_frame

_MODULE_PY = TORCH_DIR + os.path.join("nn", "modules", "module.py")
_CHECKS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PLACEMENT_DIR = os.path.join(PACKAGE_DIR, "placement") + os.sep
_SHARED_DIR = os.path.join(PACKAGE_DIR, "shared") + os.sep
# torchplace's own wrappers, scopes and setter recorder: never the culprit
_SKIPPED = (_CHECKS_DIR, _PLACEMENT_DIR, _SHARED_DIR, TORCH_DIR)
_PLUMBING = frozenset({"_wrapped_call_impl", "_call_impl", "inner"})
_MODE_HOOKS = frozenset({"__torch_function__", "__torch_dispatch__"})
_UNKNOWN = object()


@dataclass(frozen=True)
class Site:
    """A place in the source: file, line, function and (where known) the expression that ran."""

    filename: str
    lineno: int
    function: str
    expression: str | None = None

    def __str__(self) -> str:
        return f"{short_path(self.filename)}:{self.lineno} in {self.function}()"

    @property
    def line(self) -> str:
        """The source line, stripped."""
        return linecache.getline(self.filename, self.lineno).strip()


def short_path(filename: str) -> str:
    """A path as a reader wants it: relative to the working directory or to site-packages."""
    for base in user_code.SITE_DIRS:
        if filename.startswith(base):
            return filename[len(base):]
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith(".." + os.sep) else rel


def is_internal(filename: str) -> bool:
    """torch's own op machinery (decompositions, refs, prims, dispatch): below the op call."""
    if not filename.startswith(TORCH_DIR):
        return False
    first = filename[len(TORCH_DIR):].split(os.sep, 1)[0]
    return first.startswith("_") or first in ("library.py", "overrides.py")


def is_plumbing(frame: FrameType) -> bool:
    """Frames that only route a call: nn.Module's call machinery, torchplace's own wrappers, and a torch function
    or dispatch mode's hook (whoever wrote the mode)."""
    filename, name = frame.f_code.co_filename, frame.f_code.co_name
    if filename.startswith(_CHECKS_DIR) or name in _MODE_HOOKS:
        return True
    return filename == _MODULE_PY and name in _PLUMBING


def is_library(filename: str) -> bool:
    """torch itself or torchplace's checks: never the user's code."""
    return filename.startswith(TORCH_DIR) or filename.startswith(_CHECKS_DIR)


# torch's factories that take a device (implicit_device.py watches them), and from_numpy, always on the CPU
FACTORY_NAMES = ("tensor", "as_tensor", "asarray", "empty", "zeros", "ones", "full", "rand", "randn", "randint",
                 "randperm", "arange", "linspace", "logspace", "eye", "empty_strided", "scalar_tensor")
_FACTORIES = frozenset({*FACTORY_NAMES, "from_numpy"})


def is_users_own(filename: str) -> bool:
    """Code the user wrote: user code that no installed package holds."""
    return is_user(filename) and not is_installed(filename)


def assignment_of(name: str, frame: FrameType, depth: int = 0,
                  before: int = 1 << 30) -> tuple[int, str, str | None] | None:
    """The last `name = ...` of frame's function before the running line and line BEFORE: (line, source, factory note).

    The note says when the right-hand side makes a tensor with a torch factory that gives no
    device (it lands on the CPU) or an index-less one (whichever GPU is current).
    """
    if frame.f_code.co_name == "<module>":
        return None
    try:
        lines, start = inspect.getsourcelines(frame.f_code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        if name in names and start + node.lineno - 1 <= frame.f_lineno and start + node.lineno - 1 < before:
            found.append(node)
    # the latest, passing over `name = other` where other holds something else now (a branch not taken) and the
    # running line's own (it has not stored yet, unless a loop ran it before)
    value = frame.f_locals.get(name, _UNKNOWN)
    best = next((n for n in sorted(found, key=lambda n: (start + n.lineno - 1 < frame.f_lineno, n.lineno),
                                   reverse=True)
                 if not (isinstance(getattr(n, "value", None), ast.Name) and n.value.id in frame.f_locals
                         and frame.f_locals[n.value.id] is not value)), None)
    if best is None:
        return None
    line = start + best.lineno - 1
    return line, " ".join(ast.unparse(best).split()), _made_by(getattr(best, "value", None), frame, depth, line)


def _made_by(value: ast.AST | None, frame: FrameType, depth: int, line: int) -> str | None:
    """The factory note of a right-hand side: its own factory call, else (a step or two further) the factory that
    made a local tensor (or list of them) it reads, or the one a function of the user's it calls returns."""
    note = _factory_note(value)
    if note is not None or value is None or depth > 2 or _moved(value):
        return note
    for node in ast.walk(value):
        if isinstance(node, ast.Name) and isinstance(frame.f_locals.get(node.id), (torch.Tensor, list, tuple)):
            found = assignment_of(node.id, frame, depth + 1, line)  # `w = w.unsqueeze(0)`: the `w` before
            if found is not None and found[2]:
                return f"{found[2]} (`{found[1]}` at line {found[0]})"
        if isinstance(node, ast.Call):
            func = _evaluate(node.func, frame, functions=True)
            code = getattr(getattr(func, "__func__", func), "__code__", None)
            if code is None or not is_users_own(code.co_filename):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
            except (OSError, TypeError, SyntaxError):
                continue
            notes = [(r, _factory_note(r.value)) for r in ast.walk(tree) if isinstance(r, ast.Return)]
            made = next(((r, n) for r, n in notes if n), None)
            if made is not None:
                return f"{made[1]} (`{ast.unparse(made[0])}` in {code.co_name}() at " \
                       f"{short_path(code.co_filename)}:{code.co_firstlineno + made[0].lineno - 1})"
    return None


def _moved(value: ast.AST) -> bool:
    """Whether an expression moves its result explicitly (`.to(...)`, `.cuda()`)."""
    return any(isinstance(n, ast.Attribute) and n.attr in ("to", "cuda") for n in ast.walk(value))


def factory_note(source: str) -> str | None:
    """What the torch factory call SOURCE leaves implicit about its device (`_factory_note` of its text)."""
    return _factory_note(parse_expression(source))


def _factory_note(value: ast.AST | None) -> str | None:
    if value is None or _moved(value):
        return None
    for node in ast.walk(value):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        if not (func.startswith("torch.") and func.split(".", 1)[1] in _FACTORIES):
            continue
        device = next((k.value for k in node.keywords if k.arg == "device"), None)
        if device is None:
            return f"{func}(...) without a device, so on the CPU"
        spec = ast.unparse(device)
        if spec.strip("'\"") in ("cuda", "xpu", "mps") or spec in ("torch.device('cuda')", 'torch.device("cuda")'):
            return f"{func}(..., device={spec}) without an index, so on whichever GPU is current"
    return None


def inline_factories(expression: str | None) -> list[tuple[str, str]]:
    """(source, device) of each torch factory call written inside EXPRESSION whose device can be read
    without running anything (a literal device=, or none: the default device); 0-dim `torch.tensor(2.0)`
    is left out (a CPU scalar, which elementwise ops take on any device)."""
    tree = parse_expression(expression) if expression else None
    out: list[tuple[str, str]] = []
    for node in ast.walk(tree) if tree is not None else ():
        func = ast.unparse(node.func) if isinstance(node, ast.Call) else ""
        if not (func.startswith("torch.") and func.split(".", 1)[1] in _FACTORIES):
            continue
        assert isinstance(node, ast.Call)
        spec = next((k.value for k in node.keywords if k.arg == "device"), None)
        if spec is None and func == "torch.tensor" and node.args and isinstance(node.args[0], ast.Constant) or (
                spec is not None and not (isinstance(spec, ast.Constant) and isinstance(spec.value, str))):
            continue
        try:
            device = str(torch.device(spec.value)) if spec is not None else str(torch.get_default_device())
        except RuntimeError:
            continue
        out.append((" ".join(ast.unparse(node).split()), device))
    return out


def traceback_entries(tb: TracebackType | None) -> list[tuple[FrameType, int, int]]:
    """(frame, line, last instruction) from the outermost to the innermost frame."""
    out = []
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno, tb.tb_lasti))
        tb = tb.tb_next
    return out


def stack_entries(start: FrameType | None) -> list[tuple[FrameType, int, int]]:
    """The live stack from the outermost frame down to `start`, in traceback order."""
    out = []
    while start is not None:
        out.append((start, start.f_lineno, start.f_lasti))
        start = start.f_back
    out.reverse()
    return out


def caller_frame() -> FrameType | None:
    """The nearest frame outside torch and torchplace's checks, scopes and shared plumbing."""
    return user_frame(sys._getframe(1), _SKIPPED)


def site_of(frame: FrameType, lineno: int | None = None, lasti: int | None = None) -> Site:
    lineno, lasti = frame.f_lineno if lineno is None else lineno, frame.f_lasti if lasti is None else lasti
    return Site(frame.f_code.co_filename, lineno, frame.f_code.co_name, expression_at(frame, lineno, lasti))


def expression_at(frame: FrameType, lineno: int, lasti: int) -> str | None:
    """The source text of the instruction that ran at `lasti` (the whole line before 3.11)."""
    filename = frame.f_code.co_filename
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is not None and lasti >= 0:
        try:
            start, end, col, end_col = list(positions())[lasti // 2]
        except (IndexError, ValueError):
            start = None
        if start is not None and end is not None and col is not None and end_col is not None:
            lines = [linecache.getline(filename, n).encode() for n in range(start, end + 1)]
            if all(lines):
                if len(lines) == 1:
                    return lines[0][col:end_col].decode(errors="replace").strip()
                text = (lines[0][col:] + b"".join(lines[1:-1]) + lines[-1][:end_col]).decode(errors="replace")
                tree = parse_expression(text)  # several lines: drop comments and line breaks
                return ast.unparse(tree) if tree is not None else " ".join(text.split())
    line = linecache.getline(filename, lineno).strip()
    return line or None


def argument_source(caller: FrameType, lineno: int, lasti: int, callee: FrameType, name: str) -> ast.expr | None:
    """The expression CALLER's call at (LINENO, LASTI) passes as argument NAME of the function CALLEE runs
    (`target_new.float()` for `target` of `F.cross_entropy(x, target_new.float())`); a bound `self` is not written."""
    tree = parse_expression(expression_at(caller, lineno, lasti) or "")
    call = tree.body if isinstance(tree, ast.Expression) else None
    if not isinstance(call, ast.Call):
        return None
    keyword = next((k.value for k in call.keywords if k.arg == name), None)
    code = callee.f_code
    params = code.co_varnames[:code.co_argcount]
    if keyword is not None or name not in params or any(isinstance(a, ast.Starred) for a in call.args):
        return keyword
    func = _evaluate(call.func, caller, functions=True)
    base = _evaluate(call.func.value, caller) if isinstance(call.func, ast.Attribute) else _UNKNOWN
    first = callee.f_locals.get(params[0], _UNKNOWN)
    bound = first is not _UNKNOWN and (first is func or first is base or isinstance(func, type) and isinstance(
        first, func))  # `model(x)`, `obj.method(x)`, `Cls(x)`
    index = params.index(name) - bound
    return call.args[index] if 0 <= index < len(call.args) else None


def named_values(expression: str | None, frame: FrameType) -> list[tuple[str, Any]]:
    """Every name, attribute chain and constant subscript in `expression`, with its value.

    Only reads: locals, globals, a module's registered tensors and plain attributes (found
    without running properties), and constant keys of dicts, lists and tuples.
    """
    if not expression:
        return []
    tree = parse_expression(expression)
    if tree is None:
        return []
    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
            label = ast.unparse(node)
            if label in seen:
                continue
            seen.add(label)
            value = _evaluate(node, frame)
            if value is not _UNKNOWN:
                out.append((label, value))
    return out


def parse_expression(expression: str) -> ast.AST | None:
    for text, mode in ((expression, "eval"), (expression.rstrip(":"), "eval"), (f"({expression})", "eval"),
                       (expression, "exec")):
        try:
            return ast.parse(text, mode=mode)
        except SyntaxError:
            continue
    return None


def _evaluate(node: ast.AST, frame: FrameType, functions: bool = False) -> Any:
    if isinstance(node, ast.Name):
        for space in (frame.f_locals, frame.f_globals, vars(builtins)):
            if node.id in space:
                return space[node.id]
        return _UNKNOWN
    if isinstance(node, ast.Attribute):
        base = _evaluate(node.value, frame)
        if base is _UNKNOWN or isinstance(base, torch.Tensor):
            return _UNKNOWN  # tensor attributes (.T, .mT) would run ops
        found = static_attribute(base, node.attr)
        if found is _UNKNOWN and functions:  # a method, looked up without running a property
            with contextlib.suppress(AttributeError):
                found = inspect.getattr_static(base, node.attr)
            found = found if inspect.isfunction(found) else _UNKNOWN
        return found
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        base = _evaluate(node.value, frame)
        try:
            if isinstance(base, (dict, list, tuple, torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)):
                return base[node.slice.value]  # a container of modules indexes without running an op
        except (KeyError, IndexError, TypeError):
            pass
    return _UNKNOWN


def static_attribute(obj: Any, name: str) -> Any:
    """obj.name without running a property: registered module tensors, then instance data."""
    if inspect.ismodule(obj):
        return getattr(obj, name, _UNKNOWN)
    if isinstance(obj, torch.nn.Module):
        for registry in ("_parameters", "_buffers", "_modules"):
            found = obj.__dict__.get(registry, {})
            if name in found:
                return found[name]
    try:
        value = inspect.getattr_static(obj, name)
    except AttributeError:
        return _UNKNOWN
    return _UNKNOWN if hasattr(type(value), "__get__") else value


def called_modules(entries: list[tuple[FrameType, int, int]]) -> Iterator[torch.nn.Module]:
    """The modules being called in these frames, outermost first (from nn.Module's _call_impl)."""
    for frame, _, _ in entries:
        if frame.f_code.co_filename == _MODULE_PY and frame.f_code.co_name == "_call_impl":
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                yield module
