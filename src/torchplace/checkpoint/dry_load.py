"""Find a load torch would refuse before any weight is written: a rehearsal on a shape-only twin.

`Module.load_state_dict` copies every tensor that fits and only then raises for missing,
unexpected or misshapen keys, so a refused load leaves the model half overwritten. `rehearse`
runs torch's own `load_state_dict` (its hooks and each module's `_load_from_state_dict`, so the
verdict is torch's) on a copy of the module whose tensors live on the meta device, where copies
move no data. Where a rehearsal cannot be exact or safe it is skipped and the real load decides
as before: modules with state-dict hooks (FSDP's run collectives), tensor subclasses (DTensor
parameters), or a module that cannot be copied.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

_HOOKS = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_pre_hooks",
          "_state_dict_hooks")
_OWN = ("_parameters", "_buffers", "_modules")  # the twin's own tables: copied (their tensors as meta shells)


def rehearse(module: nn.Module, state: Mapping[str, Any], strict_keys: bool) -> RuntimeError | None:
    """The RuntimeError `module.load_state_dict(state, strict=strict_keys)` would raise, or None when it
    would load (or when no rehearsal can tell: see the module docstring). Nothing of MODULE changes."""
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
