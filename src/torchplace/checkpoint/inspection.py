"""What is in a checkpoint, without loading it: keys, shapes, dtypes, sizes, where each tensor was.

For torchplace and safetensors files only the header is read; for torch.save files the pickle is
opened memory-mapped with `weights_only=True` (no code runs, and the bytes stay on disk), and the
device each storage was saved from is taken from the file itself. `verify=True` also reads the
data of a torchplace file and checks every checksum.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import safeio
from ..errors import CheckpointError, CheckpointFormatError
from ..progress import ProgressFn, begin, reporting
from ..shared.tree import leaves
from . import codec, foreign
from ._torchfile import from_torch_save
from .dcp_reader import read_dcp_metadata
from .format import SIDE_FILE, Header, dtype_name, open_for_read, read_header
from .options import ReadOptions
from .reading import kind_of
from .rotation import POINTER, check_format, complete_checkpoints
from .stream import verify_data

_META_SHOWN = ("format_version", "torchplace_version", "torch_version", "created_utc", "hostname", "world_size",
               "primary_device", "sharded", "objects", "pickled", "converted_from")


@dataclass
class TensorInfo:
    """One tensor of a checkpoint. `saved_on` is the device it was on when saved, when recorded."""

    key: str
    dtype: str
    shape: list[int]
    nbytes: int
    saved_on: str | None = None


@dataclass
class CheckpointInfo:
    """A checkpoint's contents, for `torchplace ckpt inspect` (as a table or as JSON)."""

    path: str
    tool: str
    size_bytes: int
    tensors: list[TensorInfo] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    contents: dict[str, str] = field(default_factory=dict)
    verified: bool | None = None
    notes: list[str] = field(default_factory=list)
    series: list[str] = field(default_factory=list)  # a run folder's complete checkpoints, newest first

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tensor_bytes"] = self.tensor_bytes
        return data


def _size(path: Path) -> int:
    """Bytes of a checkpoint file, or of the regular files directly in a checkpoint folder (the
    layouts torchplace reads are flat: never walk a tree, which for `/` would be the whole disk)."""
    if path.is_dir():
        with os.scandir(path) as entries:
            return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False))
    return path.stat().st_size


def _describe(value: Any) -> str:
    """A one-line summary of a top-level entry of the state tree (tensors as placeholders)."""
    tensors = sum(1 for _ in leaves(value, (codec.TensorRef, torch.Tensor)))
    if isinstance(value, dict):
        parts = [f"{len(value)} {'entry' if len(value) == 1 else 'entries'}"]
        groups = value.get("param_groups")
        if isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups):
            parts.append("lr " + ", ".join(f"{g.get('lr')!r}" if not isinstance(g.get("lr"), torch.Tensor)
                                           else "tensor" for g in groups))
        if tensors:
            parts.append(f"{tensors} tensors")
        plain = [f"{k}={v!r}" for k, v in value.items() if isinstance(v, (int, float, str, bool)) and len(repr(v)) < 40]
        if plain and not groups:
            parts.append(", ".join(plain[:6]) + (" ..." if len(plain) > 6 else ""))
        return "; ".join(parts)
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}" + (f"; {tensors} tensors" if tensors else "")
    return repr(value) if len(repr(value)) < 80 else f"{type(value).__name__}"


def _from_header(header: Header, info: CheckpointInfo) -> None:
    meta = header.meta
    saved_on: dict[str, str] = {}
    if meta is not None:
        devices = meta.get("devices") or {}
        for dev, keys in (devices.get("except") or {}).items():
            saved_on.update({k: dev for k in keys})
        default = devices.get("default")
        info.metadata = {k: meta[k] for k in _META_SHOWN if k in meta}
        skeleton = codec.decode(meta["state"], codec.TensorRef)
        info.contents = {k: _describe(v) for k, v in skeleton.items()}
        order = {key: i for i, key in enumerate(codec.tensor_keys_by_path(meta["state"]).values())}
    else:
        order = {}
        default = None
        info.metadata = dict(header.foreign_metadata)
        info.contents = {"model": f"{len(header.entries)} tensors (a safetensors file: its tensors are the model)"}
    for e in sorted(header.entries, key=lambda e: order.get(e.key, len(order))):  # as saved, not as laid out
        info.tensors.append(TensorInfo(e.key, dtype_name(e.dtype), list(e.shape), e.nbytes,
                                       saved_on.get(e.key, default)))


def _from_torch_file(path: Path, info: CheckpointInfo, opts: ReadOptions, zipped: bool, verify: bool) -> None:
    locations: dict[int, str] = {}

    def record(storage: Any, location: str) -> Any:
        locations[storage.data_ptr()] = location
        return storage

    obj = foreign.torch_load(path, opts, map_location=record, mmap=zipped, verify=verify)
    ours = from_torch_save(obj)
    if ours is not None:  # torchplace.save under a torch.save name: its own entries and metadata, as load reads them
        info.tool, state = "torchplace (torch.save file)", ours[0]
        info.metadata = {k: ours[1][k] for k in _META_SHOWN if k in ours[1]}
    else:
        info.tool, state = foreign.normalize(obj, path)
    for where, t in leaves(state):
        key = "/".join(map(str, where))
        loc = locations.get(t.untyped_storage().data_ptr())
        info.tensors.append(TensorInfo(key, dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size(), loc))
    info.contents = {k: _describe(v) for k, v in state.items()}
    model = state.get("model")
    if isinstance(model, dict):
        from .keymap import clean, leading_wrapper_note

        changed = clean(model)[2]
        if changed:
            info.notes.append(f"{changed} model keys hold torch.compile's '_orig_mod.'; load and convert remove it")
        lead = leading_wrapper_note(list(model))
        if lead:
            info.notes.append(lead)


