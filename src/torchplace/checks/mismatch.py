"""Turn PyTorch's "Expected all tensors to be on the same device" into a report that names the
culprit: the op and its expression, each tensor with device, dtype, shape and where it came
from (parameter, buffer, plain attribute, batch key, local), the module path, file and line.

Nothing runs until an error has happened: the report is read from the exception's traceback
(its frames still hold their locals), so watching costs nothing on a step that succeeds.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Iterator

import torch

from ..errors import DeviceMismatchError
from . import frames as fr
from .layout import iter_tensors, model_devices, module_groups, own_tensors, plain_attributes

_MISMATCH = re.compile(
    r"Expected all tensors to be on the same device|is not on the expected device|found at least two devices"
    r"|different from other tensors on|Expected object of device type|should be either on cpu or on the same "
    r"device|(?:must|to) be on the same device|are on different devices|is on device \S+ but .* on device"
    r"|tensors are not at the same device|expected to be in the same device|device type for generator but found"
    r"|must have its parameters and buffers on device")
_CONV_TYPES = re.compile(r"Input type \((torch\.[\w.]+)\) and weight type \((torch\.[\w.]+)\) should be the same")
_EXPECTED = re.compile(r"not on the expected device (\S+?)!|different from other tensors on (\S+?)[ ,)]"
                       r"|found at least two devices, (\S+?) and |found input tensor at (\S+) and"
                       r"|but got \(self\) (\S+?),|on device (\S+) \(device_ids\[0\]\)"
                       r"|Expected a '(\w+)' device type for generator")
_METHOD = re.compile(r"in method (?:wrapper_(?:[A-Za-z0-9]+_)?_?)?(\w+)")


def is_device_mismatch(exc: BaseException) -> bool:
    """True for PyTorch's errors about tensors on different devices (not for ours)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, DeviceMismatchError):
        return False
    text = str(exc)
    if _MISMATCH.search(text):
        return True
    conv = _CONV_TYPES.search(text)
    return bool(conv) and (".cuda." in conv.group(1)) != (".cuda." in conv.group(2))


@dataclass
class TensorInfo:
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
        text = f"{self.label}: {self.device} {self.dtype} {shape}"
        if self.source != self.label:
            text += f" ({self.source})"
        if self.made:
            text += f", made by {self.made}"
            if self.factory:
                text += f": {self.factory}"
        if self.refused_scalar:
            text += " - a 0-dim CPU tensor, which elementwise ops accept on any device but this op does not"
        return text + (" - a CPU scalar, allowed" if self.scalar else "")


