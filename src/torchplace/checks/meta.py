"""Meta tensors used for their data: name them, say why they are on meta, and give the fix.

A tensor on the meta device has a shape and a dtype and no data. Models built under
`torch.device("meta")`, accelerate's `init_empty_weights` or a transformers model made from its
config on meta hold only such tensors until their weights are loaded; accelerate's offloading
keeps weights on meta outside the module's forward. Using one for its data fails with PyTorch's
"Cannot copy out of meta tensor; no data!" (`.to()`, `.cpu()`, `.tolist()`, `Module.to()`) or
"Tensor.item() cannot be called on meta tensors", and mixing one with real tensors with "Tensor on
device meta is not on the expected device cpu!" (a device mismatch: mismatch.py adds the note made
here). Nothing runs until such an error was raised; running a meta model on meta inputs (shape
inference) raises nothing and is never reported.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from ..errors import MetaTensorError, TorchplaceError
from ..shared.wrappers import meta_names, unwrap
from . import frames as fr
from ._fixes import Fix, fix_lines, more_line
from .culprits import ModuleNames, Operand, reported
from .layout import own_tensors

__all__ = ["MetaReport", "diagnose", "is_meta_error", "mismatch_note", "to_error"]

_NO_DATA = re.compile(r"Cannot copy out of meta tensor|cannot be called on meta tensors"
                      r"|meta tensors? (?:do|does) not have data|on meta tensors?; no data")
_SHOWN = 4
_SAME_DATA = frozenset({"detach", "clone", "contiguous", "float", "half", "bfloat16", "double", "t", "view",
                        "reshape", "flatten", "squeeze", "unsqueeze"})  # a view or copy of the same (missing) data
_READS = frozenset({"item", "tolist", "cpu", "cuda", "to", "numpy"})  # methods that read their tensor's data


def is_meta_error(exc: BaseException) -> bool:
    """True for PyTorch's errors about a meta tensor's missing data (not for ours, nor any other)."""
    return isinstance(exc, RuntimeError) and not isinstance(exc, TorchplaceError) and bool(_NO_DATA.search(str(exc)))


@dataclass
class MetaReport:
    """One meta tensor used for its data; `message()` is the error's text."""

    torch_message: str
    site: fr.Site | None = None
    library_site: fr.Site | None = None  # where a library (transformers, accelerate) under the user's line ran it
    tensors: list[Operand] = field(default_factory=list)
    owner: str | None = None  # "model (GPT2LMHeadModel)": the model whose tensors are on meta
    summary: str | None = None  # "30 of 30 parameters and buffers on meta (...)"
    offloaded: list[str] = field(default_factory=list)  # modules whose accelerate hook offloads their weights

    def message(self) -> str:
        """What and where, then the fix (its alternatives after it), then the tensors and why they are on meta."""
        what = (self.site.expression if self.site else None) or "an operation"
        where = f" at {self.site}" if self.site else ""
        if self.library_site:
            where += f", inside {self.library_site}"
        named = ", ".join(t.label for t in self.tensors[:_SHOWN]) or "a tensor"
        verb = "is" if len(self.tensors) < 2 else "are"
        lines = [f"Meta tensor used for its data in `{what}`{where}: {named} {verb} on meta (a shape and a dtype, "
                 "no data)."]
        fix = self._fix()
        lines += fix_lines([fix])
        lines += [f"  {t.describe()}" for t in self.tensors[:_SHOWN]]
        if self.owner and self.summary:
            lines.append(f"  {self.owner}: {self.summary}")
        lines.append("Why: " + self._why())
        lines.append(f"PyTorch said: {self.torch_message.strip().splitlines()[0] if self.torch_message else '?'}")
        lines += more_line([fix])
        return "\n".join(lines)

    def brief(self) -> str:
        """One line for a table cell: what is on meta and the fix."""
        named = ", ".join(t.label for t in self.tensors[:_SHOWN]) or "a tensor"
        return f"{named} on meta (no data). Fix: {self._fix().fix}."

    @property
    def _weights(self) -> list[Operand]:
        return [t for t in self.tensors if t.kind in ("parameter", "buffer")]

    @property
    def _model(self) -> str:
        return (self.owner or "model").split(" (")[0]

    def _why(self) -> str:
        if self.offloaded:
            return (f"{', '.join(self.offloaded[:_SHOWN])} offload(s) its weights with accelerate (a device_map with "
                    "'cpu' or 'disk' entries, or cpu_offload): they are on meta except while that module's forward "
                    "runs, when its hook loads them.")
        if self._weights:
            return built_on_meta(None) + "."  # how many and which: the line above
        if self.summary:
            return f"it was computed from meta tensors: {self._model}'s weights are on meta; {built_on_meta(None)}."
        return ("it was made on the meta device (device='meta', or under `with torch.device('meta')` or "
                "torch.set_default_device('meta')), or computed from meta tensors.")

    def _fix(self) -> Fix:
        if self.offloaded:
            return Fix("use the weights through the module's forward (its hook loads them for the call)",
                       "load the model without offloading (a device_map that fits, or none) to read them directly",
                       "weights-on-meta")
        if self._weights or self.summary:
            return load_fix(self._model)
        return Fix("make it on a real device (device=x.device)",
                   "for shape inference, read only .shape and .dtype: .item(), .tolist(), .cpu() and .to() need data",
                   "weights-on-meta")


