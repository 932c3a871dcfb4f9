"""Checkpoints in a process group: one writer, everyone told the outcome; sharded models to DCP.

- Replicated models (DDP, or any run where every rank holds the full weights): every rank calls
  `save`, only rank 0 writes, and rank 0 then broadcasts whether it succeeded, so no rank returns
  before the file is complete and none reports a success rank 0 did not have. RNG states are
  gathered from every rank first, so each rank resumes its own streams.
- Sharded models (FSDP, DTensor parameters): torchplace does not write its own sharding. Tensors
  go through torch.distributed.checkpoint (each rank writes its shards, in parallel), into a
  temporary directory that is then published atomically by swapping a symlink; everything that
  is not a sharded tensor (scheduler, scaler, RNG, extras, hyperparameters) goes in a torchplace
  file inside it. DCP keeps its own metadata as a pickle; torchplace reads it with an unpickler
  that only builds DCP's own record classes, so loading still runs no code from the files.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from .atomic import fsync_dir
from .codec import PICKLE_FIX, TensorRef
from .state import unwrap

T = TypeVar("T")
SIDE_FILE = "torchplace.safetensors"


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        return None
    return DTensor


def is_sharded(model: nn.Module | None) -> bool:
    """True for FSDP-wrapped models and models holding DTensor parameters (FSDP2, tensor parallel)."""
    if model is None or not dist.is_available() or not dist.is_initialized():
        return False  # FSDP and DTensor both need a process group
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return True
    except ImportError:  # pragma: no cover
        pass
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in unwrap(model).parameters())


def broadcast(value: T) -> T:
    """Rank 0's VALUE on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value: T) -> list[T] | None:
    """Every rank's VALUE, as a list on rank 0 (None elsewhere)."""
    rank, size = world()
    out: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def on_rank0(write: Callable[[], T], target: Path) -> T | None:
    """Run WRITE on rank 0 only; every rank returns after it, or raises if it failed."""
    rank, _ = world()
    result, error, status = None, None, (True, "")
    if rank == 0:
        try:
            result = write()
        except BaseException as exc:  # report to the others, then re-raise here
            error, status = exc, (False, f"{type(exc).__name__}: {exc}")
    ok, message = broadcast(status)
    if error is not None:
        raise error
    if not ok:
        raise CheckpointError(f"rank 0 could not save {target}, so no rank has a new checkpoint: {message}")
    return result


def flat_tensors(tree: Any, prefix: tuple[Any, ...] = ()) -> tuple[dict[str, torch.Tensor], Any]:
    """Pull every tensor out of TREE: ({'a/b/c': tensor}, the tree with TensorRefs in their place)."""
    out: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, torch.Tensor):
            key = "/".join(str(p) for p in path)
            out[key] = node
            return TensorRef(key)
        if isinstance(node, dict):
            return {k: walk(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, path + (i,)) for i, v in enumerate(node)]
        if type(node) is tuple:
            return tuple(walk(v, path + (i,)) for i, v in enumerate(node))
        return node

    return out, walk(tree, prefix)