@dataclass
class MismatchReport:
    """Everything known about one device mismatch; `message()` is the error's text."""

    torch_message: str
    op: str | None = None
    site: fr.Site | None = None
    user_site: fr.Site | None = None
    module: str | None = None
    module_type: str | None = None
    tensors: list[TensorInfo] = field(default_factory=list)
    expected_device: str | None = None
    model_split: list[str] = field(default_factory=list)  # "model.head on meta", when the model spans devices
    calls: list[fr.Site] = field(default_factory=list)  # the user's frames, outermost first
    unregistered: str | None = None  # "model.heads" when the module was found in a plain list or dict
    optimizer_state: list[str] = field(default_factory=list)  # "model.fc.weight['exp_avg'] on cpu (parameter on ...)"

    @property
    def culprits(self) -> list[TensorInfo]:
        return [t for t in self.tensors if not t.scalar and t.device != self.expected_device]

    def message(self) -> str:
        expression = self.site.expression if self.site else None
        what = expression or self.op or "an operation"
        if expression and self.op and self.op not in expression:
            what += f" (op {self.op})"
        lines = [f"Device mismatch in {what}" + (f" at {self.site}" if self.site else "")
                 + (f", inside module {self.module} ({self.module_type})" if self.module else "")
                 + (f", reached from {self.user_site}" if self.user_site and self.user_site != self.site else "")
                 + f": {self._summary()}."]
        lines += [f"  {t.describe()}" for t in self.tensors]
        if self.optimizer_state:
            lines.append("  optimizer state on another device than its parameter: " + "; ".join(self.optimizer_state[:4])
                         + (f"; and {len(self.optimizer_state) - 4} more" if len(self.optimizer_state) > 4 else ""))
        shown = {self.site, self.user_site}
        chain = [c for c in self.calls if c not in shown]
        if chain:
            lines.append("Called from: " + " > ".join(str(c) for c in chain[-4:]))
        if self.model_split:
            lines.append(f"Note: the model itself spans devices ({'; '.join(self.model_split)}); unless that split "
                         "is deliberate, it is the bug: call model.to(device) once the whole model is built.")
        lines.append(f"PyTorch said: {self.torch_message.strip().splitlines()[0] if self.torch_message else '?'}")
        lines.append("Fix: " + self._fix())
        return "\n".join(lines)

    def _summary(self) -> str:
        if self.optimizer_state and not self.culprits:
            return "the optimizer's state is on another device than its parameters"
        bad = self.culprits
        if not bad or not self.expected_device:
            devices = sorted({t.device for t in self.tensors if not t.scalar})
            return "tensors on " + " and ".join(devices) if len(devices) > 1 else "tensors on different devices"
        names = ", ".join(f"{t.label} on {t.device}" for t in bad)
        return f"{names}, while the rest are on {self.expected_device}"

    def _fix(self) -> str:
        bad = self.culprits
        target = self.expected_device or "one device"
        tips: list[str] = []
        if self.optimizer_state:
            tips.append("the optimizer was built or stepped before model.to(), and Module.to moves parameters, not "
                        "the optimizer's state: move the model first and build the optimizer after it, or load the "
                        "optimizer's state_dict after the move (it follows each parameter's device)")
        if self.unregistered:
            kind = "dict" if self.unregistered.endswith("]") and "['" in self.unregistered else "list"
            container = self.unregistered.rsplit("[", 1)[0]
            tips.append(f"{container} is a plain Python {kind}, so model.to() and model.parameters() do not see the "
                        f"modules in it: make it nn.{'ModuleDict' if kind == 'dict' else 'ModuleList'}(...)")
        for t in bad:
            if t.kind == "generator":
                tips.append(f"{t.label} is a generator on {t.device}: make it on the tensors' device, "
                            f"torch.Generator(device={target!r})")
            elif t.factory and t.made:
                tips.append(f"{t.made} makes it without a device: pass device= (e.g. device=x.device, the input's)")
            elif t.refused_scalar:
                tips.append(f"make {t.origin or t.label} on {target} (torch.stack and torch.cat do not move 0-dim CPU "
                            "tensors): e.g. torch.tensor(0.0, device=other.device) or other.new_zeros(())")
            elif t.kind == "attribute":
                tips.append(f"{t.origin} is a plain tensor attribute, which model.to() does not move: "
                            "register it with self.register_buffer(name, tensor, persistent=False)")
            elif t.kind in ("parameter", "buffer") and self.unregistered:
                continue
            elif t.kind in ("parameter", "buffer") and t.origin and not t.origin.startswith("model"):
                owner = t.origin.rpartition(".")[0]
                tips.append(f"{owner} is not part of the model, so model.to() does not move its {t.kind}s: call "
                            f"{owner}.to({target!r}) too (or make it a submodule of the model)")
            elif t.kind in ("parameter", "buffer"):
                owner = (t.origin or "").rpartition(".")[0] or "the model"
                tips.append(f"{owner}'s parameters/buffers are on {t.device}: call model.to({target!r}) after the "
                            "whole model is built (a submodule added or replaced after .to() stays behind)")
            elif t.kind == "local" and t.origin and ".forward" in t.origin:
                tips.append(f"{t.label} is made inside forward() on {t.device}: create it on the input's device "
                            "(torch.tensor(..., device=x.device)) or register it as a buffer")
            else:
                tips.append(f"move {t.origin or t.label} to {target} before the call "
                            f"(torchplace.to_device(batch, {target!r}))")
        if not tips:
            tips.append("put every tensor this op uses on one device; torchplace.explain(model, *inputs) shows "
                        "where each parameter, buffer and input lives")
        return "; ".join(dict.fromkeys(tips)) + "."


