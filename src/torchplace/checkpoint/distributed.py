"""Checkpoints in a process group: one writer, everyone told the outcome; sharded models to DCP.

- Replicated models (DDP, or any run where every rank holds the full weights): every rank calls
  `save`, only rank 0 writes, and rank 0 then broadcasts whether it succeeded, so no rank returns
  before the file is complete and none reports a success rank 0 did not have. RNG states are
  gathered from every rank first, so each rank resumes its own streams.
- Sharded models (FSDP, DTensor parameters): torchplace does not write its own sharding. Tensors
  go through torch.distributed.checkpoint (each rank writes its shards, in parallel), into a
  temporary directory that is then published atomically by swapping a symlink; everything that
  is not a sharded tensor (scheduler, scaler, RNG, extras, hyperparameters) goes in a torchplace
  file inside it.
- Plain DCP folders (written by torch alone, no side file): the model's (and optimizer's) state
  is read through DCP with the same reader, mapped onto the objects given (`read_plain`).

Safety: DCP keeps its metadata as a pickle and every non-tensor value as a torch.save pickle, and
torch's own reader unpickles both without limits. torchplace reads `.metadata` with an unpickler
that only builds DCP's own record classes, checks every record against the folder's real files,
and reads the other pickles with torch.load(weights_only=True) (`SafeLoadPlanner`): no code from
the files runs unless the caller passed trust_pickle=True.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import secrets
import shutil
import stat
import warnings
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from .atomic import fsync_dir
from .codec import PICKLE_FIX, TensorRef
from .state_dicts import unwrap

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


def is_dcp_dir(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def read_dcp_metadata(path: Path) -> Any:
    """DCP's metadata record of the checkpoint at PATH, read without running code."""
    where = path / ".metadata"
    with open(where, "rb") as fh:
        try:
            return _SafeUnpickler(fh).load()
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{where} needs more than DCP's own records to load ({exc}); torchplace does not "
                                  f"run code from checkpoints. {PICKLE_FIX}") from None
        except (Exception, RecursionError) as exc:  # truncated or malformed: any error of the unpickler
            raise CheckpointError(f"{where} cannot be read as DCP metadata ({type(exc).__name__}: "
                                  f"{_first_line(exc)}). Fix: check that the checkpoint folder was copied "
                                  "completely.") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _nbytes(sizes: Any, dtype: Any) -> int:
    numel = 1
    for d in sizes:
        numel *= int(d)
    return numel * dtype.itemsize


