"""Read any checkpoint torchplace knows into one state tree, every tensor on the device it will live on.

The state tree is torchplace's layout: 'model', 'optimizer', 'scheduler', 'scaler', 'extra', 'rng'
and named state. For torchplace files (and plain safetensors files) each tensor is allocated on
its final device before the bytes are read, chosen from the objects being loaded: a model's
tensors on the device of the parameter they fill, optimizer state with its parameter, RNG states
on the CPU. Other tools' files (torch.save, Lightning, accelerate) go through `foreign`.

`kind_of` is the one place that decides what a path is; `load`, `inspect` and `convert` ask it once and
hand the answer, with one `ReadOptions`, to the reader it picks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from . import codec, foreign
from ._torchfile import from_torch_save
from .dcp_reader import is_dcp_dir
from .fileio import FileState, read_file
from .format import SIDE_FILE, Header
from .keymap import match
from .options import ReadOptions
from .rotation import complete_checkpoints, is_pointer
from .state_dicts import module_device, module_devices, optimizer_devices, unwrap


def kind_of(path: Path) -> str:
    """What PATH is, decided once for every reader: "pointer" (a series' `latest`), "dcp" (a sharded checkpoint
    of ours), "dcp-foreign" (torch.distributed.checkpoint's own folder), "accelerate" (accelerate's save_state,
    transformers' save_pretrained), "folder" (any other folder: a series of ours), "index" (a sharded model's
    index JSON), or a file's format: "safetensors" (ours too), "torch-zip", "torch-pickle", "unknown"."""
    try:
        return _kind_of(path)
    except PermissionError as exc:  # a folder this user may not list or enter
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}: this user may not list or read it. Fix: "
                              f"check its permissions (ls -ld {path}), or read it as a user who may.") from None


def _kind_of(path: Path) -> str:
    if is_pointer(path):
        return "pointer"
    if path.is_dir():
        if is_dcp_dir(path):
            return "dcp" if (path / SIDE_FILE).is_file() else "dcp-foreign"
        newer: list = []  # a folder of ours whose files start with "model" is still ours
        if foreign.is_accelerate_dir(path) and not complete_checkpoints(path, newer=newer) and not newer:
            return "accelerate"
        return "folder"
    kind = foreign.file_kind(path)
    return "index" if kind == "unknown" and path.name in foreign.INDEX_FILES else kind


Read = tuple[str, dict[str, Any], dict[str, Any], list[str], Mapping[str, Any] | None]


def _device_for(model: nn.Module | None, optimizer: Any, default: torch.device,
                saved_model_keys: list[str], saved_optimizer: Any) -> Callable[[tuple[Any, ...]], torch.device]:
    """A function from a tensor's path in the saved tree to the device it should be read onto."""
    cpu = torch.device("cpu")
    model_devs: dict[str, torch.device] = {}
    names: dict[str, str] = {}
    if model is not None:
        model_devs = module_devices(model)
        names = match(saved_model_keys, model).mapping  # saved key -> the model's key it fills
    opt_devs = optimizer_devices(optimizer, saved_optimizer) if optimizer is not None and saved_optimizer else {}

    def device_for(path: tuple[Any, ...]) -> torch.device:
        head = path[0] if path else None
        if head == "rng":
            return cpu
        if head == "model" and len(path) == 2 and model is not None:
            dev = model_devs.get(names.get(str(path[1]), str(path[1])))
            if dev is not None and dev.type != "meta":
                return dev
        if head == "optimizer" and optimizer is not None:
            return opt_devs.get(tuple(path[1:]), default)
        return default

    return device_for


def _skeleton(header: Header) -> dict[str, Any]:
    """The saved tree with placeholders for tensors (from the header alone)."""
    if header.meta is None:
        return {"model": {e.key: None for e in header.entries}}
    return header.skeleton if header.skeleton is not None else codec.decode(header.meta["state"], codec.TensorRef)


def read_any(path: Path, kind: str, opts: ReadOptions, *, model: nn.Module | None, optimizer: Any) -> Read:
    """(tool, state tree, metadata, notes, the file's own top-level mapping) of PATH, of KIND (`kind_of`), every
    tensor on its target device; the last is what torch.load gives for another tool's dict file (its keys as the
    user wrote them), else None."""
    default = opts.device or (module_device(unwrap(model)) if model is not None else torch.device("cpu"))
    opts = replace(opts, device=default if default.type != "meta" else torch.device("cpu"))

    def load_st(p: Path) -> dict[str, Any]:  # a foreign safetensors file's tensors, onto the default device
        return read_file(p, lambda _: opts.map_location, opts).tree["model"]

    if kind == "safetensors":
        def placing(header: Header) -> Callable[[tuple[Any, ...]], torch.device]:
            skeleton = _skeleton(header)
            return _device_for(unwrap(model) if model is not None else None, optimizer, opts.map_location,
                               list(skeleton.get("model") or {}), skeleton.get("optimizer"))

        fs: FileState = read_file(path, None, opts, placing=placing)
        tool = "torchplace" if fs.header.meta is not None else "safetensors"
        return tool, fs.tree, fs.meta, [], None
    if kind in ("torch-zip", "torch-pickle"):
        obj = foreign.torch_load(path, opts)
        ours = from_torch_save(obj)
        if ours is not None:  # torchplace.save under a torch.save name
            return "torchplace (torch.save file)", ours[0], ours[1], [], None
        tool, state = foreign.normalize(obj, path)
        return tool, state, {}, [], obj if isinstance(obj, Mapping) and not foreign.is_state_dict(obj) else None
    if kind == "accelerate":
        state, notes = foreign.load_accelerate(path, load_st, opts)
        return foreign.folder_tool(path), state, {}, notes, None
    if kind == "index":  # a sharded model's index: the shards it lists
        return foreign.folder_tool(path.parent), {"model": foreign.load_index(path, load_st, opts)}, {}, [], None
    if kind == "dcp":
        raise CheckpointError(f"{path} is a sharded checkpoint (torch.distributed.checkpoint): its tensors only "
                              "exist as shards. Fix: torchplace.load it with model= (and optimizer=) in a process "
                              "group, then torchplace.save (torch's dcp_to_torch_save unpickles without limits: use it "
                              "only for folders you trust).")
    if kind == "dcp-foreign":
        raise CheckpointError(f"{path} was written by torch.distributed.checkpoint directly; it holds no model "
                              "structure to convert without a model. Fix: torchplace.load(path, model=...) reads it "
                              "into your model (safely), then torchplace.save writes one file.")
    raise foreign.unknown(path)


def place_optimizer_state(optimizer: Any, osd: dict[str, Any]) -> dict[str, Any]:
    """Move a foreign optimizer state's tensors next to their parameters (`step` where PyTorch keeps it)."""
    targets = optimizer_devices(optimizer, osd)
    if not targets:
        return osd
    state = {pid: {name: (v.to(targets[("state", pid, name)]) if isinstance(v, torch.Tensor)
                          and ("state", pid, name) in targets else v) for name, v in entry.items()}
             for pid, entry in (osd.get("state") or {}).items()}
    return {**osd, "state": state}