def diagnose(exc: BaseException, model: torch.nn.Module | None = None,
             outer: FrameType | None = None) -> MismatchReport:
    """Read the culprit of a device-mismatch error out of its traceback.

    `outer`: when the error is caught inside the program (at a module boundary), the live
    frames from `outer` up, which the traceback does not reach, are read too.
    """
    report = MismatchReport(torch_message=str(exc), op=_op_from_message(str(exc)))
    entries = fr.stack_entries(outer) + fr.traceback_entries(exc.__traceback__)
    if not entries:
        return report
    op_idx = _op_index(entries)
    op_frame, op_line, op_lasti = entries[op_idx]
    report.site = fr.site_of(op_frame, op_line, op_lasti)
    user = next((e for e in reversed(entries[: op_idx + 1]) if not fr.is_library(e[0].f_code.co_filename)), None)
    if user is not None:
        report.user_site = fr.site_of(*user)
    chain = list(fr.called_modules(entries[: op_idx + 1]))
    user_entries = [e for e in entries[: op_idx + 1] if fr.is_user(e[0].f_code.co_filename)]
    user_frames = [e[0] for e in user_entries]
    report.calls = [fr.site_of(*e) for e in user_entries]
    root, root_label = _root(model, chain)
    names = _ModuleNames(root, root_label, user_frames)
    if chain:
        report.module = names.path(chain[-1]) or module_path(chain, root, root_label)
        report.module_type = type(chain[-1]).__name__
        if "[" in (report.module or "") and (root is None or not _contains(root, chain[-1])):
            report.unregistered = report.module
    origins = _origins(root, root_label, chain, user_frames, names)
    report.tensors = _tensors(op_frame, report.site.expression, user, origins)
    report.expected_device = _expected_device(report.tensors, root, report.torch_message)
    if not report.culprits:  # only 0-dim CPU tensors differ: this op refuses them (torch.stack, torch.cat)
        for t in report.tensors:
            if t.scalar and report.expected_device and t.device != report.expected_device:
                t.scalar, t.refused_scalar = False, True
    for t in report.culprits:
        _trace(t, op_frame, user)
    report.optimizer_state = _optimizer_state(entries, root, root_label)
    if root is not None and len(model_devices(root)) > 1:
        report.model_split = [f"{g.module} on {g.device}" for g in module_groups(root, root_label)][:6]
    if report.op is None:
        report.op = _op_from_expression(report.site.expression)
    return report


def to_error(exc: BaseException, model: torch.nn.Module | None = None,
             outer: FrameType | None = None) -> DeviceMismatchError:
    """A DeviceMismatchError carrying the report (as `.report`), to raise `from exc`."""
    try:
        report = diagnose(exc, model, outer)
    except Exception as inner:  # a diagnosis must never hide the original error
        report = MismatchReport(torch_message=f"{exc} (torchplace could not read more: {inner!r})")
    err = DeviceMismatchError(report.message())
    err.report = report  # type: ignore[attr-defined]
    return err


def module_path(chain: list[torch.nn.Module], root: torch.nn.Module | None, root_label: str) -> str:
    """`model.encoder.layers.3.attn`: the innermost called module, named from the root."""
    target = chain[-1]
    if root is not None:
        for name, module in root.named_modules(remove_duplicate=False):
            if module is target:
                return f"{root_label}.{name}" if name else root_label
    parts = [root_label if chain[0] is root else type(chain[0]).__name__]
    for parent, child in zip(chain, chain[1:]):
        name = next((n for n, m in parent.named_modules(remove_duplicate=False) if m is child and n), None)
        parts.append(name or type(child).__name__)
    return ".".join(parts)


def _op_index(entries: list[tuple[FrameType, int, int]]) -> int:
    """The frame that called the failing op: the last one above torch's op machinery."""
    limit = next((i for i, e in enumerate(entries) if fr.is_internal(e[0].f_code.co_filename)), len(entries))
    for i in range(limit - 1, -1, -1):
        if not fr.is_plumbing(entries[i][0]):
            return i
    return max(limit - 1, 0)


def _root(model: torch.nn.Module | None, chain: list[torch.nn.Module]) -> tuple[torch.nn.Module | None, str]:
    """The module paths' root: the given model ("model"), else the outermost running module (its class)."""
    if model is not None:
        return model, "model"
    if chain:
        return chain[0], type(chain[0]).__name__
    return None, "model"


