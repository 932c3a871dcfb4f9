"""Reading the code that called explain(): the user's step around the call, statically.

explain() is handed the model and a batch, but the mistakes of a training step often sit beside
the model call, in the user's own function: a loss whose weight stayed on the CPU
(`criterion(model(x), y)`), labels never moved, a metric object, a 0-dim CPU tensor stacked with
the loss. This module reads the source of the nearest few functions of the user's code on the
stack (the one that called explain() first), resolves the names there to the live objects of
those frames, and infers where each tensor of each call will be, without running anything:

- a name bound in the frame is read (unless the function assigns it again in between: then
  that assignment is followed instead);
- a name assigned later is followed to its assignment: a torch factory (no device: the default
  device), the model's output (where the forward put it), a torch function of known tensors,
  a tensor method that keeps the device, `.to(...)` / `.cpu()`;
- anything else is unknown, and unknown is never judged.

A mismatch is reported only where torch itself refuses it: an arithmetic or comparison operator
between tensors on two devices (a 0-dim CPU tensor is allowed there), torch.stack / torch.cat
(which refuse 0-dim CPU tensors too), a torch loss or matmul, and a module outside the model
whose own tensors sit elsewhere than what it is called with (unless the function moves it).
Without source (a REPL, python -c) nothing is read. Runs only inside explain(); the parsing of the
source (the function's statements, its assignments) is source_reading.py's.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from . import frames as fr
from . import source_reading as src
from .layout import own_tensors, plain_attributes

_FRAMES = 3  # the function that called explain() and the two that called it
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_KEEPS_DEVICE = frozenset({
    "argmax", "argmin", "float", "half", "double", "bfloat16", "long", "int", "bool", "type_as", "detach", "clone",
    "contiguous", "sum", "mean", "max", "min", "amax", "amin", "abs", "neg", "exp", "log", "sqrt", "square", "pow",
    "sigmoid", "tanh", "relu", "softmax", "log_softmax", "clamp", "norm", "squeeze", "unsqueeze", "view", "reshape",
    "flatten", "transpose", "permute", "t", "expand", "expand_as", "view_as", "reshape_as", "repeat", "masked_fill",
})
_RESHAPES = frozenset({"unsqueeze", "view", "reshape", "flatten", "expand", "expand_as", "view_as", "reshape_as",
                       "repeat"})
_STACKS = frozenset({"stack", "cat", "concat", "concatenate", "hstack", "vstack"})
_SAME_DEVICE = _STACKS | frozenset({
    "matmul", "mm", "bmm", "dot", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "cosine_similarity", "poisson_nll_loss",
    "soft_margin_loss", "multilabel_soft_margin_loss", "margin_ranking_loss", "cosine_embedding_loss",
})
_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.MatMult)
_COMPARISONS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


@dataclass(frozen=True)
class Known:
    """What the reading knows of one tensor expression."""

    device: str
    label: str
    scalar: bool = False  # a 0-dim CPU tensor
    made: str | None = None  # "`box_loss = torch.tensor(0.0)` at train.py:12"


@dataclass
class Reading:
    """What the caller's code showed: problems, where the model is called, where companions are."""

    problems: list[dict[str, str]] = field(default_factory=list)
    model_calls: list[str] = field(default_factory=list)  # "train.py:40 in step(): `loss = model(x)`"
    used: dict[int, str] = field(default_factory=dict)  # id(module) -> its first call site, as above
    optimizers: list[tuple[torch.optim.Optimizer, str]] = field(default_factory=list)  # and where each steps


def read_callers(start: FrameType | None, model: torch.nn.Module, output_device: str | None,
                 skip: list[Any]) -> Reading:
    """Read the user's functions from START outwards; SKIP: companions explain() checks itself."""
    reading = Reading()
    frame, seen = start, 0
    while frame is not None and seen < _FRAMES:
        filename = frame.f_code.co_filename
        if fr.is_users_own(filename) and not filename.startswith((_STDLIB, "<")):
            seen += 1
            scope = src.scope_of(frame)
            if scope is not None:
                _Function(frame, scope, model, output_device, skip, reading).judge()
        frame = frame.f_back
    return reading


