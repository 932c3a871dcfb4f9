"""Checkpoints made by other tools: recognise them, open them without running code, normalise them.

Recognised: torch.save files (zip and legacy pickle), safetensors files, Lightning checkpoints,
accelerate `save_state` directories, plain training dicts ({"model": ..., "optimizer": ...} and
the `*_state_dict` spellings). Pickles are opened with `torch.load(weights_only=True)`, which
builds only tensors and plain containers; a file that needs anything else is refused with the
global it asked for and how to opt in. `map_location` is always given, so a file saved on cuda:1
opens on a machine without CUDA, where plain `torch.load` fails with "Attempting to deserialize
object on a CUDA device".
"""

from __future__ import annotations

import argparse
import os
import pickle
import pickletools
import re
import struct
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .. import safeio
from ..errors import CheckpointError
from ..shared.threads import kept_pool
from .codec import PICKLE_FIX
from .options import ReadOptions
from .state_dicts import layout_problem

MODEL_KEYS = ("model", "model_state_dict", "state_dict", "model_state", "net", "module")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "optimizer_state")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "lr_scheduler_state_dict")
SCALER_KEYS = ("scaler", "grad_scaler", "scaler_state_dict", "amp")
ACCELERATE_FILES = ("optimizer.bin", "scheduler.bin", "scaler.pt", "random_states_0.pkl")
# the state files beside the weights: accelerate's save_state (.bin), transformers' Trainer checkpoint-N (.pt)
STATE_FILES = (("optimizer", ("optimizer.bin", "optimizer.pt")), ("scheduler", ("scheduler.bin", "scheduler.pt")),
               ("scaler", ("scaler.pt",)))
TRAINER_STATE = "trainer_state.json"  # transformers' Trainer: global_step, epoch, best checkpoint, log history
# plain-data classes torch's safe unpickler refuses by default though building them runs no code of the file's:
# argparse.Namespace is timm's and fairseq's `checkpoint['args']` (timm's own reader allows it the same way)
SAFE_GLOBALS = (argparse.Namespace,)
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # transformers' sharded models
MAX_INDEX_BYTES = 16 * 2**20  # a sharded model's index JSON (a few hundred KiB for the largest models)
FIX_PATH = "Fix: check the path; torchplace.load(DIRECTORY) finds the newest checkpoint in a directory."
FIX_COMPLETE = "Fix: check that the file is complete (compare its size with the original)."


def file_kind(path: Path) -> str:
    """What the file PATH is: safetensors (torchplace's too), torch-zip, torch-pickle or unknown (its first bytes);
    a path that is not a regular file (a FIFO, /dev/zero) is refused."""
    fd, _ = safeio.open_regular(path, CheckpointError, FIX_PATH)
    try:
        head = os.pread(fd, 262, 0)
        if len(head) < 9 or head[8:9] == b"{":  # torchplace files are safetensors files too; a stub of
            return "safetensors"              # a few bytes gets the header reader's "truncated" message
        if head[257:262] == b"ustar":  # a tar of a torch.save file ends as the zip inside does
            return "unknown"
        with os.fdopen(os.dup(fd), "rb") as fh:
            if zipfile.is_zipfile(fh) or head[:4] == b"PK\x03\x04":  # a zip whose end is cut off too, so
                return "torch-zip"                                   # that its reader says it is truncated
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}. {FIX_PATH}") from None
    finally:
        os.close(fd)
    if head[:1] == b"\x80":
        return "torch-pickle"
    return "unknown"


# how a checkpoint is packed for a download, and what unpacks it
PACKED = ((b"\x1f\x8b", "gzip-compressed", "gunzip"), (b"\xfd7zXZ\x00", "xz-compressed", "unxz"),
          (b"\x28\xb5\x2f\xfd", "zstd-compressed", "unzstd"), (b"BZh", "bzip2-compressed", "bunzip2"))