class _ModuleNames:
    """Names modules the way the user wrote them: `model.encoder.layers.0`, `model.heads[1]` (a module in a
    plain list or dict), `criterion` (a local of the user's code). Runs only after an error."""

    def __init__(self, root: torch.nn.Module | None, root_label: str, user_frames: list[FrameType]) -> None:
        self.root, self.root_label, self.user_frames = root, root_label, user_frames

    def path(self, target: torch.nn.Module) -> str | None:
        if self.root is not None:
            found = _find_module(self.root, self.root_label, target)
            if found:
                return found
        for frame in reversed(self.user_frames):  # innermost first
            for name, value in frame.f_locals.items():
                if name == "self" and value is not self.root:
                    continue
                if isinstance(value, torch.nn.Module) or value is target:
                    label = self.root_label if value is self.root else name
                    found = _find_module(value, label, target) if isinstance(value, torch.nn.Module) else None
                    if found:
                        return found
        return None


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def _find_module(root: torch.nn.Module, label: str, target: torch.nn.Module) -> str | None:
    """The path of `target` under `root`, through registered submodules or plain lists, tuples and dicts."""
    for name, module in root.named_modules(remove_duplicate=False):
        prefix = f"{label}.{name}" if name else label
        if module is target:
            return prefix
    for name, module in root.named_modules():
        prefix = f"{label}.{name}" if name else label
        for key, value in vars(module).items():
            if key in _MODULE_INTERNALS or not isinstance(value, (list, tuple, dict)):
                continue
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for index, item in list(items)[:256]:
                if isinstance(item, torch.nn.Module):
                    for sub, m in item.named_modules(remove_duplicate=False):
                        if m is target:
                            return f"{prefix}.{key}[{index!r}]" + (f".{sub}" if sub else "")
    return None


def _origins(root: torch.nn.Module | None, root_label: str, chain: list[torch.nn.Module],
             user_frames: list[FrameType], names: _ModuleNames | None = None) -> dict[int, tuple[str, str]]:
    """id(tensor) -> (kind, where it came from); the model's own tensors first, then the batch."""
    out: dict[int, tuple[str, str]] = {}
    modules = [(root_label, root)] if root is not None else []
    modules += [((names.path(m) if names else None) or type(m).__name__, m) for m in chain
                if root is None or not _contains(root, m)]
    for label, module in modules:
        for name, sub in module.named_modules():
            prefix = f"{label}.{name}" if name else label
            for kind, key, tensor in own_tensors(sub):
                out.setdefault(id(tensor), (kind, f"{prefix}.{key}"))
        for path, tensor in plain_attributes(module, label):
            out.setdefault(id(tensor), ("attribute", path))
    # batch keys first (`batch['x']` says more than `x`), each from the innermost frame that holds it
    for want_container in (True, False):
        for frame in reversed(user_frames):
            where = _where(frame)
            for name, value in frame.f_locals.items():
                if name == "self" or isinstance(value, torch.Tensor) == want_container:
                    continue
                for path, tensor in _flatten(value, name):
                    out.setdefault(id(tensor), ("batch" if want_container else "local", f"{path} {where}"))
    return out


def _trace(info: TensorInfo, op_frame: FrameType, user: tuple[FrameType, int, int] | None) -> None:
    """Where a local culprit was assigned (`h0 = torch.zeros(...)` at file:line), and whether that is a
    torch factory call without a device. Reads the function's source; runs only after an error."""
    candidates: list[tuple[str, FrameType]] = []
    if info.origin and " at " in info.origin and user is not None:
        candidates.append((info.origin.split(" at ", 1)[0], user[0]))
    candidates.append((info.label, op_frame))
    for name, frame in candidates:
        if not name.isidentifier() or fr.is_library(frame.f_code.co_filename):
            continue
        found = fr.assignment_of(name, frame)
        if found is not None:
            line, text, factory = found
            info.made = f"`{text}` at {fr.short_path(frame.f_code.co_filename)}:{line}"
            info.factory = factory
            return


def _optimizer_state(entries: list[tuple[FrameType, int, int]], root: torch.nn.Module | None,
                     root_label: str) -> list[str]:
    """State tensors of an optimizer that is stepping, on another device than their parameter."""
    optimizer = next((e[0].f_locals.get("self") for e in entries
                      if isinstance(e[0].f_locals.get("self"), torch.optim.Optimizer)), None)
    if optimizer is None:
        return []
    return misplaced_state(optimizer, root, root_label)


def misplaced_state(optimizer: torch.optim.Optimizer, root: torch.nn.Module | None,
                    root_label: str = "model") -> list[str]:
    """`model.fc.weight['exp_avg'] on cpu (parameter on cuda:0)` for each state tensor elsewhere than its
    parameter (0-dim CPU counters such as Adam's 'step' are where torch keeps them)."""
    names = {id(p): f"{root_label}.{n}" for n, p in root.named_parameters(remove_duplicate=False)} if root else {}
    out = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor) or value.device == param.device:
                    continue
                if value.device.type == "cpu" and value.dim() == 0:
                    continue
                out.append(f"{names.get(id(param), 'a parameter')}[{key!r}] on {value.device} "
                           f"(parameter on {param.device})")
    return out