def fill_refs(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace TensorRefs in TREE by TENSORS[key]."""
    if isinstance(tree, TensorRef):
        return tensors[tree.key]
    if isinstance(tree, dict):
        return {k: fill_refs(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [fill_refs(v, tensors) for v in tree]
    if type(tree) is tuple:
        return tuple(fill_refs(v, tensors) for v in tree)
    return tree


def _publish(tmp_dir: Path, target: Path, token: str) -> None:
    """Make TARGET point at TMP_DIR atomically (a symlink swap); remove what it replaced."""
    fsync_dir(tmp_dir)
    link = target.with_name(f".{target.name}.link-{token}")
    os.symlink(tmp_dir.name, link)
    old: Path | None = None
    if target.is_symlink():
        old = target.parent / os.readlink(target)
    elif target.exists():
        old = target.with_name(f".{target.name}.old-{token}")
        os.replace(target, old)
    os.replace(link, target)
    fsync_dir(target.parent)
    ours = old is not None and old.parent == target.parent and old.name.startswith(f".{target.name}.")
    if ours and old is not None and old.resolve() != tmp_dir.resolve():  # never a directory we did not make
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def save_sharded(target: Path, model: nn.Module, optimizer: Any, write_side: Callable[[Path, Any], None]) -> Path:
    """Save a sharded MODEL (and OPTIMIZER) through DCP; WRITE_SIDE(path, skeleton) writes the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    token = broadcast(secrets.token_hex(4))
    tmp_dir = target.with_name(f".{target.name}.dcp-{token}")
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    tensors, skeleton = flat_tensors({"model": msd, **({"optimizer": osd} if optimizer is not None else {})})
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp_dir)))
    except BaseException:
        if world()[0] == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise

    def publish() -> Path:
        try:
            write_side(tmp_dir / SIDE_FILE, skeleton)
            _publish(tmp_dir, target, token)
        except BaseException:
            if not (target.is_symlink() and os.readlink(target) == tmp_dir.name):
                shutil.rmtree(tmp_dir, ignore_errors=True)  # never published: nothing points at it
            raise
        return target

    on_rank0(publish, target)
    return target


class _SafeUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata records, torch sizes/dtypes and paths; refuses anything else."""

    _EXACT = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
              ("pathlib", "PureWindowsPath"), ("pathlib", "Path")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._EXACT:
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def _reader(path: Path, trust_pickle: bool) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    if trust_pickle:
        return FileSystemReader(str(path))

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(Path(self.path) / ".metadata", "rb") as fh:
                try:
                    metadata = _SafeUnpickler(fh).load()
                except pickle.UnpicklingError as exc:
                    raise CheckpointError(f"{path}/.metadata needs more than DCP's own records to load ({exc}); "
                                          f"torchplace does not run code from checkpoints. {PICKLE_FIX}") from None
            storage_meta = getattr(metadata, "storage_meta", None)
            if storage_meta is None and hasattr(metadata, "storage_meta"):
                from torch.distributed.checkpoint.metadata import StorageMeta
                storage_meta = metadata.storage_meta = StorageMeta()
            if storage_meta is not None and hasattr(storage_meta, "load_id"):
                storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    return SafeReader(str(path))


def is_dcp_dir(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def read_dcp_metadata(path: Path) -> Any:
    """DCP's metadata record of the checkpoint at PATH, read without running code."""
    with open(path / ".metadata", "rb") as fh:
        try:
            return _SafeUnpickler(fh).load()
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{path}/.metadata needs more than DCP's own records to load ({exc}). "
                                  f"{PICKLE_FIX}") from None


def load_sharded(path: Path, model: nn.Module, optimizer: Any, skeleton: dict[str, Any],
                 trust_pickle: bool) -> tuple[dict[str, Any], Any]:
    """Load DCP tensors into MODEL (and OPTIMIZER) as they are sharded now; return their state dicts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    current = {"model": msd, **({"optimizer": osd} if optimizer is not None else {})}
    dest, _ = flat_tensors(current)
    saved_keys = set(flat_tensors(skeleton)[0]) | {r.key for r in _refs(skeleton)}
    wanted = {k for k in dest if k.startswith("model/") or optimizer is not None}
    missing = sorted(wanted - saved_keys)
    if missing:
        raise CheckpointError(f"{path} has no tensors for {', '.join(missing[:5])}"
                              f"{' and more' if len(missing) > 5 else ''}. Fix: load with the model (and optimizer) "
                              "the checkpoint was saved from, sharded the same way or differently.")
    dcp.load(dest, storage_reader=_reader(path, trust_pickle))
    new_osd = fill_refs(skeleton["optimizer"], dest) if optimizer is not None and "optimizer" in skeleton else None
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=msd,
                   optim_state_dict=new_osd if new_osd is not None else {})
    return msd, new_osd


def _refs(tree: Any) -> list[TensorRef]:
    if isinstance(tree, TensorRef):
        return [tree]
    if isinstance(tree, dict):
        return [r for v in tree.values() for r in _refs(v)]
    if isinstance(tree, (list, tuple)):
        return [r for v in tree for r in _refs(v)]
    return []