def unknown(path: Path) -> CheckpointError:
    """The refusal of PATH, a file of no format torchplace reads; a compressed or tar'ed checkpoint says so."""
    try:
        with open(path, "rb") as fh:  # a regular file: file_kind has looked
            head = fh.read(262)
    except OSError:
        head = b""
    packed = next(((kind, tool) for magic, kind, tool in PACKED if head.startswith(magic)), None)
    if packed is None and head[257:262] == b"ustar":
        packed = ("a tar archive", "tar -xf")
    if packed is not None:
        return CheckpointError(f"{path} is {packed[0]}, not a checkpoint itself. Fix: unpack it first "
                               f"({packed[1]} {str(path)!r}) and give the checkpoint inside.")
    return CheckpointError(f"{path} is not a checkpoint torchplace recognises (not torchplace/safetensors, torch.save, "
                           "Lightning, accelerate or DCP). Fix: give a checkpoint file or a checkpoint folder (DCP, "
                           "accelerate's save_state).")


def is_cut_zip(path: Path) -> bool:
    """True for a regular file that starts as a zip (torch.save's format) but whose end, the zip's directory,
    is missing: a torch.save file cut short (a full disk during a copy). Never raises."""
    try:
        if not path.is_file():  # a FIFO would block the open, /dev/zero never end
            return False
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as fh:
            if fh.read(4) != b"PK\x03\x04":
                return False
            fh.seek(0)
            return not zipfile.is_zipfile(fh)
    except (OSError, ValueError):
        return False


def is_accelerate_dir(path: Path) -> bool:
    """True for a folder of accelerate's `save_state` files or transformers' `save_pretrained` weights."""
    names = set(os.listdir(path))  # weights by transformers' names, not any "model*" (imagenet's model_best.pth.tar)
    return bool(names & set(ACCELERATE_FILES)) or bool(names & set(INDEX_FILES)) or any(
        n.startswith(("model", "pytorch_model")) and n.endswith((".safetensors", ".bin")) for n in names)


def folder_tool(path: Path) -> str:
    """Who wrote the folder `reading.kind_of` calls "accelerate": transformers' `save_pretrained` (a config.json beside
    the weights, none of accelerate's save_state files) or accelerate's `save_state`."""
    names = set(os.listdir(path))
    if TRAINER_STATE in names:
        return "transformers (Trainer checkpoint)"
    if "config.json" in names and not names & set(ACCELERATE_FILES) and not any(
            n.startswith("random_states_") for n in names):
        return "transformers (save_pretrained)"
    return "accelerate"


def zip_budget(file_size: int) -> int:
    """The most bytes a torch.save zip of FILE_SIZE bytes may unpack to: twice its size, or 128 MiB."""
    return max(2 * file_size, 128 * 2**20)


def check_zip(path: Path) -> int:
    """Refuse a zip whose members would unpack to more than `zip_budget` (a zip bomb): torch.save
    stores its members uncompressed, so only a re-packed or crafted file expands. Returns what its
    members declare."""
    fd, size = safeio.open_regular(path, CheckpointError, FIX_PATH)
    with os.fdopen(fd, "rb") as fh:
        return check_zip_stream(fh, size, zip_budget(size), str(path))


def check_zip_stream(fh: Any, size: int, limit: int, where: str) -> int:
    """check_zip for the open zip FH of SIZE bytes (named WHERE in messages), whose members may unpack
    to at most LIMIT bytes; returns what they declare. FH is left at its start."""
    try:
        with zipfile.ZipFile(fh) as zf:
            members = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        fh.seek(0)
        cut = " (it starts as a zip, torch.save's format, but its end, the zip's directory, is missing: truncated?)" \
            if fh.read(4) == b"PK\x03\x04" else ""
        raise CheckpointError(f"{where} cannot be read as a torch.save file: {exc}{cut}. {FIX_COMPLETE}") from None
    finally:
        fh.seek(0)
    declared = sum(m.file_size for m in members)
    if declared > limit:
        packed = sum(1 for m in members if m.compress_type != zipfile.ZIP_STORED)
        raise CheckpointError(
            f"{where} is a {size}-byte zip whose members declare {declared} bytes unpacked ({packed} of "
            f"{len(members)} compressed); torchplace unpacks at most {limit} bytes from it "
            "(torch.save never compresses, so this file was re-packed or crafted). Fix: if you trust its "
            "origin, load it with torch.load and save it again with torch.save or torchplace.save.")
    return declared


