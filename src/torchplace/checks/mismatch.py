"""Turn PyTorch's "Expected all tensors to be on the same device" into a report that names the
culprit: the op and its expression, each tensor with device, dtype, shape and where it came
from (parameter, buffer, plain attribute, batch key, local), the module path, file and line.

Nothing runs until an error has happened: the report is read from the exception's traceback
(its frames still hold their locals), so watching costs nothing on a step that succeeds.
This module reads PyTorch's message (whether an error is a mismatch, the op, the device it expected)
and puts it together with culprits.py's names for each tensor and module into the report and its fix.
"""

from __future__ import annotations

import ast
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from types import FrameType

import torch

from ..errors import DeviceMismatchError
from . import compiled, meta
from . import frames as fr
from .culprits import (
    ModuleNames,
    Operand,
    contains,
    module_path,
    operands,
    origins_of,
    reported,
    root_of,
    stepping_optimizer_state,
    trace_assignment,
)
from .layout import model_devices, module_groups, own_tensors

__all__ = ["MismatchReport", "diagnose", "is_device_mismatch", "to_error"]

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
    return conv is not None and (".cuda." in conv.group(1)) != (".cuda." in conv.group(2))


def device_named_in(text: str) -> str | None:
    """The device PyTorch's message says the op expected ("not on the expected device cuda:0!"), if any."""
    match = _EXPECTED.search(text)
    return next((g for g in match.groups() if g), None) if match else None


def op_from_message(text: str) -> str | None:
    match = _METHOD.search(text)
    return match.group(1) if match else None


_BINOPS = {"Add": "add", "Sub": "sub", "Mult": "mul", "Div": "div", "MatMult": "matmul", "Pow": "pow"}


def op_from_expression(expression: str | None) -> str | None:
    tree = fr.parse_expression(expression) if expression else None
    body = tree.body if isinstance(tree, ast.Expression) else None
    if isinstance(body, ast.Call):
        return ast.unparse(body.func)
    if isinstance(body, ast.BinOp):
        name = type(body.op).__name__
        return _BINOPS.get(name, name.lower())
    return None


def expected_device(tensors: list[Operand], root: torch.nn.Module | None, text: str) -> str | None:
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
    said = device_named_in(text)
    if said in present:
        return said
    counts = Counter(t.device for t in tensors if not t.scalar)
    if len(counts) < 2:
        return None
    (first, n1), (_, n2) = counts.most_common(2)
    return first if n1 > n2 else None