def check_storage(root: Path, metadata: Any) -> None:
    """Refuse DCP metadata whose records point outside ROOT, past the end of a file, or at fewer
    bytes than the tensors they declare; so reading costs no more memory than the files hold."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    where = root / ".metadata"
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{where} lacks the entry and storage tables DCP writes. Fix: point at a folder "
                              "written by torch.distributed.checkpoint.save.")
    base = root.resolve()
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        rel, offset, length = (getattr(info, "relative_path", None), getattr(info, "offset", None),
                               getattr(info, "length", None))
        if not isinstance(rel, str) or not all(type(v) is int and v >= 0 for v in (offset, length)):
            raise CheckpointError(f"{where}: the storage record of {getattr(index, 'fqn', index)!r} is malformed "
                                  f"(file {rel!r}, offset {offset!r}, length {length!r}). Fix: re-save the checkpoint.")
        if rel not in sizes:
            file = root / rel
            if Path(rel).is_absolute() or ".." in Path(rel).parts or not file.resolve().is_relative_to(base):
                raise CheckpointError(f"{where} names {rel!r}, which is outside {root}; torchplace reads only the "
                                      "checkpoint's own files. Fix: use a checkpoint folder as DCP writes it.")
            try:
                st = file.stat()
            except OSError as exc:
                raise CheckpointError(f"{where} names {rel!r}, which cannot be opened ({exc.strerror}). Fix: copy "
                                      "the whole checkpoint folder.") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{root / rel} is not a regular file. Fix: use a checkpoint folder as DCP "
                                      "writes it.")
            sizes[rel] = st.st_size
        if offset + length > sizes[rel]:
            raise CheckpointError(f"{root / rel} has {sizes[rel]} bytes, but {where} places "
                                  f"{getattr(index, 'fqn', index)!r} at bytes {offset}..{offset + length}. "
                                  "Fix: the file is truncated or the metadata is not its own; copy the folder again.")
    total = 0
    for fqn, md in entries.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        dtype = getattr(md.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(md.size, torch.Size) or any(d < 0 for d in md.size):
            raise CheckpointError(f"{where}: {fqn!r} declares a malformed tensor (dtype {dtype!r}, size "
                                  f"{md.size!r}). Fix: re-save the checkpoint.")
        total += _nbytes(md.size, dtype)
        declared = sum(_nbytes(c.sizes, dtype) for c in md.chunks)
        if declared < _nbytes(md.size, dtype):
            raise CheckpointError(f"{where}: the chunks of {fqn!r} cover {declared} bytes of its "
                                  f"{_nbytes(md.size, dtype)}. Fix: re-save the checkpoint.")
        for chunk in md.chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                raise CheckpointError(f"{where}: a chunk of {fqn!r} (at {list(chunk.offsets)}) has no storage record. "
                                      "Fix: copy the whole checkpoint folder.")
            if not info.transform_descriptors and info.length < _nbytes(chunk.sizes, dtype):
                raise CheckpointError(f"{root / info.relative_path}: {fqn!r} declares "
                                      f"{_nbytes(chunk.sizes, dtype)} bytes but stores {info.length}. Fix: the "
                                      "metadata is not this folder's own; copy the folder again.")
    compressed = any(getattr(info, "transform_descriptors", None) for info in storage.values())
    if not compressed and total > sum(sizes.values()):
        raise CheckpointError(f"{where} declares {total} bytes of tensors, but its files hold {sum(sizes.values())}. "
                              "Fix: the metadata is not this folder's own; copy the folder again.")


def _reader_classes() -> tuple[type, type]:
    """(SafeReader, SafeLoadPlanner), built on first use so importing torchplace does not import DCP."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file reader, except that `.metadata` goes through torchplace's restricted unpickler
        (unless trust_pickle) and its records are checked (`check_storage`) before anything is read.
        Tensor items are read by DCP itself with torch.load(weights_only=True): no code runs."""

        def __init__(self, root: Path, trust_pickle: bool) -> None:
            super().__init__(str(root))
            self.root, self.trust_pickle = root, trust_pickle

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.trust_pickle:
                metadata = super().read_metadata(*args, **kwargs)
            else:
                metadata = read_dcp_metadata(self.root)
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
            check_storage(self.root, metadata)
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's load planner, except that non-tensor (BYTE_IO) items never run code.

        DCP stores each non-tensor value as a torch.save pickle, and DefaultLoadPlanner.load_bytes
        reads it with torch.load(weights_only=False): any callable named in the file runs. Here they
        are read with weights_only=True (torch's restricted unpickler: tensors, numbers, strings,
        containers, no imports), which is all that model and optimizer state hold (param groups,
        steps), so such folders still load; anything more is refused unless trust_pickle. A value
        arriving in a slot that holds a tensor must be a tensor of that shape. Keys are used as given
        (flatten_state_dict=False): callers pass flat DCP keys.
        """

        def __init__(self, root: Path, trust_pickle: bool) -> None:
            super().__init__(flatten_state_dict=False)
            self.root, self.trust_pickle = root, trust_pickle

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            info = (getattr(self.metadata, "storage_data", None) or {}).get(read_item.storage_index)
            where = self.root / info.relative_path if info is not None else self.root
            try:
                obj = torch.load(value, map_location="cpu", weights_only=not self.trust_pickle)
            except pickle.UnpicklingError as exc:
                first = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported" in ln or "GLOBAL" in ln),
                             "")
                raise CheckpointError(f"{where}: the item {fqn!r} is a pickle that needs code from the file to load"
                                      f"{f' ({first})' if first else ''}; torchplace does not run code from "
                                      f"checkpoints by default. {PICKLE_FIX}") from None
            except Exception as exc:
                raise CheckpointError(f"{where}: the item {fqn!r} cannot be read ({_first_line(exc)}). Fix: check "
                                      "that the checkpoint folder was copied completely.") from None
            current = self.state_dict.get(fqn)
            if isinstance(current, torch.Tensor):
                if not isinstance(obj, torch.Tensor) or obj.shape != current.shape:
                    got = f"a tensor of shape {list(obj.shape)}" if isinstance(obj, torch.Tensor) else \
                        f"a {type(obj).__name__}"
                    raise CheckpointError(f"{where}: the item {fqn!r} holds {got} where the model has a tensor of "
                                          f"shape {list(current.shape)}. Fix: load it into the model it was saved "
                                          "from.")
                current.detach().copy_(obj)
                return
            self.state_dict[fqn] = obj
            if fqn in self.original_state_dict:
                self.original_state_dict[fqn] = obj

    _CLASSES = (SafeReader, SafeLoadPlanner)
    return _CLASSES