_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip member's local header, before its name and extra field
_CRC_PIECE = 2**20  # read into one buffer reused (it stays in cache): fresh 16 MiB reads cost twice the CPU


def check_zip_crcs(path: Path) -> None:
    """Refuse the zip at PATH when a member's bytes do not match the CRC-32 its directory records (a torn copy,
    a flipped bit): torch.save records one per member, and torch.load checks none."""
    from .stream import crc32  # ISA-L's where installed

    fd, size = safeio.open_regular(path, CheckpointError, FIX_PATH)
    buf = memoryview(bytearray(_CRC_PIECE))
    try:
        with os.fdopen(os.dup(fd), "rb") as fh, zipfile.ZipFile(fh) as zf:
            members = zf.infolist()
            for m in members:
                if m.compress_type != zipfile.ZIP_STORED:  # re-packed (bounded by check_zip): zipfile checks it
                    with zf.open(m) as member:
                        while member.read(_CRC_PIECE):
                            pass
                    continue
                head = os.pread(fd, _LOCAL_HEADER.size, m.header_offset)
                if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
                    raise zipfile.BadZipFile(f"member {m.filename!r} has no local header at {m.header_offset}")
                fields = _LOCAL_HEADER.unpack(head)
                start = m.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
                if start + m.file_size > size:
                    raise zipfile.BadZipFile(f"member {m.filename!r} runs past the end of the file")
                value, done = 0, 0
                while done < m.file_size:
                    got = os.preadv(fd, [buf[:min(_CRC_PIECE, m.file_size - done)]], start + done)
                    if not got:
                        raise zipfile.BadZipFile(f"member {m.filename!r} ends early")
                    value, done = crc32(buf[:got], value), done + got
                if value != m.CRC:
                    raise zipfile.BadZipFile(f"member {m.filename!r} ({m.file_size} bytes) fails its CRC-32 "
                                             f"(recorded {m.CRC:08x}, read {value:08x})")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct.error) as exc:
        raise CheckpointError(f"{path} is damaged: {exc}. {FIX_COMPLETE}") from None
    finally:
        os.close(fd)


def torch_load(path: Path, opts: ReadOptions, *, map_location: Any = None, mmap: bool = False,
               verify: bool = True) -> Any:
    """torch.load onto MAP_LOCATION (default: opts.map_location), without unrestricted pickle unless
    opts.trust_pickle (`SAFE_GLOBALS` allowed); refusals become CheckpointError. VERIFY: a zip's CRC-32s are
    checked (torch's reader checks none: a bit flipped in a tensor loads as a wrong weight) in a helper
    thread while torch reads, which hides their cost (a quarter of a 1 GiB load when checked first); a
    member that fails its CRC-32 is refused before anything is returned, in place of torch's own error."""
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a torch.save file. {FIX_PATH}")
    checking = None
    if file_kind(path) == "torch-zip":  # file_kind refuses what is not a regular file (a FIFO, /dev/zero)
        check_zip(path)
        if verify:
            checking = kept_pool(1, "torchplace-load").submit(check_zip_crcs, path)
    try:
        return _torch_load(path, opts, map_location, mmap)
    finally:
        if checking is not None:
            checking.result()  # a damaged member's CheckpointError wins over whatever torch made of it


