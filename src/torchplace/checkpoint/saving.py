"""`torchplace.save`: checkpoints that never tear.

    torchplace.save("ckpt/step-000300.safetensors", model=model, optimizer=opt, scheduler=sched,
                    scaler=scaler, extra={"step": 300}, keep_last=3)

Save writes model weights (unwrapped: no `module.` / `_orig_mod.`, not even from compiled
submodules, with the modules' versions), optimizer, scheduler, scaler, RNG states, extras and
metadata as one safetensors-compatible file, atomically, with checksums (or, under a .pt/.pth/.tar/.ckpt/.bin/.pkl
name, as the torch.save file such a name promises: _torchfile.py). In a process group only
rank 0 writes; sharded models go through torch.distributed.checkpoint (see `distributed`).
Reading it back is loading.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from . import _torchfile as torchfile
from . import rng
from . import sharded as tpsharded
from .fileio import write_file
from .rotation import HF_WEIGHT_NAMES, check_name, check_pointer_slot, next_sequence, rotate, series_lock
from .state_dicts import clean_state, module_device, state_of, unwrap, versions_of

RESERVED = ("model", "optimizer", "scheduler", "scaler", "extra", "rng")


def _primary_device(model: Any, tree: dict[str, Any]) -> str:
    if isinstance(model, nn.Module):
        return str(module_device(model))
    for value in (tree.get("model") or {}).values():
        if isinstance(value, torch.Tensor):
            return str(value.device)
    return "cpu"


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _collect(model: Any, optimizer: Any, scheduler: Any, scaler: Any, extra: Any,
             more_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    tree: dict[str, Any] = {}
    objects: dict[str, str] = {}
    for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            tree[name] = state_of(obj, name)
            if name == "model":  # a state dict given as such: cleaned like a module's own
                tree[name] = clean_state(tree[name])
            objects[name] = _type_name(unwrap(obj) if isinstance(obj, nn.Module) else obj)
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra= must be a mapping (e.g. {{'step': 300}}), not {type(extra).__name__}")
        tree["extra"] = dict(extra)
    for name, obj in more_state.items():
        stateful = not isinstance(obj, (Mapping, torch.Tensor)) and callable(getattr(obj, "state_dict", None))
        tree[name] = state_of(obj, name) if stateful else obj
        if stateful:
            objects[name] = _type_name(obj)
    return tree, objects



def check_request(path: str | os.PathLike[str], keep_last: int | None, more_state: Mapping[str, Any],
                  torch_names: bool = False) -> Path:
    """PATH as a Path, after the checks every save makes before touching anything. TORCH_NAMES: the caller
    writes a torch.save file under a torch name (_torchfile.SUFFIXES); otherwise such a name is refused."""
    bad = [k for k in more_state if k in RESERVED]
    if bad:
        raise TypeError(f"save() got {bad[0]!r} as named state; that name is reserved. Use another name.")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r}: keep at least 1 checkpoint (or None to keep all).")
    target = Path(path)
    check_name(target)  # the pointer's name: a checkpoint saved there would be overwritten by it
    if HF_WEIGHT_NAMES.fullmatch(target.name):
        raise CheckpointError(
            f"save({str(target)!r}): {target.name} is the name transformers and accelerate read as a model's "
            "plain weights; nothing was written.\n"
            "Fix: save under another name (step-000100.safetensors), and write the weights they read with "
            f"`torchplace ckpt convert --weights-only CHECKPOINT {target.name}`.\n"
            "Why: from_pretrained, load_state and load_checkpoint_in_model would load none of a torchplace "
            "checkpoint's tensors, which are named 'model/...' beside the optimizer's and RNG states.")
    if not torch_names and torchfile.is_torch_name(target):
        raise torchfile.refuse(target, "save_async writes torchplace's own format (torchplace.save writes the "
                                       "torch.save file)")
    return target


def not_a_path(call: str, given: Any, otherwise: str) -> TypeError:
    """The TypeError for GIVEN where CALL takes a path: for an open file (word_language_model's `with open(...) as
    f: torch.save(model, f)`), that torchplace reads and writes by name; else OTHERWISE."""
    name = getattr(given, "name", None)
    if not (callable(getattr(given, "read", None)) or callable(getattr(given, "write", None))):
        return TypeError(otherwise)
    return TypeError(f"{call}() got an open file ({type(given).__name__}); torchplace takes the file's path: it writes "
                     "a temporary file and renames it over the target (atomic), and reads it with its own threads. "
                     f"Fix: pass the path{f' ({name!r}: f.name)' if isinstance(name, str) else ''} instead of the "
                     "open file.")


def torch_order(call: str, obj: Any, f: Any,
                given: Mapping[str, Any]) -> tuple[str | os.PathLike[str], dict[str, Any], bool]:
    """CALL(obj, f), torch.save's order: (the path F, the keywords OBJ stands for with GIVEN, the state given by name,
    whether OBJ alone is all: a model's weights, to save as `torch.save(state_dict, f)` does). A module or a state
    dict is the model; any other mapping (nanoGPT's, imagenet's checkpoint dict) is named state, each entry at the
    file's top level. `CALL(path, state)` means the same: only the path can be a str."""
    if isinstance(obj, (str, os.PathLike)) and isinstance(f, (nn.Module, Mapping)):
        obj, f = f, obj
    if not isinstance(f, (str, os.PathLike)):
        raise not_a_path(call, f, f"{call}({type(obj).__name__}, {type(f).__name__}): the second argument, as in "
                                  f"torch.save, is the path. Fix: {call}(path, model=model, optimizer=opt, ...) or "
                                  f"{call}(state, path).")
    if isinstance(obj, nn.Module) or (isinstance(obj, Mapping) and obj
                                      and all(isinstance(v, torch.Tensor) for v in obj.values())):
        if given.get("model") is not None:
            raise TypeError(f"{call}(state, path, model=...): the model is given twice. Fix: {call}(path, "
                            f"model=model, ...) or {call}(model.state_dict(), path).")
        return f, {**given, "model": obj}, all(v is None for v in given.values())
    if isinstance(obj, Mapping) and all(isinstance(k, str) for k in obj):
        twice = sorted(set(obj) & {k for k, v in given.items() if v is not None})
        if twice:
            raise TypeError(f"{call}(state, path, {twice[0]}=...): {twice[0]!r} is given twice, in the dict and by "
                            "name. Fix: give it once.")
        return f, {**given, **obj}, False
    raise TypeError(f"{call}({type(obj).__name__}, {str(f)!r}): torchplace saves a module, a state dict or a dict "
                    f"of named entries, never a pickled object. Fix: {call}({str(f)!r}, model=model, ...), or "
                    f"{call}({{'name': value, ...}}, {str(f)!r}).")


def capture_rng(rng_state: bool, world_size: int) -> Any:
    """The RNG states to save (every rank's, gathered on rank 0, in a process group), or None."""
    rng_tree: Any = rng.capture() if rng_state else None
    if world_size > 1 and rng_state:
        rng_tree = {"per_rank": tpsharded.gather(rng_tree)}
    return rng_tree


def collect_state(model: Any, optimizer: Any, scheduler: Any, scaler: Any, extra: Any, more_state: dict[str, Any],
                  rng_tree: Any, info: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the state tree to write, its metadata but for the rotation sequence) of an unsharded save."""
    tree, objects = _collect(model, optimizer, scheduler, scaler, extra, more_state)
    if rng_tree is not None:
        tree["rng"] = rng_tree
    meta = {**info, "objects": objects, "primary_device": _primary_device(model, tree), **_versions_info(tree)}
    return tree, meta


def collect_side(model: nn.Module, scheduler: Any, scaler: Any, extra: Any, more_state: dict[str, Any],
                 skeleton: dict[str, Any], rng_tree: Any,
                 info: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the side file's tree, its metadata but for the rotation sequence) of a sharded save: everything
    but the sharded tensors, with SKELETON (the model's and optimizer's trees, TensorRefs for DCP's tensors)."""
    tree, objects = _collect(None, None, scheduler, scaler, extra, more_state)
    tree.update(skeleton)
    if rng_tree is not None:
        tree["rng"] = rng_tree
    meta = {**info, "sharded": True, "objects": {**objects, "model": _type_name(unwrap(model))},
            "primary_device": str(module_device(model))}
    return tree, meta


def series_info(target: Path, rotate_after: bool) -> dict[str, Any]:
    """On the writing rank, right before writing: the rotation series' next sequence number."""
    if not rotate_after:
        return {}
    check_pointer_slot(target.parent)
    return {"sequence": next_sequence(target.parent)}


def save(path: str | os.PathLike[str] | nn.Module | Mapping[str, Any], f: str | os.PathLike[str] | None = None, /, *,
         model: nn.Module | Mapping[str, Any] | None = None,
         optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
         extra: Mapping[str, Any] | None = None, keep_last: int | None = None, latest: bool = False,
         rng_state: bool = True, allow_pickle: bool = False, all_ranks: bool = False, weights_only: bool = False,
         **more_state: Any) -> Path:
    """Save what is needed to resume training to PATH, atomically; return PATH.

    The file is written next to PATH and renamed into place once complete, so a crash leaves the
    previous file intact. Tensors are stored as safetensors with checksums, with the device each
    came from, so the checkpoint loads anywhere (a GPU job's file on a laptop and back).

    `save(state, path)`, torch.save's order, works too: a module or state dict alone is written as
    `weights_only=True` does, what `torch.save(model.state_dict(), path)` writes; a dict of entries
    (nanoGPT's `checkpoint`) is saved as named state, `save(path, **checkpoint)`. `save(path, state)` too.

    Args:
        path: the file to write; its directory must exist. ".pt", ".pth", ".tar", ".ckpt", ".bin" or ".pkl":
            a torch.save file that torch.load (weights_only) and Fabric.load read, named values at its top level
            (no keep_last/latest there). Any other name (".safetensors", ".tpck", none): torchplace's format.
        f: the path, when PATH is the state, as in `torch.save(state, f)`.
        model: a module or its state dict.
        optimizer: an optimizer or its state dict.
        scheduler: a learning-rate scheduler or its state dict.
        scaler: a GradScaler or its state dict.
        extra: plain data (numbers, strings, lists, dicts, tensors) such as the step or a config.
        keep_last: also update the directory's `latest` pointer and delete all but the newest N
            checkpoints saved this way (ordered by a sequence number, never the clock).
        latest: update the `latest` pointer and keep every checkpoint.
        rng_state: also save the Python, numpy, CPU and CUDA generator states.
        allow_pickle: store values that only pickle can (loading them needs `trust_pickle=True`).
        all_ranks: in a process group, every rank calls save: each rank's RNG states are gathered
            into the file, and every rank returns once it is complete (or raises rank 0's failure).
        weights_only: write the model's state dict alone, as its own readers take it: under a .pt/.pth/.bin name
            what `model.load_state_dict(torch.load(path))` takes, under any other name a plain safetensors file
            (`model.safetensors` for HF's `from_pretrained`); nothing else may be given. No RNG, no resume.
        **more_state: more named objects with `state_dict()` (an EMA model, a sampler) or plain
            values; `load` gives them back by name.

    Returns:
        PATH, as a `pathlib.Path`.

    Raises:
        CheckpointError: the file cannot be written completely (full disk, read-only or missing
            directory), PATH is named `latest`, or rotation would replace a `latest` that is not a
            pointer; the previous file at PATH is then untouched.

    In a process group rank 0 writes, with no collective: `if rank == 0: save(...)` works, and a call
    on another rank writes nothing and returns once rank 0 has saved the same path (its RNG states are
    not in the file unless `all_ranks=True`), or warns and returns where rank 0 does not begin that save
    within TORCHPLACE_SAVE_JOIN_S (60 s). A sharded model (FSDP, DTensor) needs every rank: called on
    some ranks only, save raises within TORCHPLACE_SAVE_JOIN_S (60 s) naming the ranks absent, as with `all_ranks=True`.
    `torchplace.save_async` saves with training going on while the file is written (every rank calls it).

    Example:
        ```python
        import os
        import torch
        import torchplace as tp

        model = torch.nn.Linear(4, 2)
        opt = torch.optim.Adam(model.parameters())
        os.makedirs("runs", exist_ok=True)
        tp.save("runs/step-000100.safetensors", model=model, optimizer=opt, extra={"step": 100}, keep_last=3)
        ```
    """
    if f is not None or not isinstance(path, (str, os.PathLike)):  # save(state, path), as torch.save
        target, state, weights = torch_order("save", path, f, {"model": model, "optimizer": optimizer,
                                                               "scheduler": scheduler, "scaler": scaler,
                                                               "extra": extra, **more_state})
        alone = weights and keep_last is None and not (latest or allow_pickle or all_ranks)
        return save(target, **state, keep_last=keep_last, latest=latest, rng_state=rng_state, allow_pickle=allow_pickle,
                    all_ranks=all_ranks, weights_only=weights_only or alone)
    if weights_only:
        others = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "extra": extra,
                  "keep_last": keep_last, "latest": latest or None, "allow_pickle": allow_pickle or None,
                  "all_ranks": all_ranks or None, **more_state}
        return _save_weights(path, model, sorted(k for k, v in others.items() if v is not None))
    target = check_request(path, keep_last, more_state, torch_names=True)
    rank, world_size = tpsharded.world()
    rotate_after = keep_last is not None or latest
    sharded = isinstance(model, nn.Module) and tpsharded.is_sharded(model)
    torch_file = torchfile.is_torch_name(target)
    if torch_file and target.suffix.lower() == ".ckpt" and torchfile.is_lightning_module(model):
        raise CheckpointError(
            f"save({str(target)!r}): a LightningModule in a .ckpt file promises Lightning's checkpoint, which "
            "torchplace does not write; nothing was written.\n"
            "Fix: trainer.save_checkpoint(path) for Lightning's readers (torchplace.load reads that file too).\n"
            "Or: name this file .pt (torch.load and Fabric.load read it) or .safetensors.\n"
            "Why: load_from_checkpoint and Trainer.fit(ckpt_path=) read Lightning's version, loops and callbacks "
            "from a .ckpt.")
    if torch_file and (rotate_after or allow_pickle or sharded):
        raise torchfile.refuse(target, "keep_last= and latest= order a series by torchplace's header, which it "
                                       "has not" if rotate_after else "allow_pickle=True stores values torch.load "
                                       "reads only with weights_only=False" if allow_pickle else "a sharded model "
                                       "is saved as a folder, by torch.distributed.checkpoint")
    collective = world_size > 1 and (sharded or all_ranks)
    if collective:
        tpsharded.join_ranks(target, "saving a sharded model" if sharded else "save(all_ranks=True)")
    elif world_size > 1 and rank != 0:
        tpsharded.rank0_alone(lambda: target, target)  # rank 0 writes; this rank returns once the file is there
        return target
    rng_tree = capture_rng(rng_state, world_size if collective else 1)
    info: dict[str, Any] = {"world_size": world_size, "rotation": rotate_after}
    if world_size > 1 and not collective and rng_tree is not None:
        info["rng_rank"] = rank  # only rank 0's generators: the others' are not in the file

    if sharded:
        assert isinstance(model, nn.Module)
        def write_side(side: Path, skeleton: dict[str, Any]) -> None:
            tree, meta = collect_side(model, scheduler, scaler, extra, more_state, skeleton, rng_tree, info)
            write_file(side, tree, allow_pickle=allow_pickle, info={**meta, **series_info(target, rotate_after)})

        tpsharded.save_sharded(target, model, optimizer, write_side)
        if rotate_after:
            tpsharded.on_rank0(lambda: rotate(target, keep_last), target)
        return target

    def write() -> Path:
        tree, meta = collect_state(model, optimizer, scheduler, scaler, extra, more_state, rng_tree, info)
        if torch_file:
            return torchfile.write(target, tree, meta)
        with series_lock(target.parent, rotate_after):  # another writer of the series waits its turn
            write_file(target, tree, info={**meta, **series_info(target, rotate_after)}, allow_pickle=allow_pickle)
            if rotate_after:
                rotate(target, keep_last)
        return target

    if collective:
        tpsharded.on_rank0(write, target)
        return target
    return tpsharded.rank0_alone(write, target) or target if world_size > 1 else write()


def _save_weights(path: str | os.PathLike[str], model: Any, others: list[str]) -> Path:
    """save(weights_only=True): the model's state dict alone, written by rank 0 (see `conversion.write_weights`)."""
    target = Path(path)
    check_name(target)
    if model is None or others:
        raise CheckpointError(f"save({str(target)!r}, weights_only=True) writes the model's weights alone, "
                              + (f"and {', '.join(others)} was given too" if others else "and no model= was given")
                              + "; nothing was written. Fix: save(path, model=model, weights_only=True) for the "
                              "weights, and a separate save(...) without weights_only for the state to resume from.")
    if isinstance(model, nn.Module) and tpsharded.is_sharded(model):
        raise CheckpointError(f"save({str(target)!r}, weights_only=True): a sharded model (FSDP, DTensor) has no "
                              "whole state dict on one rank; nothing was written. Fix: save it without weights_only "
                              "(a folder), then `torchplace ckpt convert --weights-only` that folder.")
    from .conversion import write_weights

    def write() -> Path:
        state = clean_state(state_of(model, "model"))
        write_weights(target, target, "torchplace", {"model": state}, "", [], versions_of(state) or None)
        return target

    return tpsharded.rank0_alone(write, target) or target if tpsharded.world()[1] > 1 else write()


def _versions_info(tree: dict[str, Any]) -> dict[str, Any]:
    """The `_metadata` (module versions) of the model and of named modules in TREE, for the file's metadata:
    JSON cannot hold it on the state dicts themselves."""
    info: dict[str, Any] = {}
    if tree.get("model") is not None:
        info["module_versions"] = versions_of(tree["model"])
    named = {k: versions_of(v) for k, v in tree.items() if k not in RESERVED and versions_of(v)}
    if named:
        info["named_versions"] = named
    return info