class _Function:
    """One frame's function: its assignments, and the judging of its calls and operators."""

    def __init__(self, frame: FrameType, scope: ast.AST, model: torch.nn.Module, output_device: str | None,
                 skip: list[Any], reading: Reading) -> None:
        self.frame, self.model, self.reading = frame, model, reading
        self.output_device = output_device
        self.skip = {id(v) for v in skip}
        self.nodes = src.own_nodes(scope)
        self.where = f"{fr.short_path(frame.f_code.co_filename)}"
        self.function = frame.f_code.co_name
        self.assigned = src.assignments(self.nodes)
        self.shadowed = src.comprehension_names(self.nodes)
        # factories under a `with` block (torch.device(...) as a context) land where this reading does not follow
        self.in_with = {id(n) for w in self.nodes if isinstance(w, (ast.With, ast.AsyncWith))
                        for statement in w.body for n in ast.walk(statement)}

    # ------------------------------------------------------------------ reading values

    def _bound(self, name: str, line: int, identity: bool = False) -> bool:
        """Whether the value the frame holds for NAME is the one the code at LINE sees (IDENTITY: the same
        object, even if a method such as `.to()` changed it in place since)."""
        now = self.frame.f_lineno
        lines = [at for at, _, node in self.assigned.get(name, []) if not (identity and isinstance(node, ast.Expr))]
        if line > now:
            return not any(now < at < line for at in lines)
        return not any(line < at <= now for at in lines)

    def _object(self, node: ast.AST, identity: bool = False) -> Any:
        """The live object of a name, attribute chain or constant subscript, when the code there sees it."""
        root = src.root_name(node)
        if root is None or id(root) in self.shadowed or not self._bound(root.id, src.line_of(node), identity):
            return fr._UNKNOWN
        return fr._evaluate(node, self.frame)

    def infer(self, node: ast.AST, depth: int = 0) -> Known | None:
        if depth > 8:
            return None
        label = " ".join(ast.unparse(node).split())
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
            value = self._object(node)
            if isinstance(value, torch.Tensor):
                return Known(str(value.device), label, value.device.type == "cpu" and value.dim() == 0)
            if isinstance(node, ast.Name) and value is fr._UNKNOWN and id(node) not in self.shadowed:
                return self._from_assignment(node, depth)
            if isinstance(node, ast.Subscript) and value is fr._UNKNOWN:
                base = self.infer(node.value, depth + 1)
                return Known(base.device, label) if base and not base.scalar else None
            return None
        if isinstance(node, ast.Call):
            return self._call(node, label, depth)
        if isinstance(node, (ast.BinOp, ast.Compare)):
            left, right = ((node.left, node.right) if isinstance(node, ast.BinOp) else (node.left, node.comparators[0]))
            a, b = self.infer(left, depth + 1), self.infer(right, depth + 1)
            if a and b:
                if a.device == b.device:
                    return Known(a.device, label, a.scalar and b.scalar)
                return b if a.scalar else a if b.scalar else None
            known = a or b
            other = right if a else left
            if known and (not known.scalar or isinstance(other, ast.Constant)):
                return Known(known.device, label, known.scalar)
            return None
        if isinstance(node, ast.UnaryOp):
            return self.infer(node.operand, depth + 1)
        return None

    def _from_assignment(self, node: ast.Name, depth: int) -> Known | None:
        before = [a for a in self.assigned.get(node.id, []) if a[0] < node.lineno]
        if not before or before[-1][1] is None:
            return None
        line, value, statement = before[-1]
        found = self.infer(value, depth + 1)  # type: ignore[arg-type]
        if found is None:
            return None
        text = " ".join(ast.unparse(statement).split())
        return Known(found.device, node.id, found.scalar, f"`{text}` at {self.where}:{line}")

    def _zero_dim(self, factory: str, node: ast.Call) -> bool:
        """Whether torch.FACTORY(...) at NODE surely makes a 0-dim tensor: torch.scalar_tensor, torch.tensor of
        a number (a literal, or a name holding one now), a shape of (). Anything unknown is not 0-dim: a CPU
        scalar is allowed where other tensors are not, so guessing 0-dim would hide a real mismatch."""
        first = node.args[0] if node.args else None
        if factory == "scalar_tensor":
            return True
        if factory == "tensor":
            return first is not None and self._number(first)
        if first is None:
            return not node.keywords or all(k.arg != "size" for k in node.keywords)
        return isinstance(first, ast.Tuple) and not first.elts

    def _number(self, node: ast.AST) -> bool:
        """Whether NODE surely evaluates to a Python number: a literal, a name holding one now, float(...) /
        int(...) / bool(...) / len(...) / round(...), `.item()`, or arithmetic of those."""
        if isinstance(node, ast.Constant):
            return isinstance(node.value, (bool, int, float, complex))
        if isinstance(node, ast.UnaryOp):
            return self._number(node.operand)
        if isinstance(node, ast.BinOp):
            return self._number(node.left) and self._number(node.right)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("float", "int", "bool", "complex", "len", "round"):
                return self._object(func) in (float, int, bool, complex, len, round)
            return isinstance(func, ast.Attribute) and func.attr == "item" and not node.args
        if isinstance(node, (ast.Name, ast.Attribute)):
            return isinstance(self._object(node), (bool, int, float, complex))
        return False

    def _device_of(self, node: ast.AST, depth: int) -> str | None:
        """A device argument: 'cuda:1', a torch.device, `x.device`, another tensor."""
        if isinstance(node, ast.Attribute) and node.attr == "device":
            known = self.infer(node.value, depth + 1)
            return known.device if known else None
        value = node.value if isinstance(node, ast.Constant) else self._object(node)
        if isinstance(value, torch.Tensor):
            return str(value.device)
        if not isinstance(value, (str, torch.device)):
            known = self.infer(node, depth + 1)
            return known.device if known else None
        return _name(value)

    def _call(self, node: ast.Call, label: str, depth: int) -> Known | None:
        callee = self._object(node.func, identity=True)
        if isinstance(callee, torch.nn.Module):
            root = src.root_name(node.func)
            if root is None or not self._bound(root.id, node.lineno):
                return None  # moved in place (`model.to(dev)`) before this call
            if callee is self.model or _contains(callee, self.model):  # the model, or a wrapper (DDP, compile)
                return Known(self.output_device, label) if self.output_device else None
            if _contains(self.model, callee):
                devices = {str(t.device) for t in [*callee.parameters(), *callee.buffers()]}
                return Known(devices.pop(), label) if len(devices) == 1 else None
            return self._first(node.args, depth)
        if callee is not fr._UNKNOWN and _is_torch(callee):
            name = getattr(callee, "__name__", "")
            if name in fr._FACTORIES and name not in ("as_tensor", "asarray", "from_numpy"):
                spec = next((k.value for k in node.keywords if k.arg == "device"), None)
                if spec is None and id(node) in self.in_with:
                    return None
                device = self._device_of(spec, depth) if spec is not None else _name(torch.get_default_device())
                return Known(device, label, self._zero_dim(name, node) and device == "cpu") if device else None
            return self._first(node.args, depth)
        if isinstance(node.func, ast.Attribute) and callee is fr._UNKNOWN:
            method = node.func.attr
            receiver = self.infer(node.func.value, depth + 1)
            if receiver is None:
                return None
            if method == "to":
                spec = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "device"), None)
                if spec is None or isinstance(self._object(spec), torch.dtype):
                    return Known(receiver.device, label, receiver.scalar)
                device = self._device_of(spec, depth)
                return Known(device, label, receiver.scalar and device == "cpu") if device else None
            if method == "cpu":
                return Known("cpu", label, receiver.scalar)
            if method in _KEEPS_DEVICE and not (receiver.scalar and method in _RESHAPES):
                return Known(receiver.device, label, receiver.scalar)
        return None

    def _first(self, args: list[ast.expr], depth: int) -> Known | None:
        for arg in args:
            for item in arg.elts if isinstance(arg, (ast.List, ast.Tuple)) else [arg]:
                found = self.infer(item, depth + 1)
                if found and not found.scalar:
                    return Known(found.device, found.label)
        return None

    # ------------------------------------------------------------------ judging

    def judge(self) -> None:
        for node in self.nodes:
            if isinstance(node, ast.BinOp) and isinstance(node.op, _OPERATORS):
                self._mixed(node, [self.infer(node.left), self.infer(node.right)], stacks=False)
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], _COMPARISONS):
                self._mixed(node, [self.infer(node.left), self.infer(node.comparators[0])], stacks=False)
            elif isinstance(node, ast.Call):
                callee = self._object(node.func, identity=True)
                owner = self._object(node.func.value, identity=True) if isinstance(node.func, ast.Attribute) else None
                if isinstance(owner, torch.optim.Optimizer) and node.func.attr == "step":  # type: ignore[attr-defined]
                    self.reading.optimizers.append((owner, self._site(node)))
                elif isinstance(callee, torch.nn.Module):
                    self._module_call(node, callee)
                elif _is_torch(callee) and getattr(callee, "__name__", "") in _SAME_DEVICE:
                    items = [i for a in node.args for i in (a.elts if isinstance(a, (ast.List, ast.Tuple)) else [a])]
                    items += [k.value for k in node.keywords]
                    self._mixed(node, [self.infer(i) for i in items], stacks=callee.__name__ in _STACKS)

    def _site(self, node: ast.AST) -> str:
        text = " ".join(ast.unparse(node).split())
        function = "" if self.function == "<module>" else f" in {self.function}()"
        return f"{self.where}:{src.line_of(node)}{function}: `{text[:160]}`"

    def _expected(self, devices: set[str]) -> str:
        model = {str(t.device) for t in [*self.model.parameters(), *self.model.buffers()]}
        return next(iter(model & devices), None) or sorted(devices)[0]

    def _mixed(self, node: ast.AST, values: list[Known | None], stacks: bool) -> None:
        known = [v for v in values if v is not None]
        devices = {v.device for v in known if not v.scalar}
        refused = [v for v in known if v.scalar and stacks and devices - {"cpu"}]
        if len(devices) < 2 and not refused:
            return
        expected = self._expected(devices) if devices else "cpu"
        culprits = refused + [v for v in known if not v.scalar and v.device != expected]
        others = ", ".join(sorted({v.label for v in known if v.device == expected and not v.scalar}))
        for culprit in culprits:
            what = (" (a 0-dim CPU tensor, which elementwise ops accept on any device but this op does not)"
                    if culprit.scalar else "")
            made = f", made by {culprit.made}" if culprit.made else ""
            fix = (f"create it on {expected} (device={expected!r}, or device=<a tensor>.device)" if culprit.made and
                   "torch." in culprit.made else f"{culprit.label}.to({expected!r}) before this line "
                   f"(a batch: torchplace.to_device(batch, {expected!r}))")
            self.reading.problems.append({
                "kind": "step-device", "where": culprit.label, "severity": "error",
                "message": f"{culprit.label} is on {culprit.device}{what}{made}, while {others or 'the rest'} "
                           f"{'is' if ',' not in others else 'are'} on {expected}, in {self._site(node)}; the step "
                           f"fails there with a device mismatch. Fix: {fix}."})

    def _module_call(self, node: ast.Call, module: torch.nn.Module) -> None:
        site = self._site(node)
        if module is self.model or _contains(module, self.model):  # the model, or a wrapper (DDP, compile)
            self.reading.model_calls.append(site)
            return
        if _contains(self.model, module):
            return
        self.reading.used.setdefault(id(module), site)
        root = src.root_name(node.func)
        if id(module) in self.skip or root is None or not self._bound(root.id, node.lineno):
            return  # a companion explain() was handed, or one the function moves before this call
        args = [self.infer(a) for a in [*node.args, *(k.value for k in node.keywords)]]
        devices = {a.device for a in args if a is not None and not a.scalar}
        if len(devices) != 1:
            return
        device = devices.pop()
        label = " ".join(ast.unparse(node.func).split())
        tensors = [(f"{label}.{key}", t) for _, key, t in own_tensors(module)]
        tensors += [(path, t) for path, t in plain_attributes(module, label)]
        away = [(path, t) for path, t in tensors if str(t.device) != device and t.dim() > 0]
        if away and len({str(t.device) for _, t in tensors}) == 1:  # a module spread over devices is deliberate
            shown = ", ".join(f"{path} on {t.device}" for path, t in away[:4])
            self.reading.problems.append({
                "kind": "step-device", "where": label, "severity": "error",
                "message": f"{label} ({type(module).__name__}) keeps {shown}, but is called with tensors on "
                           f"{device} in {site}; it is not part of the model, so model.to() does not move it. "
                           f"Fix: {label}.to({device!r}) once, after building it."})


def _name(value: str | torch.device) -> str | None:
    """'cuda:1' for a device spec; None for one without an index ('cuda': whichever GPU is current)."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        return None
    return str(device) if device.index is not None or device.type in ("cpu", "meta") else None


def _contains(root: torch.nn.Module, module: torch.nn.Module) -> bool:
    return any(m is module for m in root.modules())


def _is_torch(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return obj is not fr._UNKNOWN and callable(obj) and module.split(".", 1)[0] == "torch"

