"""`torchplace.load`: checkpoints that load anywhere.

    ck = torchplace.load("ckpt", device="cuda:0", model=model, optimizer=opt, scheduler=sched,
                         scaler=scaler)   # the newest complete checkpoint in ckpt/
    step = ck.extra["step"]

Load puts every tensor straight onto the device it will live on (any device, with or without a
GPU), fills the objects it is given (model first, then the optimizer so its state lands with its
parameters), restores the RNG states that make sense here, and never runs code from the file
unless told to trust it. It reads torchplace's files, sharded folders (torch.distributed.checkpoint)
and other tools' checkpoints (foreign.py). Writing one is saving.py.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, DeviceError
from ..policy.devices import DeviceSpec
from . import fitting, foreign, keymap, rng, state_dicts
from . import sharded as tpsharded
from .dcp_reader import is_dcp_dir
from .fileio import read_file
from .format import read_header
from .options import ReadOptions
from .reading import Read, kind_of, place_optimizer_state, read_any
from .rotation import POINTER, check_format, complete_checkpoints, cut_files, warn_cut
from .saving import not_a_path
from .state_dicts import module_device, saved_versions, unwrap, versions_of


@dataclass(eq=False)
class Checkpoint(Mapping[str, Any]):
    """What `load` found and did.

    `state` holds everything in the file (tensors on the devices they were loaded to):
    'model', 'optimizer', 'scheduler', 'scaler', 'extra', 'rng' and any named state given to
    save; `ck["name"]` reads it, and `ck` is a read-only mapping of those names. Another tool's dict file
    (a torch.save training dict, Lightning) keeps its own keys too, as torch.load gives them: `ck["epoch"]`,
    `ck["state_dict"]` (`source`). A key that is not there raises a KeyError saying where it is
    (`ck.extra[...]`) or what there is. The rest reports what load did, so nothing happens silently.
    """

    path: Path
    state: dict[str, Any]
    metadata: dict[str, Any]
    tool: str
    stripped_prefix: str = ""
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    rng_restored: list[str] = field(default_factory=list)
    rng_skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    source: Mapping[str, Any] | None = field(default=None, repr=False)  # another tool's dict, as torch.load gave it

    def __getitem__(self, name: str) -> Any:
        if self.source is not None and name in self.source:
            return self.source[name]
        if name in self.state:
            return self.state[name]
        raise KeyError(self._where(name))

    def __contains__(self, name: object) -> bool:
        return name in self.state or (self.source is not None and name in self.source)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def __iter__(self) -> Iterator[str]:
        """The names `ck[name]` reads, the file's own first (without it, iterating asked for ck[0])."""
        return iter(dict.fromkeys([*(self.source or {}), *self.state]))

    def keys(self) -> list[str]:  # type: ignore[override]  # a list, as it was before Checkpoint was a Mapping
        """The names `ck[name]` reads, as `checkpoint.keys()` of what torch.load gave."""
        return list(iter(self))  # not list(self): that asks len(self), which counts these

    def __len__(self) -> int:
        return len(self.keys())

    def __getattr__(self, name: str) -> Any:
        """Only for names a Checkpoint lacks (`model = tp.load(path); model.eval()`, where torch.load gave back a
        pickled module): the AttributeError says what tp.load returns, and the fix."""
        if name.startswith("_") or "state" not in self.__dict__:
            raise AttributeError(name)
        raise AttributeError(
            f"'Checkpoint' object has no attribute {name!r}: tp.load returns what {self.path.name} holds "
            f"({', '.join(map(repr, self.keys())) or 'nothing'}), not a module or optimizer (torchplace never pickles "
            f"one). Fix: build the model, then tp.load(path, model=model); ck[key] reads an entry of the file.")

    @property
    def _metadata(self) -> Any:
        """Refused with the fix: torch's `load_state_dict` reads this first of the state dict it is given, and a
        Checkpoint is what the file holds (model, optimizer, rng, ...), not one object's state dict."""
        held = ", ".join(map(repr, self.keys())) or "nothing"
        raise CheckpointError(
            f"load_state_dict(tp.load({str(self.path)!r})): tp.load returns a Checkpoint of everything the file "
            f"holds ({held}), not a state dict; nothing was loaded.\n"
            f"Fix: tp.load({str(self.path)!r}, model=model) fills the model (keys matched, onto its device; "
            "optimizer=, scheduler= likewise).\n"
            f"Or: model.load_state_dict(tp.load({str(self.path)!r})['model']).")

    def _where(self, name: str) -> str:
        """The KeyError's message for NAME: where it went (extra=, a named value), or what the file holds."""
        extra = self.state.get("extra")
        if isinstance(extra, Mapping) and name in extra:
            return (f"{name!r} is not a top-level entry of {self.path.name}: it was saved with extra=, so it is "
                    f"ck.extra[{name!r}] (save it as a named value, tp.save(..., {name}=...), to read ck[{name!r}])")
        held = sorted({*map(str, self.state), *map(str, self.source or {})})
        return f"{name!r} is not in {self.path.name}, which holds {', '.join(held) or 'nothing'}"

    @property
    def extra(self) -> dict[str, Any]:
        """The `extra=` mapping given to save ({} if none)."""
        return self.state.get("extra") or {}

    def __repr__(self) -> str:
        """One line: the file, what it holds (tensor counts and sizes, not the tensors) and what load did."""
        held = ", ".join(f"{name} ({_held(value)})" for name, value in self.state.items()) or "nothing"
        did = ([f"stripped {self.stripped_prefix!r}"] if self.stripped_prefix else []) + [
            f"{len(keys)} {what} keys" for keys, what in ((self.missing_keys, "missing"),
                                                         (self.unexpected_keys, "unexpected")) if keys]
        did += [f"{len(self.notes)} note(s)"] if self.notes else []
        return f"Checkpoint({str(self.path)!r}, {self.tool}: {held}{'; ' + ', '.join(did) if did else ''})"


