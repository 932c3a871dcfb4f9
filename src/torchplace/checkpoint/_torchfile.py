"""A save under a torch.save name (`.pt`, `.pth`, `.tar`, `.ckpt`, `.bin`, `.pkl`): a file torch.load reads.

nanoGPT, pytorch/examples and Lightning Fabric read their checkpoints back with `torch.load` (whose
default is `weights_only=True` since torch 2.6) and `Fabric.load`. A checkpoint saved under such a
name is therefore written by `torch.save`, atomically, as a plain dict: the model's state dict under
"model", "optimizer", "scheduler", "scaler", every named value at the top level ("iter_num",
"model_args", ...), "extra", "rng", and torchplace's metadata under "torchplace". Before the rename,
torch's own check (`get_unsafe_globals_in_checkpoint`) must find nothing that needs
`weights_only=False`; a value that does is refused, so no reader is told to run code. Reading it back
(`torchplace.load`) restores everything a torchplace file does (`from_torch_save`).

What it cannot do, and is refused with the fix: a rotation series (`keep_last`, `latest`: they
order files by the sequence number of torchplace's header), a sharded model (a DCP folder), values
that need pickle (`allow_pickle`), and a LightningModule under a `.ckpt` name (Lightning's own
readers want Lightning's format: `trainer.save_checkpoint` writes it).
"""

from __future__ import annotations

import io
import os
import pickle
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from .atomic import FileSink, atomic_write

SUFFIXES = (".pt", ".pth", ".tar", ".ckpt", ".bin", ".pkl")  # names torch.save, pytorch/examples, Fabric, HF use
MARK = "torchplace"  # the top-level key of the file's metadata
FORMAT = "torchplace torch.save checkpoint 1"


def is_torch_name(path: Path) -> bool:
    """True for a name that promises a torch.save file (checkpoint.pth.tar included)."""
    return path.suffix.lower() in SUFFIXES


def is_lightning_module(model: Any) -> bool:
    """True for a LightningModule (by its classes' names: Lightning need not be importable)."""
    return any(c.__name__ == "LightningModule" for c in type(model).__mro__)


def refuse(path: Path, why: str) -> CheckpointError:
    """The refusal of a torch.save name for what such a file cannot hold (WHY), with the fix."""
    stem = path.name.split(".", 1)[0] or "checkpoint"
    return CheckpointError(f"save({str(path)!r}): a {path.suffix} name gets a torch.save file, which torch.load "
                           f"reads, but {why}; nothing was written. Fix: name it "
                           f"{str(path.with_name(stem + '.safetensors'))!r} (torchplace's format, which "
                           "torchplace.load reads).")


def _plain_rng(tree: Any) -> Any:
    """RNG states with numpy's key array as a tensor (a numpy array needs weights_only=False)."""
    if isinstance(tree, Mapping):
        return {k: _plain_rng(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_plain_rng(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(torch.from_numpy(v.astype(np.int64)) if isinstance(v, np.ndarray) else _plain_rng(v)
                     for v in tree)
    return tree


class _SinkFile(io.RawIOBase):
    """The write end torch.save needs, over the atomic writer's positional sink."""

    def __init__(self, sink: FileSink) -> None:
        super().__init__()
        self.sink, self.offset = sink, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.sink.pwrite(data, self.offset)
        self.offset += size
        return size


def write(target: Path, tree: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write TREE (torchplace's layout) with META to TARGET with torch.save, atomically; refuse, writing
    nothing, what torch.load(weights_only=True) would not read."""
    named = {k: v for k, v in tree.items() if k != "rng"}
    if MARK in named:
        raise CheckpointError(f"save({str(target)!r}) got named state {MARK!r}, the key of torchplace's metadata "
                              "in a torch.save file. Fix: use another name.")
    payload = {**named, **({"rng": _plain_rng(tree["rng"])} if "rng" in tree else {}),
               MARK: {"format": FORMAT, "metadata": {**meta, "created_unix": time.time()}}}

    def fill(sink: FileSink) -> None:
        try:
            torch.save(payload, _SinkFile(sink))  # type: ignore[arg-type]  # a binary writer, as IO[bytes]
        except (pickle.PicklingError, AttributeError, TypeError) as exc:  # a lambda, a local class, a lock
            raise CheckpointError(f"save({str(target)!r}): torch.save cannot write the state ({type(exc).__name__}: "
                                  f"{str(exc)[:200]}); nothing was written. Fix: save plain data (numbers, strings, "
                                  "lists, dicts, tensors).") from None
        with os.fdopen(os.dup(sink.fd), "rb") as fh:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(fh)
        if unsafe:
            raise CheckpointError(
                f"save({str(target)!r}): the state holds values torch.load(weights_only=True) refuses "
                f"({', '.join(unsafe[:5])}), so readers would have to run code from the file; nothing was "
                "written. Fix: save plain data (numbers, strings, lists, dicts, tensors): e.g. parsed arguments "
                "as vars(args), a dataclass config as dataclasses.asdict(config), a numpy value as .tolist().")

    return atomic_write(target, fill)


def read_meta(path: Path) -> dict[str, Any] | None:
    """The metadata of a file `write` made at PATH, else None (another tool's file, or no torch.save file).
    Read as a folder's newest checkpoint is chosen: torch.load with weights_only, its tensors mapped, not read."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # torch.load's errors for what is not a zip torch.save file of plain data are many
        return None
    ours = from_torch_save(obj)
    return ours[1] if ours is not None else None


def from_torch_save(obj: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(state, metadata) of what torch.load gave for a file `write` made, else None."""
    mark = obj.get(MARK) if isinstance(obj, Mapping) else None
    if not isinstance(mark, Mapping) or mark.get("format") != FORMAT:
        return None
    meta = mark.get("metadata")
    return {k: v for k, v in obj.items() if k != MARK}, dict(meta) if isinstance(meta, Mapping) else {}