def _where(frame: FrameType) -> str:
    owner = frame.f_locals.get("self")
    name = frame.f_code.co_name
    if name == "<module>":
        return f"in {fr.short_path(frame.f_code.co_filename)}"
    return f"in {type(owner).__name__}.{name}()" if isinstance(owner, torch.nn.Module) else f"in {name}()"


def _contains(root: torch.nn.Module, module: torch.nn.Module) -> bool:
    return any(m is module for m in root.modules())


def _flatten(value: Any, path: str, depth: int = 4) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in nested containers, leaving out parameters (those are named by the model)."""
    return ((p, t) for p, t in iter_tensors(value, path, depth) if not isinstance(t, torch.nn.Parameter))


def _tensors(op_frame: FrameType, expression: str | None, user: tuple[FrameType, int, int] | None,
             origins: dict[int, tuple[str, str]]) -> list[TensorInfo]:
    found: dict[int, TensorInfo] = {}
    named = fr.named_values(expression, op_frame)
    if not named:  # no expression to read: every tensor the frame holds
        named = [(k, v) for k, v in op_frame.f_locals.items() if isinstance(v, (torch.Tensor, list, tuple))]
    for label, value in named:
        if isinstance(value, torch.Generator) and id(value) not in found:
            found[id(value)] = TensorInfo(label=label, device=str(value.device), dtype="generator", shape=(),
                                          kind="generator", origin=f"generator {label}")
            continue
        pairs = [(label, value)] if isinstance(value, torch.nn.Parameter) else _flatten(value, label, 1)
        for path, tensor in pairs:
            if id(tensor) not in found:
                found[id(tensor)] = _info(path, tensor, origins)
    if user is not None and user[0] is not op_frame:  # the user's names for the same tensors
        for label, value in fr.named_values(fr.expression_at(*user), user[0]):
            if isinstance(value, torch.Tensor) and id(value) in found:
                info = found[id(value)]
                if info.origin is None or info.kind == "local":
                    info.origin = f"{label} at {fr.short_path(user[0].f_code.co_filename)}:{user[1]}"
    return list(found.values())


def _info(label: str, tensor: torch.Tensor, origins: dict[int, tuple[str, str]]) -> TensorInfo:
    kind, origin = origins.get(id(tensor)) or origins.get(id(tensor._base), ("value", None))
    if isinstance(tensor, torch.nn.Parameter) and kind == "value":
        kind = "parameter"
    return TensorInfo(label=label, device=str(tensor.device), dtype=str(tensor.dtype).removeprefix("torch."),
                      shape=tuple(tensor.shape), kind=kind, origin=origin,
                      scalar=tensor.device.type == "cpu" and tensor.dim() == 0)


def _expected_device(tensors: list[TensorInfo], root: torch.nn.Module | None, text: str) -> str | None:
    """Where the op should have run: where most of the model is, else where PyTorch expected it."""
    present = {t.device for t in tensors if not t.scalar}
    if root is not None:
        weight: Counter[str] = Counter()
        for _, _, tensor in (item for m in root.modules() for item in own_tensors(m)):
            weight[str(tensor.device)] += tensor.numel() * tensor.element_size()
        if weight:
            device = weight.most_common(1)[0][0]
            if device in present:
                return device
    match = _EXPECTED.search(text)
    said = next((g for g in match.groups() if g), None) if match else None
    if said in present:
        return said
    counts = Counter(t.device for t in tensors if not t.scalar)
    if len(counts) < 2:
        return None
    (first, n1), (_, n2) = counts.most_common(2)
    return first if n1 > n2 else None


def _op_from_message(text: str) -> str | None:
    match = _METHOD.search(text)
    return match.group(1) if match else None


_BINOPS = {"Add": "add", "Sub": "sub", "Mult": "mul", "Div": "div", "MatMult": "matmul", "Pow": "pow"}


def _op_from_expression(expression: str | None) -> str | None:
    tree = fr.parse_expression(expression) if expression else None
    body = tree.body if isinstance(tree, ast.Expression) else None
    if isinstance(body, ast.Call):
        return ast.unparse(body.func)
    if isinstance(body, ast.BinOp):
        name = type(body.op).__name__
        return _BINOPS.get(name, name.lower())
    return None