def _held(value: Any) -> str:
    """'4 tensors, 1.2 KiB' for a state dict (walked, not printed); a short word for anything else."""
    from ..units import format_bytes

    count, size, todo, seen = 0, 0, [value], 0
    while todo and seen < 100_000:  # a repr stays quick whatever the checkpoint holds
        item, seen = todo.pop(), seen + 1
        if isinstance(item, torch.Tensor):
            count, size = count + 1, size + item.numel() * item.element_size()
        elif isinstance(item, Mapping):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    if count:
        more = "+" if todo else ""
        return f"{count}{more} tensor{'s' if count != 1 else ''}, {format_bytes(size)}{more}"
    if isinstance(value, Mapping):
        keys = list(value)
        return ", ".join(map(str, keys[:4])) + (f", ... ({len(keys)} keys)" if len(keys) > 4 else "") or "empty"
    return type(value).__name__


MAX_RELISTS = 8  # how often load(DIR) lists the directory again when its newest is deleted under it


def _resolve(device: Any) -> torch.device | None:
    if device is None:
        return None
    from ..policy.devices import device as resolve_device

    return resolve_device(device)


def _foreign_kind(path: Path) -> bool:
    """True when PATH is a checkpoint of another tool that `load` reads by its name (never raises)."""
    try:
        return kind_of(path) not in ("folder", "unknown", "pointer")
    except CheckpointError:
        return False


def _needs_pickle(path: Path) -> bool:
    try:
        return bool((read_header(path).meta or {}).get("pickled"))
    except CheckpointError:
        return False


