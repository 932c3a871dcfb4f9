"""Turn another tool's checkpoint into a torchplace one, or any checkpoint into plain weights: on the CPU, no pickle.

Reads torch.save files (plain state dicts, training dicts, Lightning checkpoints), accelerate
`save_state` directories, safetensors files and torchplace files the same way `load` does
(weights_only, mapped to the CPU, so a file saved on a GPU converts on a machine without one) and
removes only the wrapper prefix that is unambiguous without the model: torch.compile's
`_orig_mod.`, at any depth. A leading `module.` or `model.` may be DDP's and Lightning's, or a real
submodule (an EMA wrapper's `module`): it is kept and reported; `load(path, model=...)` maps it by
matching the model's keys.

- `convert(src, dst)` writes `torchplace.save`'s format (module versions kept), so the file loads
  fast, verified and safely from then on.
- `convert(src, dst, weights_only=True)` writes the model's state dict alone as a plain safetensors
  file (`{"format": "pt"}` metadata, tied weights stored once each), which
  `model.load_state_dict(safetensors.torch.load_file(dst))` accepts, as do HF, timm and vLLM; under a
  torch.save name (.pt/.pth/.tar/.ckpt/.bin), as torch.save writes `model.state_dict()`, for
  `model.load_state_dict(torch.load(dst))`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..progress import ProgressFn, begin, reporting
from ..shared.tree import leaves
from . import _torchfile as torchfile
from . import foreign, keymap
from .atomic import write_bytes
from .fileio import write_file
from .options import ReadOptions
from .reading import kind_of, read_any
from .rotation import HF_WEIGHT_NAMES, check_name
from .state_dicts import saved_versions, versions_of


@dataclass
class Converted:
    """What `convert` wrote and what it changed."""

    path: Path
    source_tool: str
    stripped_prefix: str = ""
    tensors: int = 0
    notes: list[str] = field(default_factory=list)
    weights_only: bool = False


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, trust_pickle: bool = False,
            weights_only: bool = False, progress: ProgressFn | None = None) -> Converted:
    """Convert the checkpoint at SRC into a torchplace checkpoint at DST (written atomically; under a
    .pt/.pth/.tar/.ckpt/.bin name, the torch.save file torchplace.save writes there); with WEIGHTS_ONLY, into a
    plain safetensors state dict of the model's weights. PROGRESS, if given,
    hears the reading and the writing (see torchplace.progress)."""
    with reporting(progress):
        opts = ReadOptions(device=torch.device("cpu"), trust_pickle=trust_pickle)
        return _convert(Path(src), Path(dst), opts, weights_only=weights_only)


def _convert(src: Path, dst: Path, opts: ReadOptions, *, weights_only: bool) -> Converted:
    check_name(dst)  # `latest` is the pointer's name, in convert as in save
    if not weights_only and HF_WEIGHT_NAMES.fullmatch(dst.name):
        raise CheckpointError(f"convert to {dst}: {dst.name} is the name transformers and accelerate read as a "
                              "model's plain weights, and a torchplace checkpoint there would load none of them "
                              "(its tensors are named 'model/...'); nothing was written. Fix: add --weights-only "
                              "(convert(..., weights_only=True)) to write the file they read, or name OUT otherwise "
                              "(step-000100.safetensors).")
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise CheckpointError(f"IN and OUT are the same file ({src} and {dst}); converting in place would "
                              "overwrite the input. Fix: write to a new name, check it with `torchplace ckpt "
                              "inspect`, then move it.")
    begin(f"reading {src.name}")
    tool, state, meta, notes, _ = read_any(src, kind_of(src), opts, model=None, optimizer=None)
    notes = list(notes)
    prefix = ""
    versions: dict[str, Any] | None = None
    model = state.get("model")
    if weights_only and not isinstance(model, Mapping):  # tp.save of imagenet's dict: the weights as 'state_dict'
        key, named = foreign.model_entry(state)
        if key is not None:
            model = state["model"] = named
            del state[key]
            notes.append(f"model weights: taken from the saved entry {key!r}, the model's state dict")
    if isinstance(model, Mapping):
        cleaned, versions, changed = keymap.clean(model, saved_versions(meta.get("module_versions")) or
                                                  versions_of(model) or None)
        state["model"] = cleaned
        if changed:
            prefix = "_orig_mod."
            notes.append(f"removed torch.compile's '_orig_mod.' from {changed} model keys")
        lead = keymap.leading_wrapper_note(list(cleaned))
        if lead:
            notes.append(lead)
    begin(f"writing {dst.name}")
    if weights_only:
        return write_weights(src, dst, tool, state, prefix, notes, versions)
    info = {"world_size": meta.get("world_size", 1), "objects": meta.get("objects", {}),
            "primary_device": "cpu", "converted_from": {"path": str(src), "tool": tool}}
    if versions:
        info["module_versions"] = dict(versions)
    if torchfile.is_torch_name(dst):  # the torch.save file such a name promises, as torchplace.save writes
        torchfile.write(dst, state, info)
    else:
        write_file(dst, state, info=info)
    count = sum(1 for _ in leaves(state))
    return Converted(dst, tool, prefix, count, notes)


def write_weights(src: Path, dst: Path, tool: str, state: dict[str, Any], prefix: str,
                  notes: list[str], versions: Mapping[str, Any] | None) -> Converted:
    """STATE's model alone at DST: a bare torch.save state dict under a torch name, else plain safetensors."""
    model = state.get("model")
    if not isinstance(model, Mapping) or not model:
        held = ", ".join(sorted(state)) or "nothing"
        raise CheckpointError(f"{src} ({tool}) holds no model weights to export (it holds: {held}). Fix: convert "
                              "without --weights-only, or point at the checkpoint that has the model.")
    left = sorted(k for k in state if k != "model")
    if left:
        notes.append(f"weights only: left out {', '.join(left)}")
    if torchfile.is_torch_name(dst):  # the bare state dict `model.load_state_dict(torch.load(dst))` takes
        return _write_torch_weights(dst, tool, model, prefix, notes, versions)
    from safetensors.torch import save as to_bytes

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    skipped = [k for k, v in model.items() if not isinstance(v, torch.Tensor)]
    shared = 0
    for key, value in model.items():
        if not isinstance(value, torch.Tensor):
            continue
        t = value.detach().to("cpu").contiguous()
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:  # tied weights: safetensors stores no aliases, so each key gets its own copy
                t, shared = t.clone(), shared + 1
            storages.add(t.untyped_storage().data_ptr())
        tensors[key] = t
    if skipped:
        notes.append(f"left out {len(skipped)} model entries that are not tensors ({', '.join(skipped[:5])}); "
                     "load_state_dict(strict=False) skips them")
    if shared:
        notes.append(f"{shared} tensors shared memory with another (tied weights); each key holds its own copy")
    notes.append("module versions (_metadata) cannot be stored in a plain safetensors file: load_state_dict "
                 "passes none to the modules (a quantization observer then resets its eps)")
    write_bytes(dst, to_bytes(tensors, metadata={"format": "pt"}))
    return Converted(dst, tool, prefix, len(tensors), notes, weights_only=True)


def _write_torch_weights(dst: Path, tool: str, model: Mapping[str, Any], prefix: str, notes: list[str],
                         versions: Mapping[str, Any] | None) -> Converted:
    """The model's state dict alone, as torch.save writes `model.state_dict()`: tensors on the CPU, tied weights
    kept tied, module versions kept (`_metadata`), so `torch.load(dst, weights_only=True)` gives it back."""
    import collections
    import io

    out: collections.OrderedDict[str, Any] = collections.OrderedDict(
        (k, v.detach().to("cpu") if isinstance(v, torch.Tensor) else v) for k, v in model.items())
    if versions:
        out._metadata = collections.OrderedDict(versions)  # type: ignore[attr-defined]
    buffer = io.BytesIO()
    torch.save(out, buffer)
    write_bytes(dst, buffer.getvalue())
    return Converted(dst, tool, prefix, sum(isinstance(v, torch.Tensor) for v in out.values()), notes,
                     weights_only=True)