def _torch_load(path: Path, opts: ReadOptions, map_location: Any, mmap: bool) -> Any:
    """torch_load's torch.load, its refusals made CheckpointErrors."""
    trust_pickle = opts.trust_pickle
    kwargs: dict[str, Any] = {"map_location": opts.map_location if map_location is None else map_location,
                              "weights_only": not trust_pickle}
    if mmap:
        kwargs["mmap"] = True
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # a plain pickle of protocol 4+
            return torch.load(path, **kwargs)                                      # is explained below, once
    except pickle.UnpicklingError as exc:
        needs = None if trust_pickle else _needs_code(str(exc))
        framing = re.search(r"Unsupported operand (\d+)", str(exc))
        if not trust_pickle and framing and int(framing.group(1)) in _PROTOCOL4:
            op = pickletools.code2op[chr(int(framing.group(1)))].name
            raise CheckpointError(f"{path} is a plain pickle of protocol 4 or later (as pickle.dump writes it; "
                                  f"torch.save writes a zip archive), whose {op} instruction torch's safe unpickler "
                                  f"does not read. {PICKLE_FIX} Or load it with pickle where you trust it and write "
                                  "it again with torch.save.") from None
        if needs is None:  # not a pickle at all (a byte no pickle has), or broken even when trusted
            lines = str(exc).splitlines()
            raise CheckpointError(f"{path} cannot be read as a torch.save file (it is not a pickle torch can read: "
                                  f"{(lines[0] if lines else '')[:200]}). {FIX_COMPLETE}") from None
        why = f" ({needs})" if needs else ""
        raise CheckpointError(f"{path} is a pickle that needs code from the file to load{why}; torchplace "
                              f"does not run code from checkpoints by default. {PICKLE_FIX}") from None
    except Exception as exc:  # the unpickler parses untrusted bytes: whatever it raises, the file is at fault
        protocol = _plain_pickle_protocol(path) if "Invalid magic number" in str(exc) else None
        if protocol is not None:
            raise CheckpointError(f"{path} is a plain pickle of protocol {protocol} (as pickle.dump writes it), not a "
                                  "torch.save file, so torch.load cannot read it whatever it trusts. Fix: if you "
                                  "trust whoever made it, load it with pickle and write it again with torch.save or "
                                  "torchplace.save.") from None
        lines = str(exc).splitlines()
        raise CheckpointError(f"{path} cannot be read as a torch.save file ({type(exc).__name__}: "
                              f"{(lines[0] if lines else '')[:300]}). {FIX_COMPLETE}") from None