def _under_prefix(ck: Checkpoint, sd: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    """The saved model keys under PREFIX (load's `prefix=`), PREFIX removed; refused when none is."""
    prefix = prefix if prefix.endswith(".") else prefix + "."
    chosen = keymap.select(sd, prefix, _file_versions(ck, "model", sd))
    if chosen is None:
        leads = sorted({k.split(".", 1)[0] + "." for k in sd if "." in k})
        held = ", ".join(map(repr, leads[:10])) or "no prefix at all"
        raise CheckpointError(f"{ck.path}: no saved model key starts with {prefix!r}; the saved keys start with "
                              f"{held}. Fix: pass one of those as prefix=, or leave prefix= out to let load match "
                              "the keys to the model.")
    ck.notes.append(f"model keys: took the {len(chosen)} saved keys under {prefix!r} (prefix=), without it")
    return chosen


def _apply(ck: Checkpoint, *, model: nn.Module | None, objects: dict[str, Any], strict_keys: bool,
           foreign_file: bool, prefix: str | None = None) -> None:
    state, path = ck.state, ck.path
    if foreign_file and isinstance(ck.source, Mapping):  # another tool's dict: its own keys name the objects too
        for name, obj in objects.items():            # (torchvision's 'lr_scheduler', 'model_ema')
            if obj is not None and name not in state and isinstance(ck.source.get(name), Mapping):
                state[name] = ck.source[name]
    fitting.check_objects(path, state, model=model, objects=objects)  # refused here: nothing has changed
    if model is not None:
        sd = state.get("model")
        if not isinstance(sd, Mapping):  # saved as a named value by another tool's name (imagenet's state_dict=)
            key, named = foreign.model_entry(state)
            if key is not None:
                sd = state["model"] = named
                ck.notes.append(f"model weights: taken from the saved entry {key!r}, the model's state dict")
        if not isinstance(sd, Mapping):
            own = [k for k, v in (ck.source or {}).items()  # a GAN's netG, netD
                   if isinstance(v, Mapping) and str(k).isidentifier() and k not in ("optimizer", "scheduler")]
            by_key = (f" Or pass the model by the file's key of its weights: load({str(path)!r}, {own[0]}=model)."
                      if own else "")
            raise CheckpointError(f"{path} holds no model weights under a name load knows (it holds: "
                                  f"{fitting.holds(dict(ck.source or {}) or state)}). Fix: load it without model=, "
                                  f"or point at the checkpoint that has them.{by_key}")
        target = unwrap(model)
        if prefix:
            sd = _under_prefix(ck, sd, prefix)
        found = keymap.match(list(sd), target)
        sd = state["model"] = found.apply(sd, getattr(sd, "_metadata", None) if prefix else
                                          _file_versions(ck, "model", sd))
        if getattr(sd, "_metadata", None) is None and _versionless(ck.tool):
            sd._metadata = getattr(target.state_dict(), "_metadata", None)  # type: ignore[attr-defined]
        ck.stripped_prefix = found.stripped_prefix
        if found.note():
            ck.notes.append(found.note() or "")
        sd = state["model"] = fitting.tied(path, ck.notes, sd, target)
        empty = fitting.meta_to_fill(path, ck.notes, sd, target)
        ties = state_dicts.tied_groups(target) if empty else []
        refused = None
        try:
            refused = fitting.rehearse(target, sd, strict_keys)  # torch would copy what fits, then raise
            if refused is not None:
                raise refused
            if empty:  # a model made on meta takes the file's tensors as its own (a copy into meta does nothing)
                result = target.load_state_dict(state_dicts.for_assign(sd, target), strict=strict_keys, assign=True)
                state_dicts.retie(target, ties)
            else:
                result = target.load_state_dict(sd, strict=strict_keys)
        except RuntimeError as exc:
            tried = "" if found.complete else (
                f"\n{found.matched} of {found.total} saved keys name a tensor of the model, under the best "
                f"mapping ({found.rewrite.describe()}; wrapper prefixes {', '.join(keymap.WRAPPER_NAMES)} were "
                "tried at the start and inside).")
            kept = " The model was left as it was." if refused is not None else ""
            raise CheckpointError(f"{path}: the weights do not fit {type(target).__name__}: {exc}{tried}{kept}\n"
                                  f"Fix: {fitting.fit_fix(sd, target, strict_keys)}") from None
        ck.missing_keys, ck.unexpected_keys = list(result.missing_keys), list(result.unexpected_keys)
    elif isinstance(state.get("model"), Mapping):
        sd = state["model"]
        cleaned, _, changed = keymap.clean(sd, _file_versions(ck, "model", sd))
        state["model"] = cleaned
        if changed:
            ck.notes.append(f"model keys: removed torch.compile's '_orig_mod.' from {changed} saved keys")
        lead = keymap.leading_wrapper_note(list(cleaned))
        if lead and foreign_file:
            ck.notes.append(lead)
    for name, obj in objects.items():
        if obj is None:
            continue
        value = state[name]
        if isinstance(obj, nn.Module) and isinstance(value, Mapping):  # a named module (an EMA model)
            found = keymap.match(list(value), unwrap(obj))
            value = state[name] = found.apply(value, _file_versions(ck, name, value))
            if found.note():
                ck.notes.append(f"{name}: {found.note()}")
            obj = unwrap(obj)
            value = state[name] = fitting.tied(path, ck.notes, value, obj, name)
        if name == "optimizer" and foreign_file and isinstance(value, Mapping):
            value = place_optimizer_state(obj, dict(value))
        try:
            refused = fitting.rehearse(obj, value, strict_keys=True) if isinstance(obj, nn.Module) else None
            if refused is not None:  # an EMA model: left as it was, as the model above
                raise refused
            obj.load_state_dict(value)
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise CheckpointError(f"{path}: the saved {name} state does not fit the {type(obj).__name__} given "
                                  f"({exc}). Fix: build it as it was when saved (same parameters and groups)."
                                  ) from None


def _file_versions(ck: Checkpoint, name: str, sd: Any) -> dict[str, Any] | None:
    """The module versions saved for entry NAME: in our files' metadata, on other tools' state dicts."""
    if name == "model":
        saved = saved_versions(ck.metadata.get("module_versions"))
    else:
        named = ck.metadata.get("named_versions")
        saved = saved_versions(named.get(name)) if isinstance(named, Mapping) else None
    return saved or versions_of(sd) or None


def _versionless(tool: str) -> bool:
    """True for formats that cannot store module versions (plain safetensors, accelerate's model.safetensors,
    DCP): their weights are taken as the model's current versions, as torch's DCP loading does (it fills
    model.state_dict() in place). A torch.save file without versions is loaded as torch would load it."""
    return tool in ("safetensors", "accelerate") or tool.startswith(("torch.distributed.checkpoint", "transformers"))


def _restore_rng(ck: Checkpoint, dev: torch.device) -> None:
    saved = ck.state.get("rng")
    if not isinstance(saved, Mapping):
        return
    if "per_rank" in saved:
        ranks = saved["per_rank"] or []
        rank, world_size = tpsharded.world()
        if rank < len(ranks) and len(ranks) == world_size:
            saved = ranks[rank]
        else:
            saved = ranks[0] if ranks else {}
            ck.notes.append(f"RNG states were saved by {len(ranks)} ranks and this run has {world_size}; "
                            "rank 0's states were restored")
    elif isinstance(ck.metadata.get("rng_rank"), int):  # saved by one rank alone: its generators only
        rank, world_size = tpsharded.world()
        saver = ck.metadata["rng_rank"]
        if world_size > 1 and rank != saver:
            ck.rng_skipped = {name: f"the file holds rank {saver}'s generators only (saved by rank {saver} alone); "
                                    f"this rank ({rank}) keeps its own. Fix: save(..., all_ranks=True) on every "
                                    "rank saves each rank's" for name in saved}
            return
    ck.rng_restored, ck.rng_skipped = rng.restore(dict(saved), dev, ck.metadata.get("primary_device"))


def _load_one(path: Path, kind: str, opts: ReadOptions, *, model: nn.Module | None, objects: dict[str, Any],
              strict_keys: bool, restore_rng: bool, read: Read | None = None, prefix: str | None = None) -> Checkpoint:
    """Load PATH, of KIND (`kind_of`), into MODEL and OBJECTS; READ: what `read_any` already read of it."""
    optimizer = objects.get("optimizer")
    if read is None and model is not None and kind == "dcp-foreign":  # torch alone wrote it: read through DCP
        read = tpsharded.read_plain(path, model, optimizer, opts)
    if read is None and kind in ("dcp", "dcp-foreign"):
        ck = _load_dcp(path, opts, model=model, optimizer=optimizer)
        rest = {k: v for k, v in objects.items() if k != "optimizer"}
        _apply(ck, model=None, objects=rest, strict_keys=strict_keys, foreign_file=False)
    else:
        tool, state, meta, notes, source = read or read_any(path, kind, opts, model=model, optimizer=optimizer)
        ck = Checkpoint(path, state, meta, tool, notes=list(notes), source=source)
        _apply(ck, model=model, objects=objects, strict_keys=strict_keys,
               foreign_file=not tool.startswith("torchplace"), prefix=prefix)
        if model is not None and opts.device is not None:  # no-op unless it was made on meta
            unwrap(model).to(opts.device)
    if restore_rng:
        where = opts.device or (module_device(unwrap(model)) if model is not None else torch.device("cpu"))
        _restore_rng(ck, where)
    return ck


def _load_dcp(path: Path, opts: ReadOptions, *, model: nn.Module | None, optimizer: Any) -> Checkpoint:
    side = path / tpsharded.SIDE_FILE
    if model is None:
        raise CheckpointError(f"{path} is a sharded checkpoint (torch.distributed.checkpoint). Fix: pass model= "
                              "(and optimizer=) set up and sharded as in this run; the shards are loaded into them.")
    fs = read_file(side, lambda _: torch.device("cpu"), opts)
    tree = fs.tree
    skeleton: dict[str, Any] = {k: tree[k] for k in ("model", "optimizer") if k in tree}
    msd, osd = tpsharded.load_sharded(path, model, optimizer, skeleton, opts)
    tree["model"] = msd
    if osd is not None:
        tree["optimizer"] = osd
    return Checkpoint(path, tree, fs.meta, "torchplace (sharded, torch.distributed.checkpoint)")


TORCH_LOAD_ARGS = {  # torch.load's keywords, and what torchplace.load takes instead
    "map_location": "pass device= instead (device='cpu', device='cuda:0'); tensors then go straight there",
    "weights_only": "leave it out: torchplace.load never runs code from the file unless trust_pickle=True",
    "mmap": "leave it out: torchplace.load reads tensors straight onto their device",
    "pickle_module": "leave it out: torchplace.load reads with torch's restricted unpickler (trust_pickle=True "
                     "for files from someone you trust)",
}


def load(path: str | os.PathLike[str], *, device: DeviceSpec = None, model: nn.Module | None = None,
         optimizer: Any = None, scheduler: Any = None, scaler: Any = None, strict: bool = True,
         restore_rng: bool = True, trust_pickle: bool = False, prefix: str | None = None,
         **more_state: Any) -> Checkpoint:
    """Load a checkpoint onto DEVICE and into the objects given; return what was found and done.

    The saved keys are matched against the model's: as saved when they match, else with wrapper
    prefixes (`module.`, `_orig_mod.`, Lightning's `model.` and `_forward_module.`, or the one child
    that holds the model: a LightningModule's `net.`, `backbone.`) removed or added, whichever makes
    every key match (the choice is in the result's notes); `prefix=` takes the keys under a prefix
    you name. Without a model, only torch.compile's `_orig_mod.` is removed (a leading `module.` may
    be a real submodule).

    Args:
        path: a checkpoint file, a directory (its newest complete checkpoint; a damaged newest one
            is reported with a warning and the next is used; its `latest` pointer means the same),
            a sharded checkpoint, or another tool's file (torch.save, Lightning, accelerate's
            save_state directory, safetensors).
        device: where tensors go ("cpu", "cuda:0", a torch.device, ...; resolved and validated).
            With a model, the model is moved there first; without one, tensors go to the model's
            own devices, or to the CPU.
        model: loaded first, so the optimizer's state lands on its parameters' devices. Keys the
            file leaves out because the model ties them to a saved key are filled from it; a model
            made on the meta device takes the file's tensors as its own.
        optimizer: its `load_state_dict` is called with the saved state.
        scheduler: as `optimizer`.
        scaler: as `optimizer`.
        strict: passed to the model's `load_state_dict` (inside torchplace: `strict_keys`, apart from strict mode).
        restore_rng: restore the RNG states that make sense here (the result says which were
            skipped and why).
        trust_pickle: allow files that need pickle, which runs code from the file; only for files
            from someone you trust.
        prefix: load only the saved model keys under this prefix, without it ("encoder." of a
            LightningModule holding an encoder and a decoder, into the encoder).
        **more_state: more objects whose `load_state_dict` is called, or names of plain values.

    Returns:
        A `Checkpoint`: the state by key (`ck["model"]`, `ck.extra`), the tool that wrote the file
        (`tool`), the prefix that was stripped and `notes` on every choice made.

    Raises:
        CheckpointError: PATH does not exist or holds no checkpoint, a torn, corrupt or unknown
            file, a checksum mismatch, keys or shapes that do not fit the model, an optimizer whose
            groups do not fit, or a file that needs pickle without `trust_pickle=True` (each before
            anything is loaded, where it can be known before).
        DeviceError: DEVICE does not exist here, or is the meta device with objects to fill (they would
            keep no values).
        TypeError: `model` is not a module (a state dict, a list of modules), or another object
            to fill has no load_state_dict().

    Example:
        ```python
        import torch
        import torchplace as tp

        model = torch.nn.Linear(4, 2)
        tp.save("ckpt.safetensors", model=model, extra={"step": 7})
        fresh = torch.nn.Linear(4, 2)
        ck = tp.load("ckpt.safetensors", device="cpu", model=fresh)
        print(ck.extra["step"], torch.equal(fresh.weight, model.weight))
        ```
    """
    if not isinstance(path, (str, os.PathLike)):
        raise not_a_path("load", path, f"load({type(path).__name__}): the path of a checkpoint file or folder is "
                                       "needed. Fix: tp.load('ckpt.pt', model=model).")
    state_dicts.module_to_fill(model)
    objects = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, **more_state}
    for name, obj in objects.items():
        if name in TORCH_LOAD_ARGS:  # a drop-in `torch.load(path, map_location=...)` call
            raise TypeError(f"load() got {name}={obj!r}, an argument of torch.load, which torchplace.load does not "
                            f"take. Fix: {TORCH_LOAD_ARGS[name]}.")
        if obj is not None and not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"load() got {name}={type(obj).__name__}, which has no load_state_dict(); "
                            f"pass objects to fill, and read saved values from the result (ck[{name!r}]).")
    dev = _resolve(device)  # validated before anything is touched
    filled = [f"{name}={type(obj).__name__}" for name, obj in {"model": model, **objects}.items() if obj is not None]
    if dev is not None and dev.type == "meta" and filled:
        raise DeviceError(
            f"load({str(path)!r}, device={device!r}, {', '.join(filled)}) asked to load into objects on the meta "
            "device, whose tensors have shapes but no values: the checkpoint's values would be read and dropped "
            "(and the model's own weights lost). Nothing was loaded. Fix: load with device=\"cpu\" (or the device "
            "to run on); a model built on meta (`with torch.device(\"meta\"):`) then takes the file's tensors as "
            "its own, as model.load_state_dict(state, assign=True) does, or give it memory first with "
            "model.to_empty(device=\"cpu\").")
    if model is not None and dev is not None and not state_dicts.meta_names(unwrap(model)):
        unwrap(model).to(dev)  # a model on meta is moved after its load: its tensors are read onto DEV
    opts = ReadOptions(device=dev, trust_pickle=trust_pickle)
    target = Path(path)
    kind = kind_of(target)
    pointed: list[str] = []
    if kind == "pointer":  # DIR/latest: the directory's newest, found by the headers as for DIR itself
        target = target.parent
        kind = kind_of(target)
        pointed.append(f"{path} is the `{POINTER}` pointer of {target}: loaded the newest complete checkpoint there "
                       "(ordered by sequence number, as for the directory itself)")

    def one(where: Path, kind: str, read: Read | None = None) -> Checkpoint:
        return _load_one(where, kind, opts, model=model, objects=objects, strict_keys=strict,
                         restore_rng=restore_rng, read=read, prefix=prefix)

    if kind != "folder":
        return one(target, kind)
    newer: list = []
    candidates = complete_checkpoints(target, newer=newer)
    check_format(target, candidates, newer)
    if not candidates:
        names = sorted(os.listdir(target))[:10]
        held = ", ".join(names) or "nothing"
        other = next((target / n for n in names if _foreign_kind(target / n)), None)
        by_name = f" (another tool's checkpoint, such as {other}, carries no order torchplace can read: load it by " \
                  "its name)" if other is not None else ""
        raise CheckpointError(f"{target} holds no complete torchplace checkpoint (it holds: {held}). Fix: point at a "
                              f"checkpoint file{by_name}, or at the directory you saved into with keep_last.")
    cut = cut_files(target)  # a file cut short may be the newest: its order cannot be read
    skipped = [f"skipped {what}" for what in cut]
    vanished: list[str] = []
    for _ in range(MAX_RELISTS + 1):
        for candidate in candidates:
            if is_dcp_dir(candidate):
                ck = one(candidate, "dcp")
                warn_cut(target, cut, f"loaded {candidate.name}", 2)
                ck.notes[:0] = pointed + skipped
                return ck
            try:
                kind = kind_of(candidate)
                read = read_any(candidate, kind, opts, model=model, optimizer=optimizer)
            except CheckpointError as exc:
                if not os.path.lexists(candidate):  # deleted since the listing: another process rotates here
                    vanished.append(candidate.name)
                    skipped.append(f"{candidate.name} was deleted while it was being opened (another process "
                                   f"rotating {target}?): looked again for the newest")
                    break
                if not trust_pickle and _needs_pickle(candidate):
                    raise
                warnings.warn(f"skipping {candidate}: {exc}", RuntimeWarning, stacklevel=2)
                skipped.append(f"skipped {candidate.name}: {exc}")
                continue
            ck = one(candidate, kind, read)
            warn_cut(target, cut, f"loaded {candidate.name}", 2)
            ck.notes[:0] = pointed + skipped
            return ck
        else:
            raise CheckpointError(f"every checkpoint in {target} is damaged: " + "; ".join(skipped))
        candidates = complete_checkpoints(target)
    raise CheckpointError(f"the newest checkpoint of {target} was deleted while being opened, {len(vanished)} times "
                          f"in a row ({', '.join(dict.fromkeys(vanished))}). Another process keeps rotating the "
                          "directory faster than it can be read. Fix: load a checkpoint file by its name, or load "
                          "once that job has ended.")
