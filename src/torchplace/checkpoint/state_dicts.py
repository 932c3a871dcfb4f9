"""Training objects <-> the plain state a checkpoint stores.

- Wrappers are peeled on save (DataParallel, DistributedDataParallel, torch.compile, in any
  nesting, and torch.compile'd submodules inside), so no `module.` or `_orig_mod.` wrapper prefix
  is ever written; on load, `keymap` matches other tools' keys against the model's.
- The state dict's `_metadata` (per-module versions) travels with it, renamed with its keys.
- Every tensor is read straight onto the device it will live on: a model's tensors onto the device
  of the parameter or buffer they fill, an optimizer's state onto its parameter's device, and
  `step` where PyTorch keeps it (the CPU, unless the optimizer is capturable or fused).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..shared.wrappers import meta_names as meta_names  # re-exported: loading and fitting call state_dicts.meta_names
from ..shared.wrappers import unwrap

MAPPING_ENTRIES = ("model", "optimizer", "scheduler", "scaler", "rng")


def layout_problem(state: Any) -> str | None:
    """What keeps STATE (a saved tree, ours or normalized from another tool) from being torchplace's
    layout, or None: a dict with string keys, whose model is a map from string keys, and whose
    optimizer, scheduler, scaler and rng entries are maps. Loaders rely on these shapes."""
    if not isinstance(state, Mapping):
        return f"the saved state is a {type(state).__name__}, not a dict"
    odd = [k for k in state if not isinstance(k, str)]
    if odd:
        return f"the saved state has a key {odd[0]!r:.60} that is not a string"
    for name in MAPPING_ENTRIES:
        value = state.get(name)
        if value is not None and not isinstance(value, Mapping):
            return f"its {name!r} entry is a {type(value).__name__}, not a dict"
    model = state.get("model") or {}
    odd = [k for k in model if not isinstance(k, str)]
    if odd:
        return (f"the model's state has a key {odd[0]!r:.60} of type {type(odd[0]).__name__}; "
                "state dict keys are strings")
    return None


def state_of(obj: Any, what: str) -> Any:
    """OBJ's state dict, or OBJ itself when it is already a mapping (e.g. from another checkpoint)."""
    if obj is None:
        return obj
    if isinstance(obj, Mapping):
        if any(isinstance(v, nn.Module) for v in obj.values()):
            raise TypeError(f"save({what}=...) got a {type(obj).__name__} of modules. {_SEVERAL.format(call='save')}")
        return obj
    if isinstance(obj, nn.Module):
        return module_state(obj)
    if callable(getattr(obj, "state_dict", None)):
        return obj.state_dict()
    several = f" {_SEVERAL.format(call='save')}" if _holds_modules(obj) else ""
    raise TypeError(f"{what}= must be an object with state_dict() or a mapping, not {type(obj).__name__}.{several}")


_SEVERAL = ("Pass one module (or its state dict) as model=, and other modules by name: "
            "{call}(path, model=model, ema=ema_model), or hold them in one nn.ModuleDict / nn.ModuleList.")


def _holds_modules(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and any(isinstance(v, nn.Module) for v in obj)


def module_to_fill(model: Any) -> None:
    """Refuse a load's model= that is not a module to fill in place (a state dict, a list of modules)."""
    if model is None or isinstance(model, nn.Module):
        return
    if isinstance(model, Mapping) and not any(isinstance(v, nn.Module) for v in model.values()):
        raise TypeError(f"load(model=...) fills an nn.Module's tensors in place; it got a {type(model).__name__} "
                        "(a state dict?). Fix: pass the module to fill, or call load(path) without model= and "
                        "read the saved tensors from ck['model'].")
    several = _SEVERAL.format(call="load") if _holds_modules(model) or isinstance(model, Mapping) else \
        "Fix: pass the nn.Module to fill (a wrapper such as DDP or torch.compile's is fine)."
    raise TypeError(f"load(model=...) fills an nn.Module's tensors in place; it got a {type(model).__name__}. "
                    f"{several}")


def module_state(model: nn.Module) -> OrderedDict[str, Any]:
    """The unwrapped model's state dict (tensors detached, still on their devices), with clean keys
    (no `_orig_mod.` from compiled submodules) and its `_metadata` (module versions) kept."""
    return clean_state(unwrap(model).state_dict())


def clean_state(sd: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """SD as saved: torch.compile's `_orig_mod.` removed at any depth, `_metadata` kept and renamed."""
    from .keymap import clean

    return clean(sd)[0]


def versions_of(sd: Any) -> dict[str, Any]:
    """SD's `_metadata` as plain maps of JSON values ({} if it has none)."""
    from .keymap import versions_of as read

    return read(sd) or {}


def saved_versions(value: Any) -> dict[str, dict[str, Any]] | None:
    """VALUE (read from a file's metadata) if it is a map of module path -> map, else None."""
    if isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, Mapping) for k, v in value.items()):
        return {k: dict(v) for k, v in value.items()}
    return None