@dataclass
class MismatchReport:
    """Everything known about one device mismatch; `message()` is the error's text."""

    torch_message: str
    op: str | None = None
    site: fr.Site | None = None
    user_site: fr.Site | None = None
    module: str | None = None
    module_type: str | None = None
    tensors: list[Operand] = field(default_factory=list)
    expected_device: str | None = None
    model_split: list[str] = field(default_factory=list)  # "model.head on meta", when the model spans devices
    calls: list[fr.Site] = field(default_factory=list)  # the user's frames, outermost first
    unregistered: str | None = None  # "model.heads" when the module was found in a plain list or dict
    optimizer_state: list[str] = field(default_factory=list)  # "model.fc.weight['exp_avg'] on cpu (parameter on ...)"
    meta: tuple[str, str] | None = None  # (why, fix) when meta tensors (no data) meet real ones

    @property
    def culprits(self) -> list[Operand]:
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
            lines.append("  optimizer state on another device than its parameter: "
                         + "; ".join(self.optimizer_state[:4])
                         + (f"; and {len(self.optimizer_state) - 4} more" if len(self.optimizer_state) > 4 else ""))
        shown = {self.site, self.user_site}
        chain = [c for c in self.calls if c not in shown]
        if chain:
            lines.append("Called from: " + " > ".join(str(c) for c in chain[-4:]))
        if self.model_split and not (self.meta and self.meta[1]):  # meta weights: loaded, not moved
            lines.append(f"Note: the model itself spans devices ({'; '.join(self.model_split)}); unless that split "
                         "is deliberate, it is the bug: call model.to(device) once the whole model is built.")
        if self.meta:
            lines.append(f"Why: {self.meta[0]}")
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
        tips: list[str] = [self.meta[1]] if self.meta and self.meta[1] else []
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
            elif t.kind in ("parameter", "buffer") and (self.unregistered or (self.meta and t.device == "meta")):
                continue  # said above: a meta weight cannot be moved, only loaded
            elif t.kind in ("parameter", "buffer") and t.origin and not t.origin.startswith("model"):
                owner = t.origin.rpartition(".")[0]
                tips.append(f"{owner} is not part of the model, so model.to() does not move its {t.kind}s: call "
                            f"{owner}.to({target!r}) too (or make it a submodule of the model)")
            elif t.kind in ("parameter", "buffer"):
                owner = (t.origin or "").rpartition(".")[0] or "the model"
                tips.append(f"{owner}'s parameters/buffers are on {t.device}: call model.to({target!r}) after the "
                            "whole model is built (a submodule added or replaced after .to() stays behind)")
            elif t.kind == "inline":
                tips.append(f"{t.label} is made on {t.device} inside the op: give it the other operands' device "
                            f"(device=x.device, here {target}), or make it once as a registered buffer")
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
    report = MismatchReport(torch_message=str(exc), op=op_from_message(str(exc)))
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
    root, root_label = root_of(model, chain)
    names = ModuleNames(root, root_label, user_frames)
    if chain:
        report.module = names.path(chain[-1]) or module_path(chain, root, root_label)
        report.module_type = type(chain[-1]).__name__
        if "[" in (report.module or "") and (root is None or not contains(root, chain[-1])):
            report.unregistered = report.module
    origins = origins_of(root, root_label, chain, user_frames, names)
    traced = compiled.user_frames_in_message(report.torch_message)  # torch.compile traced the forward
    call = (op_frame, report.site.expression)  # where the compiled model was called: its arguments count too
    if traced:
        report.site, report.user_site, report.calls = traced[-1], report.site, report.calls + traced[:-1]
        found = compiled.owner(root, traced[-1])
        if found is not None:
            report.module = f"{root_label}.{found[0]}" if found[0] else root_label
            report.module_type = type(found[1]).__name__
            op_frame, user = compiled.static_frame(found[1], traced[-1]), None
    report.tensors = operands(op_frame, report.site.expression, user, origins, user_frames)
    report.expected_device = expected_device(report.tensors, root, report.torch_message)
    if traced:  # the traced locals are not known: the call's arguments, and the devices the message names
        seen = {t.label for t in report.tensors}
        report.tensors += [t for t in operands(call[0], call[1], None, origins) if t.label not in seen]
        report.expected_device = expected_device(report.tensors, root, report.torch_message)
        report.expected_device = report.expected_device or compiled.other_device(
            report.torch_message, {t.device for t in report.tensors})
        report.torch_message = compiled.torch_said(report.torch_message)
    if not report.culprits:  # only 0-dim CPU tensors differ: this op refuses them (torch.stack, torch.cat)
        for t in report.tensors:
            if t.scalar and report.expected_device and t.device != report.expected_device:
                t.scalar, t.refused_scalar = False, True
    for t in report.culprits if not traced else ():
        trace_assignment(t, op_frame, user, list(reversed(user_frames)))
    report.optimizer_state = stepping_optimizer_state(entries, root, root_label)
    report.meta = meta.mismatch_note(report.tensors, root, root_label)
    if root is not None and len(model_devices(root)) > 1:
        report.model_split = [f"{g.module} on {g.device}" for g in module_groups(root, root_label)][:6]
    if report.op is None:
        report.op = op_from_expression(report.site.expression)
    return report


def to_error(exc: BaseException, model: torch.nn.Module | None = None,
             outer: FrameType | None = None) -> DeviceMismatchError:
    """A DeviceMismatchError carrying the report (as `.report`), to raise `from exc`."""
    return reported(DeviceMismatchError, diagnose, lambda text: MismatchReport(torch_message=text), exc, model, outer)


_OVERRIDES = os.path.join(fr.TORCH_DIR, "overrides.py")


def _op_index(entries: list[tuple[FrameType, int, int]]) -> int:
    """The frame that called the failing op: the last one above torch's op machinery."""
    first = 0  # strict(factories=True)'s TorchFunctionMode re-runs each call: the op is below the mode's frame
    for i in range(1, len(entries)):
        if fr.is_plumbing(entries[i][0]) and entries[i - 1][0].f_code.co_filename == _OVERRIDES \
                and not all(fr.is_plumbing(e[0]) for e in entries[i:]):  # raised in the mode itself: the call is the op
            first = i + 1
    limit = next((i for i in range(first, len(entries)) if fr.is_internal(entries[i][0].f_code.co_filename)),
                 len(entries))
    for i in range(limit - 1, -1, -1):
        if not fr.is_plumbing(entries[i][0]):
            return i
    return max(limit - 1, 0)
