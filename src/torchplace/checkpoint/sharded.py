"""Checkpoints in a process group: one writer, everyone told the outcome; sharded models to DCP.

- Replicated models (DDP, or any run where every rank holds the full weights): rank 0 writes, with
  no collective, so `if rank == 0: save(...)` works (another rank's call returns once rank 0 saved the path). With
  `all_ranks=True` every rank calls `save`, the RNG states are gathered from every rank (each rank
  resumes its own streams), and rank 0 broadcasts whether it succeeded, so no rank returns before
  the file is complete and none reports a success rank 0 did not have.
- Every save that needs every rank (sharded, or `all_ranks=True`) first waits a bounded time for
  every rank to call it (`join_ranks`, through the group's store) and raises naming the absent
  ranks rather than hang in a collective.
- Sharded models (FSDP, DTensor parameters): torchplace does not write its own sharding. Tensors
  go through torch.distributed.checkpoint (each rank writes its shards, in parallel), into a
  temporary directory that is then published atomically by swapping a symlink; everything that
  is not a sharded tensor (scheduler, scaler, RNG, extras, hyperparameters) goes in a torchplace
  file inside it.
- Plain DCP folders (written by torch alone, no side file): the model's (and optimizer's) state
  is read through DCP with the same reader, mapped onto the objects given (`read_plain`).

Reading a DCP folder safely (its pickles, its records against the real files) is dcp_reader.py.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from ..shared.tree import leaves
from .atomic import fsync_dir
from .codec import TensorRef
from .dcp_reader import dcp_load, reader_classes
from .format import SIDE_FILE
from .options import ReadOptions
from .state_dicts import unwrap

T = TypeVar("T")


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


def broadcast(value: T, group: Any = None) -> T:
    """Rank 0's VALUE on every rank (of GROUP: default, the default group)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather(value: T) -> list[T]:
    """Every rank's VALUE, as a list on every rank (a collective of the default group)."""
    out: list[Any] = [None] * world()[1]
    dist.all_gather_object(out, value)
    return out


def gather(value: T) -> list[T] | None:
    """Every rank's VALUE, as a list on rank 0 (None elsewhere)."""
    rank, size = world()
    out: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


JOIN_WAIT_ENV = "TORCHPLACE_SAVE_JOIN_S"  # how long a collective save waits for every rank to call it
JOIN_WAIT_S = 60.0
_joins = [0]  # this process's collective saves so far: the n-th one of every rank meets the others' n-th


def join_wait_s() -> float:
    """Seconds a collective save waits for every rank (TORCHPLACE_SAVE_JOIN_S, default 60)."""
    raw = os.environ.get(JOIN_WAIT_ENV, "")
    try:
        value = float(raw) if raw else JOIN_WAIT_S
    except ValueError:
        value = JOIN_WAIT_S
    return value if value > 0 else JOIN_WAIT_S


def join_ranks(target: Path, why: str) -> None:
    """Before a save whose collectives need every rank (WHY names it): wait, through the process group's
    store and for at most `join_wait_s()`, until every rank has called it; raise a CheckpointError naming
    the ranks that did not, instead of waiting in a collective for ever (a save under `if rank == 0:`)."""
    import time

    store = dist.distributed_c10d._get_default_store()
    rank, size = world()
    key = f"torchplace/save-join/{_joins[0]}"
    store.add(f"{key}/{rank}", 1)
    arrived = store.add(key, 1)
    deadline = time.monotonic() + join_wait_s()
    while arrived < size and time.monotonic() < deadline:
        time.sleep(0.02)
        arrived = store.add(key, 0)
    if arrived >= size:
        _joins[0] += 1
        return
    store.add(key, -1)  # withdrawn: this rank's next collective save meets the others' at this one
    store.add(f"{key}/{rank}", -1)
    absent = [r for r in range(size) if r != rank and store.add(f"{key}/{r}", 0) < 1]
    raise CheckpointError(
        f"save({target}) was called on rank {rank} only ({len(absent)} of {size} ranks did not call it within "
        f"{join_wait_s():g} s: rank(s) {', '.join(map(str, absent[:8]))}{' ...' if len(absent) > 8 else ''}), but "
        f"{why} needs every rank; nothing was written. Fix: call it on every rank (not under `if rank == 0:`); a "
        f"model that is not sharded can be saved by rank 0 alone without all_ranks=True. ({JOIN_WAIT_ENV} sets the "
        "wait.)")