def module_devices(model: nn.Module) -> dict[str, torch.device]:
    """Device of each state-dict entry of the (unwrapped) model."""
    return {k: v.device for k, v in unwrap(model).state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def module_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for an empty model)."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def optimizer_devices(optimizer: torch.optim.Optimizer,
                      saved: Mapping[str, Any]) -> dict[tuple[Any, ...], torch.device]:
    """Target device for each tensor path ('state', id, name) of a saved optimizer state.

    Saved ids map to the current parameters in param-group order (as `load_state_dict` maps
    them). `step` stays on the CPU unless the group is capturable or fused, as PyTorch keeps it.
    """
    out: dict[tuple[Any, ...], torch.device] = {}
    groups = saved.get("param_groups") or []
    state = saved.get("state") or {}
    current = optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(current) or not isinstance(state, Mapping) \
            or not all(isinstance(g, Mapping) and isinstance(g.get("params", []), list) for g in groups) \
            or not all(isinstance(v, Mapping) for v in state.values()):
        return out  # not an optimizer's state: load_state_dict will say what is wrong
    cpu = torch.device("cpu")
    for saved_group, group in zip(groups, current):
        ids = saved_group.get("params", [])
        if len(ids) != len(group["params"]):
            return {}
        on_device = bool(group.get("capturable") or group.get("fused"))
        for pid, param in zip(ids, group["params"]):
            try:
                names = state.get(pid, {})
            except TypeError:  # an unhashable id
                return {}
            for name in names:
                out[("state", pid, name)] = param.device if name != "step" or on_device else cpu
    return out


def optimizer_problem(optimizer: Any, saved: Any) -> str | None:
    """Why OPTIMIZER's `load_state_dict(SAVED)` would refuse (torch's own words), or None: the
    checks it makes on parameter groups, made before anything else of a checkpoint is loaded."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    current = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not isinstance(current, list):
        return None  # not an optimizer's state: load_state_dict says what is wrong
    if len(groups) != len(current):
        return (f"loaded state dict has a different number of parameter groups: {len(groups)} saved, "
                f"{len(current)} in the optimizer")
    sizes = [(len(g["params"]), len(c["params"])) for g, c in zip(groups, current)
             if isinstance(g, Mapping) and isinstance(g.get("params"), list)]
    odd = next(((i, s) for i, s in enumerate(sizes) if s[0] != s[1]), None)
    if odd is not None:
        return (f"loaded state dict contains a parameter group that doesn't match the size of optimizer's group: "
                f"group {odd[0]} has {odd[1][0]} parameters saved and {odd[1][1]} in the optimizer")
    return None


def tied_groups(model: nn.Module) -> list[list[str]]:
    """MODEL's state-dict keys that name one tensor (tied weights: an LM head sharing the input
    embedding), in groups of two or more, each in state-dict order."""
    by_tensor: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            by_tensor.setdefault(id(value), []).append(key)
    return [keys for keys in by_tensor.values() if len(keys) > 1]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """A and B hold equal values: at once when they are one view of one storage (a torch.save of a tied
    model keeps both keys so), else compared."""
    if a is b or (a.device == b.device and a.dtype == b.dtype and a.stride() == b.stride() and not a.is_meta
                  and a.storage_offset() == b.storage_offset()
                  and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()):
        return True
    return torch.equal(a, b.to(a.device))


def fill_tied(sd: Mapping[str, Any], model: nn.Module) -> tuple[Mapping[str, Any], list[str], list[str]]:
    """SD with the keys a file leaves out because the model ties them to a key it has (transformers'
    save_pretrained writes one key of each tied group) filled from that key; notes on what was filled;
    and the tied groups SD holds different values for (saved from a model where they were separate:
    loading would keep whichever torch copies last)."""
    filled: dict[str, str] = {}
    differ: list[str] = []
    for keys in tied_groups(model):
        present = [k for k in keys if k in sd]
        if not present:
            continue
        first = sd[present[0]]
        for k in keys:
            if k not in sd:
                filled[k] = present[0]
        unequal = [k for k in present[1:] if isinstance(first, torch.Tensor) and isinstance(sd[k], torch.Tensor)
                   and sd[k].shape == first.shape and not _same_values(sd[k], first)]
        if unequal:
            differ.append(" = ".join([present[0], *unequal]))
    if not filled:
        return sd, [], differ
    out: OrderedDict[str, Any] = OrderedDict(sd)
    for k, source in filled.items():
        out[k] = sd[source]
    out._metadata = getattr(sd, "_metadata", None)  # type: ignore[attr-defined]
    shown = ", ".join(f"{k} from {s}" for k, s in list(filled.items())[:4])
    more = f" and {len(filled) - 4} more" if len(filled) > 4 else ""
    return out, [f"tied weights: {len(filled)} key(s) not in the file are one tensor with a saved key in the model, "
                 f"filled from it ({shown}{more})"], differ


def for_assign(sd: Mapping[str, Any], model: nn.Module) -> OrderedDict[str, Any]:
    """SD ready for `load_state_dict(assign=True)` into MODEL's meta tensors: each floating tensor in the
    dtype the model was built with (as a load into real tensors casts), tensors shared in SD still shared."""
    own = model.state_dict(keep_vars=True)
    cast: dict[int, Any] = {}
    out: OrderedDict[str, Any] = OrderedDict()
    for key, value in sd.items():
        want = own.get(key)
        if isinstance(value, torch.Tensor) and isinstance(want, torch.Tensor) and want.is_meta and \
                value.is_floating_point() and want.is_floating_point() and value.dtype != want.dtype:
            value = cast.setdefault(id(value), value.to(want.dtype))
        out[key] = value
    out._metadata = getattr(sd, "_metadata", None)  # type: ignore[attr-defined]
    return out


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make each group of MODEL's state-dict keys one tensor again, the first key's (a load with
    assign=True gives every key its own Parameter, so tied weights would train apart)."""
    for keys in groups:
        owner, _, name = keys[0].rpartition(".")
        first = getattr(model.get_submodule(owner), name)
        for key in keys[1:]:
            owner, _, name = key.rpartition(".")
            setattr(model.get_submodule(owner), name, first)
