"""What a saved state needs before it fits the objects `load` was given, decided before anything is written.

`load` changes nothing until every check here has passed: the state it was asked for is in the file,
the optimizer's parameter groups fit (torch refuses them only after the model took the new weights),
tied weights are complete and agree (transformers' save_pretrained writes one key of each tied group;
an untied model's checkpoint holds two values for one tensor), and a model made on the meta device
gets every one of its tensors from the file.
"""

from __future__ import annotations

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
            "holds different values for them: it was saved from a model where they are separate, and loading would "
            f"keep whichever torch copies last. {kept}. "
            "Fix: build the model untied, as it was saved (for transformers: tie_word_embeddings=False in its config), "
            f"or take the state (tp.load(path)[{name!r}]), delete the key you do not want and load the rest.")
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
            f"{path}: {type(target).__name__} has {len(empty)} tensor(s) on the meta device (made without memory, "
            f"as under torch.device('meta') or init_empty_weights), and the file does not hold {len(left)} of them: "
            f"{', '.join(left[:5])}{more} (keys the file lacks, or non-persistent buffers, which are never saved). "
            "They would stay on meta. Nothing was loaded. Fix: make those on a real device (model.to_empty(device="
            "...), then initialize them), or build the model on a real device, then load.")
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