_alone: dict[str, int] = {}  # this process's saves per path written by rank 0 alone: the n-th meets rank 0's n-th


class AloneSave:
    """A save rank 0 writes with no collective (`if rank == 0: save(...)` works), as every rank sees it in the
    group's store: rank 0 posts its outcome (`post`), and another rank's call waits for it (`wait`): its n-th call
    for a path meets rank 0's n-th, so a rank that reads the file right after (imagenet's copy to
    model_best.pth.tar, on every rank) finds the new one."""

    def __init__(self, target: Path) -> None:
        self.target, self.rank = target, world()[0]
        self.path = str(target)  # as the program names it: each rank computes it alike, whatever a node's mounts
        self.count = _alone[self.path] = _alone.get(self.path, 0) + 1
        self.key = f"torchplace/save-alone/{self.path}/{self.count}"
        self.store = dist.distributed_c10d._get_default_store()

    def post(self, error: BaseException | None = None, writing: bool = False) -> None:
        """On rank 0: the save began (WRITING), succeeded (no ERROR) or failed with ERROR."""
        self.store.set(self.key, "writing" if writing else "ok" if error is None else
                       f"failed: {type(error).__name__}: {error}")

    def wait(self) -> None:
        """On another rank: return once rank 0's save is complete, or raise its failure. Where rank 0 has not begun
        it within `join_wait_s()` (the ranks decided apart, e.g. a best-so-far judged by each rank's own metric, or
        a rank's own file name), warn naming the fix and return: nothing written here, training goes on."""
        import time
        import warnings

        from ..errors import TorchplaceWarning

        deadline = time.monotonic() + join_wait_s()
        while not self.store.check([self.key]):
            if time.monotonic() > deadline:
                _alone[self.path] -= 1  # this call met no save of rank 0's: the next one meets rank 0's next
                warnings.warn(TorchplaceWarning(
                    f"save({self.path!r}) on rank {self.rank}: in a process group rank 0 writes every checkpoint, "
                    f"and rank 0 has not saved this path within {join_wait_s():g} s ({JOIN_WAIT_ENV} sets the wait), "
                    "so this call wrote nothing. Fix: decide the save on rank 0 (`if rank == 0:`) or alike on every "
                    "rank (a best-so-far judged by an all-reduced metric, not each rank's own), under one name for all "
                    "ranks; all_ranks=True gathers every rank's RNG state into rank 0's file."), stacklevel=4)
                return
            time.sleep(0.02)
        while (state := self.store.get(self.key)) == b"writing":  # rank 0 is writing: as long as its write takes
            time.sleep(0.02)
        if state != b"ok":
            raise CheckpointError(f"rank 0 could not save {self.target}, so no rank has a new checkpoint: "
                                  f"{state.decode(errors='replace')[len('failed: '):]}")


def rank0_alone(write: Callable[[], T], target: Path) -> T | None:
    """Run WRITE on rank 0 (another rank waits for it) with no collective: `AloneSave`."""
    save = AloneSave(target)
    if save.rank != 0:
        save.wait()
        return None
    save.post(writing=True)
    try:
        result = write()
    except BaseException as exc:
        save.post(exc)
        raise
    save.post()
    return result


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


def publish_folder(tmp_dir: Path, target: Path, token: str) -> None:
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


def published(target: Path, tmp_dir: Path) -> bool:
    """True when TARGET is the symlink `publish_folder` made to TMP_DIR (once true, TMP_DIR is the checkpoint)."""
    return target.is_symlink() and os.readlink(target) == tmp_dir.name