def _plain_pickle_protocol(path: Path) -> int | None:
    """The protocol of PATH when it is a pickle of protocol 2 or 3 that does not start the way torch.save's
    legacy format does (its first pickle is a magic number, a 10-byte LONG1), else None."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError:
        return None
    if len(head) == 4 and head[0] == 0x80 and head[1] in (2, 3) and head[2:] != b"\x8a\x0a":
        return head[1]
    return None


# the instructions protocols 4 and 5 added that build no object from code (FRAME, MEMOIZE, ...)
_PROTOCOL4 = {ord(pickletools.code2op[c].code) for c in "\x95\x94\x8c\x8d\x8e\x96\x97\x98"}


def _needs_code(message: str) -> str | None:
    """What torch's restricted unpickler refused in MESSAGE ('' when it does not say), or None when what it
    refused is no pickle instruction at all: then the file is not a pickle (or is damaged), and trusting
    it would not help."""
    first = next((ln.strip() for ln in message.splitlines() if "Unsupported" in ln or "GLOBAL" in ln), "")
    operand = re.fullmatch(r"Unsupported operand (\d+)", first)
    if operand and chr(int(operand.group(1))) not in pickletools.code2op:
        return None
    return first


def is_state_dict(obj: Any) -> bool:
    """True for a mapping of names to tensors (a model's state dict as torch.save wrote it)."""
    return isinstance(obj, Mapping) and len(obj) > 0 and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def _model_state(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the model's state dict that keeps its `_metadata` (module versions), as torch's loaders do."""
    out: dict[str, Any] = OrderedDict(obj)
    meta = getattr(obj, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def _first(obj: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if k in obj and obj[k] is not None:
            return k, obj[k]
    return None, None


def model_entry(state: Mapping[str, Any]) -> tuple[str | None, Any]:
    """(key, value) of the first entry of STATE under a model key other tools use (`MODEL_KEYS`) that is a
    state dict, else (None, None)."""
    for key in MODEL_KEYS:
        if is_state_dict(state.get(key)):
            return key, state[key]
    return None, None


def normalize(obj: Any, path: Path | str = "the checkpoint") -> tuple[str, dict[str, Any]]:
    """(tool, state) with state in torchplace's layout: model, optimizer, scheduler, scaler, extra.

    CheckpointError (naming PATH) when what the file holds cannot be that layout: a Lightning
    `state_dict` that is not a dict, a model whose keys are not strings, ..."""
    tool, state = _normalize(obj)
    problem = layout_problem(state)
    if problem:
        raise CheckpointError(f"{path} ({tool}) cannot be loaded: {problem}. Fix: check that the file is the "
                              "checkpoint you meant; torch.load(path, weights_only=True) shows what it holds.")
    return tool, state


def _normalize(obj: Any) -> tuple[str, dict[str, Any]]:
    if is_state_dict(obj):
        return "torch.save (state dict)", {"model": _model_state(obj)}
    if not isinstance(obj, Mapping):
        return "torch.save (object)", {"extra": {"object": obj}}
    if "state_dict" in obj and any(k in obj for k in ("pytorch-lightning_version", "lightning_version",
                                                        "global_step", "loops")):
        version = obj.get("pytorch-lightning_version") or obj.get("lightning_version") or "?"
        tool = f"lightning {version}"
        model = obj["state_dict"]
        state: dict[str, Any] = {"model": _model_state(model) if isinstance(model, Mapping) else model}
        for name, key in (("optimizer", "optimizer_states"), ("scheduler", "lr_schedulers")):
            value = obj.get(key)
            if isinstance(value, (list, tuple)):  # one per optimizer; the first is restored
                value = value[0] if value else None
            if value is not None:
                state[name] = value
        taken = {"state_dict", "optimizer_states", "lr_schedulers"}
        state["extra"] = {k: v for k, v in obj.items() if k not in taken}
        return tool, state
    state, taken_keys = {}, set()
    for name, keys in (("model", MODEL_KEYS), ("optimizer", OPTIMIZER_KEYS), ("scheduler", SCHEDULER_KEYS),
                       ("scaler", SCALER_KEYS)):
        key, value = _first(obj, keys)
        if key is not None and isinstance(value, Mapping):
            state[name] = _model_state(value) if name == "model" else dict(value)
            taken_keys.add(key)
    rest = {k: v for k, v in obj.items() if k not in taken_keys}
    if "model" not in state:
        return "torch.save (dict)", {"extra": dict(obj)}
    if rest:
        state["extra"] = rest
    return "torch.save (training dict)", state


def _accelerate_model(path: Path, load_file: Callable[[Path], dict[str, Any]],
                      opts: ReadOptions) -> dict[str, Any] | None:
    for name in ("model.safetensors", "pytorch_model.bin"):  # lexists: a FIFO or a dangling link by these
        if os.path.lexists(path / name):                       # names is refused, not passed over
            return load_file(path / name) if name.endswith(".safetensors") else \
                torch_load(path / name, opts)
    for index in INDEX_FILES:
        if os.path.lexists(path / index):
            return load_index(path / index, load_file, opts)
    return None


def load_index(index: Path, load_file: Callable[[Path], dict[str, Any]], opts: ReadOptions) -> dict[str, Any]:
    """The model state of the shards a sharded model's index JSON lists (transformers' save_pretrained)."""
    shards = index_shards(index)
    path = index.parent
    _check_zips_together(index, [path / s for s in shards if not s.endswith(".safetensors")])
    out: dict[str, Any] = {}
    for shard in shards:
        out.update(load_file(path / shard) if shard.endswith(".safetensors") else
                   torch_load(path / shard, opts))
    return out


def _check_zips_together(index: Path, paths: list[Path]) -> None:
    """The zip budget for a sharded model's .bin shards taken together: each file alone may unpack to
    zip_budget's 128 MiB floor, so a thousand small deflated shards would otherwise take 128 GiB."""
    zips = [p for p in paths if os.path.lexists(p) and not p.is_dir() and file_kind(p) == "torch-zip"]
    if len(zips) < 2:
        return
    size = sum(p.stat().st_size for p in zips)
    declared = sum(check_zip(p) for p in zips)
    if declared > zip_budget(size):
        raise CheckpointError(
            f"{index} lists {len(zips)} torch.save shards of {size} bytes in all whose members declare {declared} "
            f"bytes unpacked; torchplace unpacks at most {zip_budget(size)} from shards this size (torch.save never "
            "compresses, so they were re-packed or crafted). Fix: if you trust their origin, load them with "
            "torch.load and save them again.")


def index_shards(index: Path) -> list[str]:
    """The shard file names a sharded model's index JSON lists (plain names in its folder only)."""
    fix = "Fix: copy the index file again from where the model was saved."
    try:
        data = safeio.loads(safeio.read_limited(index, MAX_INDEX_BYTES, CheckpointError, fix))
    except ValueError as exc:
        raise CheckpointError(f"{index} is not valid JSON ({exc}). {fix}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} has no 'weight_map' of tensor names to shard files. {fix}")
    shards = sorted(set(weight_map.values()))
    odd = next((s for s in shards if s in ("", ".", "..", index.name) or "/" in s or "\\" in s or "\0" in s), None)
    if odd is not None:
        what = "the index itself" if odd == index.name else f"not a file name in {index.parent}"
        raise CheckpointError(f"{index} names shard {odd!r:.80}, which is {what} (only the shard files beside "
                              f"the index are read). {fix}")
    return shards


def load_accelerate(path: Path, load_file: Callable[[Path], dict[str, Any]],
                    opts: ReadOptions) -> tuple[dict[str, Any], list[str]]:
    """State of an accelerate `save_state` directory, and notes on what was left out."""
    state: dict[str, Any] = {}
    notes: list[str] = []
    model = _accelerate_model(path, load_file, opts)
    if model is not None:
        state["model"] = model
    for name, files in STATE_FILES:
        file = next((f for f in files if os.path.lexists(path / f)), None)
        if file is not None:
            state[name] = torch_load(path / file, opts)
    extra_models = sorted(n for n in os.listdir(path) if n.startswith("model_") and n.endswith(".safetensors"))
    if extra_models:
        state["extra"] = {n.removesuffix(".safetensors"): load_file(path / n) for n in extra_models}
    if os.path.lexists(path / TRAINER_STATE):  # where the Trainer's run stood (global_step, epoch)
        try:
            raw = safeio.read_limited(path / TRAINER_STATE, MAX_INDEX_BYTES, CheckpointError, FIX_COMPLETE)
            state.setdefault("extra", {})["trainer_state"] = safeio.loads(raw)
        except (CheckpointError, ValueError) as exc:  # the weights and optimizer load without it
            notes.append(f"{TRAINER_STATE} left out: {exc}")
    rng_files = sorted(n for n in os.listdir(path) if n.startswith(("random_states_", "rng_state")))
    if rng_files:
        if opts.trust_pickle:
            state.setdefault("extra", {})["random_states"] = torch_load(path / rng_files[0], opts, map_location="cpu")
        else:
            notes.append(f"{', '.join(rng_files)} left out: accelerate and the Trainer pickle numpy's RNG state "
                         "(pass trust_pickle=True to include it)")
    if not state:
        raise CheckpointError(f"{path} is a directory with no checkpoint torchplace recognises (no model.safetensors, "
                              "pytorch_model.bin, optimizer.bin or DCP .metadata). Fix: point at a checkpoint file.")
    return state, notes