def built_on_meta(summary: str | None, subject: str = "the model") -> str:
    """Why a model's weights are on meta: built there, never loaded (SUMMARY: how many, which)."""
    return (f"{subject} was built on meta (torch.device('meta'), accelerate's init_empty_weights, or a transformers "
            "model made from its config on meta) and never loaded" + (f" ({summary})" if summary else ""))


def load_fix(model: str) -> Fix:
    """Give a meta model's tensors data: load them; the ways without a checkpoint after it."""
    return Fix(f"load the weights into it: torchplace.load(path, model={model})",
               f"without a checkpoint, {model}.to_empty(device='cpu'), then reset_parameters(); with accelerate, "
               f"load_checkpoint_and_dispatch ({model}.to() cannot move a meta tensor: it has no data)",
               "weights-on-meta")


def diagnose(exc: BaseException, model: torch.nn.Module | None = None, outer: FrameType | None = None) -> MetaReport:
    """Read the meta tensors, the line and the model out of the error's traceback."""
    report = MetaReport(torch_message=str(exc))
    entries = fr.stack_entries(outer) + fr.traceback_entries(exc.__traceback__)
    inner = [i for i, e in enumerate(entries) if not fr.is_library(e[0].f_code.co_filename)]
    if not inner:
        return report
    own = [i for i in inner if not fr.is_installed(entries[i][0].f_code.co_filename)]
    site_frame, line, lasti = entries[(own or inner)[-1]]  # the user's line, not transformers' `to()` under it
    report.site = fr.site_of(site_frame, line, lasti)
    if own and own[-1] != inner[-1]:
        report.library_site = fr.site_of(*entries[inner[-1]])
    named = fr.named_values(report.site.expression, site_frame)
    label = ModuleNames(model, [], [e[0] for e in entries]).label  # the model as the user's code holds it
    roots = _roots(model, label, named, [entries[i][0] for i in reversed(inner)], [e[0] for e in entries[inner[-1]:]])
    weights = _weights(roots)
    found: dict[int, Operand] = {}
    receiver, method, base = _receiver(report.site.expression)  # `logits.argmax()` of `logits.argmax().item()`
    below = [(receiver or name, v) for e in entries[inner[-1] + 1:] for name, v in e[0].f_locals.items()
             if isinstance(v, torch.Tensor)]  # torch's own frames: Module._apply's `param`, a method's `self`
    candidates = [(label, v) for label, v in named if isinstance(v, torch.Tensor) and label in (receiver, base)]
    candidates += below
    if not any(v.is_meta for _, v in candidates) and receiver and method in _READS:  # a value torch holds only
        found[0] = Operand(label=receiver, device="meta", dtype="?", shape=(), kind="inline")
    elif not any(v.is_meta for _, v in candidates):  # not a read of one tensor: every meta tensor the line names
        candidates = [(label, v) for label, v in named if isinstance(v, torch.Tensor)] + below
    for label, tensor in candidates:
        if tensor.is_meta and id(tensor) not in found and len(found) < 16:
            found[id(tensor)] = _operand(label, tensor, weights)
    report.tensors = sorted(found.values(), key=lambda t: t.kind not in ("parameter", "buffer"))
    owner = _owner(roots, report.tensors, weights)
    if owner is not None:
        label, module = owner
        report.owner, report.summary = f"{label} ({type(module).__name__})", meta_summary(module, label)
        report.offloaded = _offloaded(module, label, report.tensors)
        if not report.tensors:  # `model.to("cpu")` with no frame left holding the tensor: the model's first
            report.tensors = [_operand(n, t, weights) for n, t in _meta_tensors(module, label)[:1]]
    return report