def discard_unpublished(tmp_dir: Path, target: Path) -> None:
    """Remove TMP_DIR unless TARGET points at it: a sharded save that failed before its publish."""
    if not published(target, tmp_dir):
        shutil.rmtree(tmp_dir, ignore_errors=True)  # never published: nothing points at it


def dcp_folder(target: Path, token: str) -> Path:
    """The temporary folder a sharded save of TARGET writes into before `publish_folder` (TOKEN: one per
    save, the same on every rank)."""
    return target.with_name(f".{target.name}.dcp-{token}")


def save_sharded(target: Path, model: nn.Module, optimizer: Any, write_side: Callable[[Path, Any], None]) -> Path:
    """Save a sharded MODEL (and OPTIMIZER) through DCP; WRITE_SIDE(path, skeleton) writes the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    token = broadcast(secrets.token_hex(4))
    tmp_dir = dcp_folder(target, token)
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
            publish_folder(tmp_dir, target, token)
        except BaseException:
            discard_unpublished(tmp_dir, target)
            raise
        return target

    on_rank0(publish, target)
    return target


def load_sharded(path: Path, model: nn.Module, optimizer: Any, skeleton: dict[str, Any],
                 opts: ReadOptions) -> tuple[dict[str, Any], Any]:
    """Load DCP tensors into MODEL (and OPTIMIZER) as they are sharded now; return their state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    current = {"model": msd, **({"optimizer": osd} if optimizer is not None else {})}
    dest, _ = flat_tensors(current)
    saved_keys = set(flat_tensors(skeleton)[0]) | {r.key for _, r in leaves(skeleton, TensorRef)}
    wanted = {k for k in dest if k.startswith("model/") or optimizer is not None}
    missing = sorted(wanted - saved_keys)
    if missing:
        raise CheckpointError(f"{path} has no tensors for {', '.join(missing[:5])}"
                              f"{' and more' if len(missing) > 5 else ''}. Fix: load with the model (and optimizer) "
                              "the checkpoint was saved from, sharded the same way or differently.")
    dcp_load(path, dest, opts, single_process=world()[1] == 1)
    new_osd = fill_refs(skeleton["optimizer"], dest) if optimizer is not None and "optimizer" in skeleton else None
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=msd,
                   optim_state_dict=new_osd if new_osd is not None else {})
    return msd, new_osd


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


def read_plain(path: Path, model: nn.Module, optimizer: Any, opts: ReadOptions
               ) -> tuple[str, dict[str, Any], dict[str, Any], list[str], None]:
    """Read a DCP folder written by torch alone (no side file) for MODEL (and OPTIMIZER), safely:
    ('torch.distributed.checkpoint', state tree, {}, notes, None). The model's tensors are allocated like
    its own and filled by DCP; optimizer state is allocated from the metadata, after `check_storage`
    has tied every declared size to bytes in the folder's files."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader_cls, _ = reader_classes()
    metadata = reader_cls(path, opts.trust_pickle).read_metadata()
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
            if not isinstance(md, TensorStorageMetadata):
                dest[key] = None
                continue
            try:
                dest[key] = torch.empty(md.size, dtype=md.properties.dtype)
            except RuntimeError as exc:  # torch's allocator refused: more than this machine can hold
                raise CheckpointError(f"{path}: the optimizer state {key!r} is {list(md.size)} {md.properties.dtype}, "
                                      f"which cannot be allocated here ({str(exc).splitlines()[0][:200]}). Fix: load "
                                      "it on a machine with the memory it was saved on.") from None
    dcp_load(path, dest, opts, single_process=world()[1] == 1)
    state: dict[str, Any] = {"model": {k: dest[prefix + k] for k in own if prefix + k in dest}}
    notes = [f"read the model's weights from the keys under {prefix!r}"] if prefix else []
    if opt_keys:
        state["optimizer"] = _as_optimizer_state(path, _nest({p: dest[k] for k, p in opt_keys.items()}))
    left = len(entries) - len(dest)
    if left:
        notes.append(f"{left} other entries of the checkpoint were not loaded")
    return "torch.distributed.checkpoint", state, {}, notes, None