def inspect(path: str | os.PathLike[str], *, verify: bool = False, trust_pickle: bool = False,
            progress: ProgressFn | None = None) -> CheckpointInfo:
    """Describe the checkpoint at PATH; with VERIFY, also check every data checksum (reads it all).
    PROGRESS, if given, hears the verification (see torchplace.progress)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{safeio.missing(path)} Fix: check the path.")
    kind = kind_of(path)
    folder = path.parent if kind == "pointer" else path
    newer: list = []
    series = complete_checkpoints(folder, newer=newer) if kind in ("pointer", "folder") else []
    if series:  # a run folder (save(..., keep_last=N)): what torchplace.load(folder) would load
        info = inspect(series[0], verify=verify, trust_pickle=trust_pickle, progress=progress)
        info.series = [p.name for p in series]
        via = f" (through its `{POINTER}` pointer)" if folder is not path else ""
        try:
            check_format(folder, series, newer)
            loads = f"the one torchplace.load({str(folder)!r}) loads"
        except CheckpointFormatError as exc:  # load(folder) refuses the folder: say so, not "the one it loads"
            loads = f"the newest this torchplace can read, but torchplace.load({str(folder)!r}) refuses: {exc}"
        info.notes.insert(0, f"{folder} is a run folder{via}: this is its newest complete checkpoint, "
                             f"{series[0].name}, {loads}; "
                             f"{len(series)} in the series, newest first: {', '.join(info.series)}")
        return info
    kind = "unknown" if kind in ("pointer", "folder") else kind
    info = CheckpointInfo(str(path), kind, _size(path))
    if kind == "safetensors":
        fd = open_for_read(path)
        try:
            header = read_header(path, fd)
            info.tool = "torchplace" if header.meta is not None else "safetensors"
            _from_header(header, info)
            if verify and header.meta is not None:
                with reporting(progress):
                    begin(f"verifying {path.name}")
                    verify_data(fd, header)
                info.verified = True
            elif verify:
                info.notes.append("a safetensors file has no checksums: only its structure and size were checked")
        finally:
            os.close(fd)
    elif kind in ("torch-zip", "torch-pickle"):
        _from_torch_file(path, info, ReadOptions(trust_pickle=trust_pickle), zipped=kind == "torch-zip", verify=verify)
        if verify and kind == "torch-zip":  # every member's CRC-32 was checked
            info.verified = True
        elif verify:
            info.notes.append("a legacy torch.save pickle has no checksums: only its structure was checked")
    elif kind in ("dcp", "dcp-foreign"):
        with reporting(progress):
            _from_dcp(path, info, verify)
    elif kind in ("accelerate", "index"):  # a folder of files, or the shards a sharded model's index lists
        info.tool = foreign.folder_tool(path.parent if kind == "index" else path)
        info.tool += " (save_state directory)" if info.tool == "accelerate" and kind == "accelerate" else ""
        names = foreign.index_shards(path) if kind == "index" else sorted(os.listdir(path))
        for name in names:
            child = (path.parent if kind == "index" else path) / name
            if name in foreign.INDEX_FILES and kind == "accelerate":  # its shards are in this folder too
                info.contents[name] = "the index of the model's shards, which are listed beside it"
                continue
            if not child.is_file():
                if kind == "index":
                    info.contents[name] = f"missing: {path.name} lists it, and {path.parent} has no such file"
                continue
            try:
                if kind_of(child) == "unknown":  # config.json, trainer_state.json, a README beside the weights
                    info.contents[name] = "not a checkpoint file"
                    continue
                sub = inspect(child, trust_pickle=trust_pickle)
            except CheckpointError as exc:
                info.contents[name] = "not opened: needs pickle" if "trust_pickle" in str(exc) else f"not opened: {exc}"
                continue
            info.tensors += [TensorInfo(f"{name}/{t.key}", t.dtype, t.shape, t.nbytes, t.saved_on) for t in sub.tensors]
            parts = "; ".join(f"{k}: {v}" for k, v in sub.contents.items())
            info.contents[name] = f"{len(sub.tensors)} tensors; {parts}"
    else:
        raise foreign.unknown(path)
    return info


def _from_dcp(path: Path, info: CheckpointInfo, verify: bool) -> None:
    info.tool = "torch.distributed.checkpoint" + (" (torchplace, sharded)" if (path / SIDE_FILE).is_file() else "")
    metadata = read_dcp_metadata(path)
    for key, md in sorted(getattr(metadata, "state_dict_metadata", {}).items()):
        size = getattr(md, "size", None)
        props = getattr(md, "properties", None)
        dtype = getattr(props, "dtype", None)
        if size is None or dtype is None:
            continue
        numel = 1
        for d in size:
            numel *= d
        info.tensors.append(TensorInfo(key, dtype_name(dtype), list(size), numel * dtype.itemsize,
                                       f"{len(getattr(md, 'chunks', []))} shards"))
    side = path / SIDE_FILE
    if side.is_file():
        header = read_header(side)
        meta = header.meta or {}
        info.metadata = {k: meta[k] for k in _META_SHOWN if k in meta}
        skeleton = codec.decode(meta.get("state", {"t": "dict", "v": []}), codec.TensorRef)
        info.contents = {k: _describe(v) for k, v in skeleton.items()}
        if verify:
            fd = open_for_read(side)
            try:
                begin(f"verifying {side.name}")
                verify_data(fd, header)
            finally:
                os.close(fd)
            info.notes.append("checksums cover the side file; DCP shards carry no checksums")