def to_error(exc: BaseException, model: torch.nn.Module | None = None,
             outer: FrameType | None = None) -> MetaTensorError:
    """A MetaTensorError carrying the report (as `.report`), to raise `from exc`."""
    return reported(MetaTensorError, diagnose, lambda text: MetaReport(torch_message=text), exc, model, outer)


def meta_summary(module: torch.nn.Module, label: str) -> str | None:
    """`2 of 4 parameters and buffers on meta (model.0.weight, model.0.bias)`, or None when none are."""
    names = meta_names(module)
    if not names:
        return None
    total = sum(1 for _ in module.named_parameters(remove_duplicate=False)) + \
        sum(1 for _ in module.named_buffers(remove_duplicate=False))
    shown = ", ".join(f"{label}.{n}" for n in names[:_SHOWN]) + (f", and {len(names) - _SHOWN} more"
                                                                  if len(names) > _SHOWN else "")
    return f"{len(names)} of {total} parameters and buffers on meta: {shown}"


def mismatch_note(tensors: list[Operand], root: torch.nn.Module | None, label: str) -> tuple[str, Fix | None] | None:
    """For a device mismatch between meta and real tensors: (why, fix), or None when no meta tensor takes part.
    Weights on meta are a model built on meta and never loaded; a value on meta was made there."""
    on_meta = [t for t in tensors if t.device == "meta"]
    if not on_meta or all(t.device == "meta" for t in tensors):
        return None
    names = ", ".join((t.origin if t.kind in ("parameter", "buffer") else None) or t.label for t in on_meta[:_SHOWN])
    names += " is" if len(on_meta) == 1 else " are"
    summary = meta_summary(root, label) if root is not None else None
    if any(t.kind in ("parameter", "buffer") for t in on_meta):
        return (f"{names} on meta, which holds shapes but no data: {built_on_meta(summary)}. For shape inference, "
                "every input must be on meta too.", load_fix(label))
    return (f"{names} on meta (no data: made with device='meta' or under `with torch.device('meta')`), and ops mixing "
            "meta and real tensors fail.", None)  # the mismatch report's own fix (move it to the others' device) stands


def annotate(model: torch.nn.Module, problems: list[dict[str, str]]) -> None:
    """explain(): to a problem that involves the model's meta tensors (inputs elsewhere, a model split between
    meta and a real device), add a line: they have no data, and how to load them."""
    summary = meta_summary(model, "model")
    if summary is None:
        return
    for p in problems:
        if p["kind"] in ("input-device", "model-split", "split-module"):
            p["message"] += (f"\nNote: {summary}; a meta tensor has no data, so a forward there computes only "
                             f"shapes. If it was never loaded: {load_fix('model').fix}.")


