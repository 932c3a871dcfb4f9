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
from . import compiled, culprits, meta
from . import frames as fr
from ._fixes import Fix, fix_lines, more_line
from .culprits import Operand, operands, reported
from .layout import model_devices, module_groups, own_tensors, plain_attributes

__all__ = ["MismatchReport", "diagnose", "is_device_mismatch", "to_error"]

_MISMATCH = re.compile(
    r"Expected all tensors to be on the same device|is not on the expected device|found at least two devices"
    r"|different from other tensors on|Expected object of device type|should be either on cpu or on the same "
    r"device|(?:must|to) be on the same device|are on different devices|is on device \S+ but .* on device"
    r"|tensors are not at the same device|expected to be in the same device|device type for generator but found"
    r"|must have its parameters and buffers on device|should be a \w+ CPU \w+ tensor, but got \w+ (?!cpu )\S+"
    r"|FakeTensor Device Propagation for \S+, found two different devices"  # fake tensors' words before torch 2.12
    r"|FakeTensor is wrapped to wrong device")  # fake tensors' words for an in-place op's output on another device
_CONV_TYPES = re.compile(r"Input type \((torch\.[\w.]+)\) and weight type \((torch\.[\w.]+)\) should be the same")
_EXPECTED = re.compile(r"not on the expected device (\S+?)!|different from other tensors on (\S+?)[ ,)]"
                       r"|found (?:at least two|two different) devices,? (\S+?)(?: and|,) "
                       r"|found input tensor at (\S+) and|but got \(self\) (\S+?),|on device (\S+) \(device_ids\[0\]\)"
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
    match = _EXPECTED.search(text)  # the device torch's message says the op expected ("not on the expected device")
    said = next((g for g in match.groups() if g), None) if match else None
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
    unregistered: str | None = None  # "model.heads" when the module was found in a plain attribute, list or dict
    optimizer_state: list[str] = field(default_factory=list)  # "model.fc.weight['exp_avg'] on cpu (parameter on ...)"
    meta: tuple[str, Fix | None] | None = None  # (why, fix) when meta tensors (no data) meet real ones
    root: str = "model"  # the model as the user's code holds it (`t_net`, `predictor.net`): module paths start there

    @property
    def culprits(self) -> list[Operand]:
        return [t for t in self.tensors if not t.scalar and t.device != self.expected_device]

    def message(self) -> str:
        """What and where on the first line, the fix on the next (alternatives after it), then the details."""
        expression = self.site.expression if self.site else None
        what = expression or self.op or "an operation"
        if expression and self.op and self.op not in expression:
            what += f" (op {self.op})"
        lines = [f"Device mismatch in {what}" + (f" at {self.site}" if self.site else "")
                 + (f", inside module {self.module} ({self.module_type})" if self.module else "")
                 + (f", reached from {self.user_site}" if self.user_site and self.user_site != self.site else "")
                 + f": {self._summary()}."]
        fixes = self.fixes()
        lines += fix_lines(fixes)
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
            lines.append(f"Note: the model itself spans devices ({'; '.join(self.model_split)}), a bug unless the "
                         "split is deliberate.")
        if self.meta:
            lines.append(f"Why: {self.meta[0]}")
        lines.append(f"PyTorch said: {self.torch_message.strip().splitlines()[0] if self.torch_message else '?'}")
        lines += more_line(fixes)
        return "\n".join(lines)

    def brief(self) -> str:
        """One line for a table cell: the culprits and the first fix."""
        bad = self.culprits
        if not bad or not self.expected_device:
            return f"{self._summary()}. Fix: {self.fixes()[0].fix}."
        names = "; ".join(f"{', '.join(t.label for t in bad if t.device == device)} on {device}"
                          for device in dict.fromkeys(t.device for t in bad))
        return f"{names} (the rest on {self.expected_device}). Fix: {self.fixes()[0].fix}." if len(names) < 40 else \
            f"{names}. Fix: {self.fixes()[0].fix}."

    def _summary(self) -> str:
        if self.optimizer_state and not self.culprits:
            return "the optimizer's state is on another device than its parameters"
        bad = self.culprits
        if not bad or not self.expected_device:
            devices = sorted({t.device for t in self.tensors if not t.scalar})
            return "tensors on " + " and ".join(devices) if len(devices) > 1 else "tensors on different devices"
        names = ", ".join(f"{t.label} on {t.device}" for t in bad)
        return f"{names}, while the rest are on {self.expected_device}"

    def fixes(self) -> list[Fix]:
        """One fix per cause, the likeliest first; the tensor lines above say why each is needed."""
        target = self.expected_device or "one device"
        out: list[Fix] = [self.meta[1]] if self.meta and self.meta[1] else []
        if self.optimizer_state:
            out.append(Fix("move the model first, then build the optimizer (Module.to does not move optimizer "
                           "state)", "or load the optimizer's state_dict after the move: it follows each parameter",
                           "optimizer-state"))
        if self.unregistered:  # the path after it says what holds the module: a list ([0]), a dict (['key']) or not
            after = (self.module or "")[len(self.unregistered):]
            kind = "dict" if after.startswith("['") else "list" if after.startswith("[") else None
            out.append(Fix(f"make {self.unregistered} nn.{'ModuleDict' if kind == 'dict' else 'ModuleList'}(...): a "
                           f"plain Python {kind} hides its modules from {self.root}.to()") if kind else
                       Fix(f"register {self.unregistered} as a submodule (a plain attribute set past nn.Module's "
                           f"__setattr__, or add_module): {self.root}.to() does not move it"))
        groups: dict[tuple[str, str], list[Operand]] = {}
        for t in self.culprits:
            key = _cause(t, bool(self.unregistered), bool(self.meta), self.root)
            if key is not None:
                groups.setdefault(key, []).append(t)
        out += [_fix_for(kind, owner, ts, target, self.root) for (kind, owner), ts in groups.items()]
        if not out:
            out.append(Fix("put every tensor this op uses on one device",
                           "torchplace.explain(model, *inputs) shows where each parameter, buffer and input lives"))
        return list({f.fix: f for f in out}.values())


def _cause(t: Operand, unregistered: bool, meta: bool, root: str) -> tuple[str, str] | None:
    """Why this culprit is where it is, as (kind of fix, whose): culprits with one cause share one fix."""
    if t.kind == "generator":
        return ("generator", "")
    if t.factory and t.made:
        return ("factory", t.factory.split(" ")[0])
    if t.refused_scalar:
        return ("scalar", "")
    if t.kind == "attribute":
        return ("attribute", "")
    if t.kind in ("parameter", "buffer") and (unregistered or (meta and t.device == "meta")):
        return None  # said above: a module in a plain container, or a meta weight (loaded, not moved)
    if t.kind in ("parameter", "buffer") and t.origin and not t.origin.startswith((f"{root}.", f"{root}[")):
        return ("outside", t.origin.rpartition(".")[0])
    if t.kind in ("parameter", "buffer"):
        return ("behind", "")
    if t.kind == "inline":
        return ("inline", "")
    if t.kind == "local" and t.origin and ".forward" in t.origin:
        return ("forward", "")
    return ("move", "")


def _fix_for(kind: str, owner: str, tensors: list[Operand], target: str, root: str) -> Fix:
    names = ", ".join(t.origin or t.label for t in tensors) if kind != "factory" else ""
    labels = ", ".join(t.label for t in tensors)
    if kind == "generator":
        return Fix(f"make {labels} on the tensors' device: torch.Generator(device={target!r})")
    if kind == "factory":
        made = [t.made.rpartition(" at ") for t in tensors if t.made]
        sites = ", ".join(f"{code.strip('`').split('=')[0].strip() if '=' in code else t.label} at {site}"
                          for (code, _, site), t in zip(made, tensors))
        return Fix(f"add .to(x.device) to the {owner} that makes {sites}: it takes no device" if owner.startswith(
            "torch.from_numpy") else f"pass device= to the {owner} that makes {sites} (e.g. device=x.device)",
                   anchor="made-without-a-device")
    if kind == "scalar":
        return Fix(f"make {names} on {target}: torch.stack and torch.cat do not move 0-dim CPU tensors",
                   "e.g. torch.tensor(0.0, device=other.device) or other.new_zeros(())", "made-without-a-device")
    if kind == "attribute":
        return Fix(f"register {names} as buffer(s): self.register_buffer(name, tensor, persistent=False)",
                   anchor="plain-tensor-attributes")
    if kind == "outside":
        return Fix(f"call {owner}.to({target!r}) too: {owner} is not part of the model, so {root}.to() does not "
                   f"move its {tensors[0].kind}s", f"make {owner} a submodule of the model", "outside-the-model")
    if kind == "behind":
        owners = ", ".join(dict.fromkeys((t.origin or "").rpartition(".")[0] or "the model" for t in tensors))
        return Fix(f"call {root}.to({target!r}) after the whole model is built: {owners} was added or replaced after "
                   "the move", anchor="left-behind")
    if kind == "inline":
        return Fix(f"make {labels} on the other operands' device (device=x.device, here {target})",
                   "make it once, as a registered buffer", "made-without-a-device")
    if kind == "forward":
        return Fix(f"make {labels} on the input's device: torch.tensor(..., device=x.device)",
                   "register it as a buffer", "made-without-a-device")
    return Fix(f"move {names} to {target} before the call: torchplace.to_device(batch, {target!r})")


def diagnose(exc: BaseException, model: torch.nn.Module | None = None,
             outer: FrameType | None = None) -> MismatchReport:
    """Read the culprit of a device-mismatch error out of its traceback.

    `outer`: when the error is caught inside the program (at a module boundary), the live
    frames from `outer` up, which the traceback does not reach, are read too.
    """
    method = _METHOD.search(str(exc))
    report = MismatchReport(torch_message=str(exc), op=method.group(1) if method else None)
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
    names = culprits.ModuleNames(model, chain, [e[0] for e in entries[: op_idx + 1]])
    root, root_label = names.root, names.label
    report.root = root_label
    if chain:
        report.module = names.path(chain[-1]) or culprits.module_path(chain, root, root_label)
        report.module_type = type(chain[-1]).__name__
        report.unregistered = names.holders.get(id(chain[-1]))
    origins = culprits.origins_of(chain, user_frames, names)
    traced = compiled.user_frames_in_message(report.torch_message)  # torch.compile traced the forward
    call = (op_frame, report.site.expression)  # where the compiled model was called: its arguments count too
    if traced:
        report.site, report.user_site, report.calls = traced[-1], report.site, report.calls + traced[:-1]
        found = compiled.owner(root, traced[-1])
        if found is not None:
            report.module = f"{root_label}.{found[0]}" if found[0] else root_label
            report.module_type = type(found[1]).__name__
            op_frame, user = compiled.static_frame(found[1], traced[-1]), None
    report.tensors = operands(op_frame, report.site.expression, user, origins, user_frames,
                              {id(e[0]): (e[1], e[2]) for e in entries})
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
        culprits.trace_assignment(t, op_frame, list(reversed(user_frames)))
    stale = {t.device for t in report.culprits if t.kind in ("local", "value") and t.made and not t.factory}
    if root is not None:  # a culprit computed in the failing code likely comes from a module's cache: shown first
        cached = [culprits.operand_info(p, x, origins) for p, x in plain_attributes(root, root_label)]
        report.tensors[:0] = [t for t in cached if t.device in stale][:2]
    report.tensors += [Operand(f"self.{k}", str(v), "device", (), "inline", f"{names.path(m)}.{k}: a device kept as an "
                               "attribute, not updated by .to()") for m in chain for k, v in vars(m).items()
                       if isinstance(v, torch.device) and str(v) in {t.device for t in report.culprits}]
    stepping = next((e[0].f_locals["self"] for e in entries  # an optimizer's state elsewhere than its parameter
                     if isinstance(e[0].f_locals.get("self"), torch.optim.Optimizer)), None)
    report.optimizer_state = culprits.misplaced_state(stepping, root, root_label) if stepping is not None else []
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
    # torch's machinery below the innermost code not torch's own (a custom autograd Function's backward, a forward
    # torch.compile traced, run by torch): the op it called
    own = max((i for i in range(first, len(entries)) if not fr.is_library(entries[i][0].f_code.co_filename)),
              default=first)
    limit = next((i for i in range(own, len(entries)) if fr.is_internal(entries[i][0].f_code.co_filename)),
                 len(entries))
    for i in range(limit - 1, -1, -1):
        if not fr.is_plumbing(entries[i][0]):
            return i
    return max(limit - 1, 0)