_CLASSES: tuple[type, type] | None = None


def dcp_load(root: Path, dest: dict[str, Any], trust_pickle: bool) -> None:
    """torch.distributed.checkpoint.load of ROOT into the flat dict DEST, with our reader and planner;
    every failure becomes one CheckpointError (DCP wraps them in its own CheckpointException)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader_cls, planner_cls = _reader_classes()
    reader_cls(root, trust_pickle).read_metadata()  # its refusals raised as they are (DCP would bury them)
    try:
        with warnings.catch_warnings():  # one process: torch warns that it assumes exactly that
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(dest, storage_reader=reader_cls(root, trust_pickle), planner=planner_cls(root, trust_pickle),
                     no_dist=world()[1] == 1)
    except CheckpointError:
        raise
    except CheckpointException as exc:
        errors = [pair[0] if isinstance(pair, tuple) else pair for pair in exc.failures.values()]
        ours = next((e for e in errors if isinstance(e, CheckpointError)), None)
        if ours is not None:
            raise ours from None
        first = errors[0] if errors else exc
        raise CheckpointError(f"{root} could not be read through torch.distributed.checkpoint "
                              f"({type(first).__name__}: {_first_line(first)}). Fix: load it into the model (and "
                              "optimizer) it was saved from.") from None
    except (Exception, RecursionError) as exc:
        raise CheckpointError(f"{root} could not be read through torch.distributed.checkpoint "
                              f"({type(exc).__name__}: {_first_line(exc)}). Fix: load it into the model (and "
                              "optimizer) it was saved from.") from None


def load_sharded(path: Path, model: nn.Module, optimizer: Any, skeleton: dict[str, Any],
                 trust_pickle: bool) -> tuple[dict[str, Any], Any]:
    """Load DCP tensors into MODEL (and OPTIMIZER) as they are sharded now; return their state dicts."""
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
    dcp_load(path, dest, trust_pickle)
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


def _model_prefix(path: Path, entries: dict[str, Any], own: list[str]) -> str:
    """The prefix under which the checkpoint's keys hold the model's ('' or e.g. 'model.'): the one
    matching the most of the model's keys; '' and 'model.' win ties, any other tie is refused."""
    wanted = set(own)
    counts: dict[str, int] = {}
    for key in entries:
        for cut in [0] + [i + 1 for i, c in enumerate(key) if c == "."]:
            if key[cut:] in wanted:
                counts[key[:cut]] = counts.get(key[:cut], 0) + 1
    if not counts:
        held = ", ".join(sorted(entries)[:5]) + (" ..." if len(entries) > 5 else "")
        mine = ", ".join(own[:5]) + (" ..." if len(own) > 5 else "")
        raise CheckpointError(f"{path} (torch.distributed.checkpoint) holds no entry for the model's weights: it holds "
                              f"{held or 'nothing'}; the model has {mine or 'no weights'}. Fix: pass the model this "
                              "checkpoint was saved from.")
    best = max(counts.values())
    top = sorted(p for p, c in counts.items() if c == best)
    for preferred in ("", "model."):
        if preferred in top:
            return preferred
    if len(top) > 1:
        raise CheckpointError(f"{path} holds the model's weights under several prefixes ({', '.join(top)}); torchplace "
                              "will not guess which. Fix: load it with torch.distributed.checkpoint.load into a dict "
                              "keyed by the prefix you want.")
    return top[0]