def _receiver(expression: str | None) -> tuple[str | None, str | None, str | None]:
    """(object, method, base) of a method call EXPRESSION: (`w.detach()`, `cpu`, `w`) of `w.detach().cpu()`, the
    base being the object without the data-free calls after it (detach, clone, float, ...); else Nones."""
    tree = fr.parse_expression(expression) if expression else None
    body = tree.body if isinstance(tree, ast.Expression) else None
    if not (isinstance(body, ast.Call) and isinstance(body.func, ast.Attribute)):
        return None, None, None
    base = body.func.value
    while isinstance(base, ast.Call) and isinstance(base.func, ast.Attribute) and base.func.attr in _SAME_DATA:
        base = base.func.value
    return ast.unparse(body.func.value), body.func.attr, ast.unparse(base)


def _roots(model: torch.nn.Module | None, held_as: str, named: list[tuple[str, Any]], user_frames: list[FrameType],
           torch_frames: list[FrameType]) -> list[tuple[str, torch.nn.Module]]:
    """Modules that may own the meta tensors, with the names the user knows them by, nearest first."""
    out: list[tuple[str, torch.nn.Module]] = [(held_as, unwrap(model))] if model is not None else []
    out += [(label, m) for label, m in named if isinstance(m, torch.nn.Module)]
    for frame in user_frames:
        for name, value in frame.f_locals.items():
            if isinstance(value, torch.nn.Module):
                out.append((type(value).__name__ if name == "self" else name, value))
    out += [(type(m).__name__, m) for f in torch_frames if isinstance(m := f.f_locals.get("self"), torch.nn.Module)]
    first: dict[int, tuple[str, torch.nn.Module]] = {}  # one module under several names (model=, a local, self)
    for label, m in out:  # is walked once, by its first name: each walk of 100,000 weights costs a second
        first.setdefault(id(m), (label, m))
    return list(first.values())


def _weights(roots: list[tuple[str, torch.nn.Module]]) -> dict[int, tuple[str, str]]:
    """id(tensor) -> (parameter | buffer, its full name from the first root that holds it)."""
    out: dict[int, tuple[str, str]] = {}
    for label, root in roots:
        for name, sub in root.named_modules(remove_duplicate=False):
            for kind, key, tensor in own_tensors(sub):
                out.setdefault(id(tensor), (kind, f"{label}.{name}.{key}" if name else f"{label}.{key}"))
    return out


def _operand(label: str, tensor: torch.Tensor, weights: dict[int, tuple[str, str]]) -> Operand:
    kind, origin = weights.get(id(tensor), ("value", None))
    return Operand(label=origin or label, device=str(tensor.device), dtype=str(tensor.dtype).removeprefix("torch."),
                   shape=tuple(tensor.shape), kind=kind, origin=origin)


def _owner(roots: list[tuple[str, torch.nn.Module]], tensors: list[Operand],
           weights: dict[int, tuple[str, str]]) -> tuple[str, torch.nn.Module] | None:
    """The root that holds the meta tensors (the one they are named from), else the first with meta tensors."""
    prefixes = {t.origin.split(".")[0] for t in tensors if t.origin}
    with_meta = [(label, m) for label, m in roots if any(True for _ in _meta_tensors(m, label))]
    return next((r for r in with_meta if r[0] in prefixes), with_meta[0] if with_meta else None)


def _meta_tensors(module: torch.nn.Module, label: str) -> list[tuple[str, torch.Tensor]]:
    return [(f"{label}.{n}", t) for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]


def _offloaded(root: torch.nn.Module, label: str, tensors: list[Operand]) -> list[str]:
    """Modules holding TENSORS whose accelerate hook (or an ancestor's) offloads their weights."""
    names = {t.origin.removeprefix(label + ".").rpartition(".")[0] for t in tensors if t.origin}
    out = []
    for name, module in root.named_modules():
        if any(n == name or n.startswith(name + ".") or not name for n in names) and _offloads(module):
            out.append(f"{label}.{name}" if name else label)
    return out


def _offloads(module: torch.nn.Module) -> bool:
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) if hook is not None else None
    return any(getattr(h, "offload", False) for h in (hooks if isinstance(hooks, (list, tuple)) else [hook]))
