"""What a saved state needs before it fits the objects `load` was given, decided before anything is written.

`load` changes nothing until every check here has passed: the state it was asked for is in the file,
the optimizer's parameter groups fit (torch refuses them only after the model took the new weights),
tied weights are complete and agree (transformers' save_pretrained writes one key of each tied group;
an untied model's checkpoint holds two values for one tensor), and a model made on the meta device
gets every one of its tensors from the file; and a load torch would refuse is found before any weight
is written (`rehearse`, below).
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from . import state_dicts


def holds(state: dict[str, Any]) -> str:
    return ", ".join(sorted(state)) or "nothing"


def check_objects(path: Path, state: dict[str, Any], *, model: nn.Module | None,
                  objects: dict[str, Any]) -> None:
    """Refuse, before anything is loaded, a named state the file lacks or an optimizer whose parameter
    groups do not fit (torch would refuse it after the model had taken the new weights)."""
    kept = " Nothing was loaded: the model and every object given were left as they were." if model is not None else ""
    for name, obj in objects.items():
        if obj is None:
            continue
        if name not in state:
            raise CheckpointError(f"{path} has no {name} state (it holds: {holds(state)}). "
                                  f"Fix: load it without {name}=.{kept}")
        problem = state_dicts.optimizer_problem(obj, state[name]) if name == "optimizer" else None
        if problem is not None:
            raise CheckpointError(f"{path}: the saved optimizer state does not fit the {type(obj).__name__} given "
                                  f"({problem}).{kept} Fix: build it as it was when saved (same parameters and groups, "
                                  "in the same order).")


def tied(path: Path, notes: list[str], sd: Any, target: nn.Module, name: str = "model") -> Any:
    """SD with keys the file leaves out for being tied to a saved one filled (noted); a tied group
    saved with different values refused before anything is loaded."""
    if not isinstance(sd, Mapping):
        return sd
    sd, filled, differ = state_dicts.fill_tied(sd, target)
    notes.extend(filled if name == "model" else [f"{name}: {n}" for n in filled])
    if differ:
        kept = "Nothing was loaded" if name == "model" else f"The {name} was left as it was"
        raise CheckpointError(
            f"{path}: {'; '.join(differ)} are one tensor in {type(target).__name__} (tied weights), but the file "
            f"holds different values for them. {kept}.\n"
            "Fix: build the model untied, as it was saved (for transformers: tie_word_embeddings=False in its "
            "config).\n"
            f"Or: take the state (tp.load(path)[{name!r}]), delete the key you do not want and load the rest.\n"
            "Why: it was saved from a model where they are separate; loading would keep whichever torch copies "
            "last.")
    return sd


def meta_to_fill(path: Path, notes: list[str], sd: Mapping[str, Any], target: nn.Module) -> bool:
    """True when TARGET has tensors on the meta device, all of which SD fills; refused, before anything is
    loaded, when some would stay on meta (non-persistent buffers, keys the file lacks)."""
    empty = state_dicts.meta_names(target)
    if not empty:
        return False
    left = [k for k in empty if k not in sd]
    if left:
        more = f" and {len(left) - 5} more" if len(left) > 5 else ""
        raise CheckpointError(
            f"{path}: {len(left)} of the {len(empty)} tensor(s) {type(target).__name__} has on the meta device are "
            f"not in the file, so they would stay on meta; nothing was loaded: {', '.join(left[:5])}{more}.\n"
            "Fix: build the model on a real device, then load.\n"
            "Or: model.to_empty(device=...), initialize those tensors, then load.\n"
            "Why: they are keys the file lacks, or non-persistent buffers, which are never saved; a meta tensor "
            "(torch.device('meta'), init_empty_weights) has no memory.")
    notes.append(f"{len(empty)} tensor(s) of the model were on the meta device: they are now the file's tensors")
    return True


def fit_fix(saved: Mapping[str, Any], model: nn.Module, strict_keys: bool) -> str:
    """The fix for a load_state_dict refusal: strict=False skips missing and unexpected keys, but
    torch refuses a tensor of another shape either way, so for shapes it is no fix."""
    own = model.state_dict()
    shapes = [f"{k} saved {list(v.shape)}, model {list(own[k].shape)}" for k, v in saved.items()
              if isinstance(v, torch.Tensor) and isinstance(own.get(k), torch.Tensor) and v.shape != own[k].shape]
    if shapes:
        more = f" and {len(shapes) - 3} more" if len(shapes) > 3 else ""
        return (f"build the model with the configuration it was saved with: {len(shapes)} tensor(s) have "
                f"another shape ({'; '.join(shapes[:3])}{more}), which strict=False does not skip. To load the "
                "rest, take the state (tp.load(path)['model']), delete those keys, and call "
                "model.load_state_dict(state, strict=False).")
    if strict_keys:
        return ("pass the model the checkpoint was saved from, or strict=False to load the keys that match "
                "(missing and unexpected keys are then reported).")
    return "pass the model the checkpoint was saved from."


# -- Find a load torch would refuse before any weight is written: a rehearsal on a shape-only twin.
#
# `Module.load_state_dict` copies every tensor that fits and only then raises for missing,
# unexpected or misshapen keys, so a refused load leaves the model half overwritten. `rehearse`
# runs torch's own `load_state_dict` (its hooks and each module's `_load_from_state_dict`, so the
# verdict is torch's) on a copy of the module whose tensors live on the meta device, where copies
# move no data. Where a rehearsal cannot be exact or safe it is skipped and the real load decides
# as before: modules with state-dict hooks (FSDP's run collectives), tensor subclasses (DTensor
# parameters), or a module that cannot be copied. A module tree whose every module loads as
# `nn.Module` itself does (no override, no hook) can only be refused for its keys and shapes, so
# where STATE holds exactly its keys with its shapes the verdict is known without the twin (`_plainly_fits`):
# the twin's copy and load cost as much as the real load (GPT-2-sized models: 10-20 ms of CPU a load).

_HOOKS = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_pre_hooks",
          "_state_dict_hooks")
_OWN = ("_parameters", "_buffers", "_modules")  # the twin's own tables: copied (their tensors as meta shells)


def rehearse(module: nn.Module, state: Mapping[str, Any], strict_keys: bool) -> RuntimeError | None:
    """The RuntimeError `module.load_state_dict(state, strict=strict_keys)` would raise, or None when it
    would load (or when no rehearsal can tell: see the module docstring). Nothing of MODULE changes."""
    if _plainly_fits(module, state):
        return None
    twin = _meta_twin(module)
    if twin is None:
        return None
    try:
        shadow: OrderedDict[str, Any] = OrderedDict((k, _shell(v)) for k, v in state.items())
        shadow._metadata = getattr(state, "_metadata", None)  # type: ignore[attr-defined]
        with warnings.catch_warnings():  # the real load says what there is to say, once
            warnings.simplefilter("ignore")
            twin.load_state_dict(shadow, strict=strict_keys)
    except RuntimeError as exc:  # torch's verdict, or a module's own loading that needs real data
        return exc if _verdict(exc) else None
    except Exception:  # noqa: BLE001 - a module whose loading needs real data: the real load decides
        return None
    return None


def _plainly_fits(module: nn.Module, state: Mapping[str, Any]) -> bool:
    """True when `module.load_state_dict(state)` cannot be refused, strict or not: every module of MODULE
    loads as `nn.Module` does (no override of its loading or extra state, no hook), and STATE holds
    exactly the keys torch's loading visits (each parameter and persistent buffer, walked as it walks
    them: a shared module under each of its names), each a plain tensor of the shape it fills."""
    expected: dict[str, Any] = {}
    todo: list[tuple[str, nn.Module]] = [("", module)]
    while todo:
        prefix, m = todo.pop()
        cls = type(m)
        if cls._load_from_state_dict is not nn.Module._load_from_state_dict \
                or cls.set_extra_state is not nn.Module.set_extra_state \
                or any(getattr(m, name, None) for name in _HOOKS):
            return False
        for name, p in m._parameters.items():
            if p is not None:
                expected[prefix + name] = p
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                expected[prefix + name] = b
        todo.extend((f"{prefix}{name}.", child) for name, child in m._modules.items() if child is not None)
        if len(expected) > len(state):
            return False
    if len(expected) != len(state):
        return False
    for key, value in state.items():
        own = expected.get(key)
        if own is None or type(value) is not torch.Tensor or type(own) not in (torch.Tensor, nn.Parameter) \
                or value.shape != own.shape:
            return False
    return True


def _shell(value: Any) -> Any:
    """VALUE as an empty meta tensor, where torch can make one; other values (quantized and strided
    nested tensors have no meta kernels, subclasses their own rules) are passed as they are."""
    if type(value) is torch.Tensor and not value.is_quantized and not (
            value.is_nested and value.layout is torch.strided):
        return torch.empty_like(value, device="meta")
    return value


def _verdict(exc: RuntimeError) -> bool:
    """Whether EXC is load_state_dict's own refusal (missing, unexpected or misshapen keys), which
    holds for the real tensors too. A module's `_load_from_state_dict` that reads a value (quantized
    modules: `.item()`, a repack) fails on meta tensors with a RuntimeError of its own, and a copy
    torch failed is said as 'While copying': neither is a verdict, so the real load decides."""
    text = str(exc)
    return text.startswith("Error(s) in loading state_dict") and "While copying the parameter" not in text


def _meta_twin(module: nn.Module) -> nn.Module | None:
    """MODULE copied with every parameter and buffer as an empty meta tensor and every other attribute
    shared with MODULE, or None when unsafe."""
    modules = list(module.modules())
    if any(getattr(m, name, None) for m in modules for name in _HOOKS):
        return None
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if type(t) not in (torch.Tensor, nn.Parameter) or t.is_quantized or t.is_nested:
            return None  # no meta shell for these (subclasses have their own rules): the real load decides
        shell = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(shell, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else shell
    for m in modules:  # every other attribute is shared, not copied: loading writes none of them in place,
        for name, value in vars(m).items():  # and a dataset, a cache or a tokenizer a module holds may be large
            if name not in _OWN and not isinstance(value, nn.Module):
                memo.setdefault(id(value), value)
    try:
        return copy.deepcopy(module, memo)
    except Exception:  # noqa: BLE001 - an attribute deepcopy refuses (a lock, a handle): no rehearsal
        return None