def _optimizer_state(path: Path, metadata: Any) -> tuple[tuple[Any, ...], dict[str, tuple[Any, ...]]] | None:
    """(root path of the optimizer's state dict, {DCP key: path below it}) from DCP's key mapping, or None."""
    mapping = getattr(metadata, "planner_data", None)
    if not isinstance(mapping, dict):
        return None
    roots = {tuple(p[:i]) for p in mapping.values() if isinstance(p, tuple)
             for i, part in enumerate(p) if part == "param_groups"}
    if not roots:
        return None
    if len(roots) > 1:
        raise CheckpointError(f"{path} holds optimizer state under several names "
                              f"({', '.join('.'.join(map(str, r)) or '(top)' for r in sorted(roots, key=str))}); "
                              "torchplace will not guess which. Fix: load it with torch.distributed.checkpoint.load.")
    root = roots.pop()
    keys = {k: tuple(p[len(root):]) for k, p in mapping.items()
            if isinstance(p, tuple) and tuple(p[:len(root)]) == root and len(p) > len(root) + 1
            and p[len(root)] in ("state", "param_groups")}
    return root, keys


def _nest(items: dict[tuple[Any, ...], Any]) -> dict[Any, Any]:
    tree: dict[Any, Any] = {}
    for parts, value in items.items():
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _as_optimizer_state(path: Path, nested: dict[Any, Any]) -> dict[str, Any]:
    """DCP's flattened optimizer state back in the shape torch.optim's load_state_dict takes."""
    groups = nested.get("param_groups") or {}
    if not isinstance(groups, dict) or sorted(groups) != list(range(len(groups))):
        raise CheckpointError(f"{path}: the optimizer's param_groups are not numbered 0..n. Fix: load it with "
                              "torch.distributed.checkpoint.load.")
    param_groups = [groups[i] for i in range(len(groups))]
    params = [p for g in param_groups for p in (g.get("params") or [])] if all(isinstance(g, dict) for g in
                                                                                 param_groups) else [None]
    if not all(type(p) is int for p in params):
        raise CheckpointError(f"{path} holds optimizer state keyed by parameter names (torch's get_state_dict "
                              "layout), which torchplace does not map yet. Fix: load it with "
                              "torch.distributed.checkpoint.state_dict.set_state_dict, or save optimizer.state_dict().")
    state = {(int(k) if isinstance(k, str) and k.isdigit() else k): v for k, v in (nested.get("state") or {}).items()}
    return {"state": state, "param_groups": param_groups}


def read_plain(path: Path, model: nn.Module, optimizer: Any, trust_pickle: bool
               ) -> tuple[str, dict[str, Any], dict[str, Any], list[str]]:
    """Read a DCP folder written by torch alone (no side file) for MODEL (and OPTIMIZER), safely:
    ('torch.distributed.checkpoint', state tree, {}, notes). The model's tensors are allocated like
    its own and filled by DCP; optimizer state is allocated from the metadata, after `check_storage`
    has tied every declared size to bytes in the folder's files."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader_cls, _ = _reader_classes()
    metadata = reader_cls(path, trust_pickle).read_metadata()
    entries: dict[str, Any] = metadata.state_dict_metadata
    own = unwrap(model).state_dict()
    prefix = _model_prefix(path, entries, list(own))
    dest: dict[str, Any] = {}
    for key, value in own.items():
        if prefix + key in entries:
            dest[prefix + key] = torch.empty_like(value) if isinstance(value, torch.Tensor) else value
    opt_keys: dict[str, tuple[Any, ...]] = {}
    if optimizer is not None:
        found = _optimizer_state(path, metadata)
        opt_keys = found[1] if found is not None else {}
        for key in opt_keys:
            md = entries.get(key)
            dest[key] = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) \
                else None
    dcp_load(path, dest, trust_pickle)
    state: dict[str, Any] = {"model": {k: dest[prefix + k] for k in own if prefix + k in dest}}
    notes = [f"read the model's weights from the keys under {prefix!r}"] if prefix else []
    if opt_keys:
        state["optimizer"] = _as_optimizer_state(path, _nest({p: dest[k] for k, p in opt_keys.items()}))
    left = len(entries) - len(dest)
    if left:
        notes.append(f"{left} other entries of the checkpoint were not loaded")
    return "torch.distributed.checkpoint", state, {}, notes
