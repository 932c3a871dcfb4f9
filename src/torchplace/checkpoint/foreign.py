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

import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..errors import CheckpointError
from .codec import PICKLE_FIX

MODEL_KEYS = ("model", "model_state_dict", "state_dict", "model_state", "net", "module")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "optimizer_state")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "lr_scheduler_state_dict")
SCALER_KEYS = ("scaler", "grad_scaler", "scaler_state_dict", "amp")
ACCELERATE_FILES = ("optimizer.bin", "scheduler.bin", "scaler.pt", "random_states_0.pkl")


def sniff(path: Path) -> str:
    """What PATH is: safetensors (torchplace's too), torch-zip, torch-pickle, dcp, accelerate, or unknown."""
    from .distributed import SIDE_FILE, is_dcp_dir

    if path.is_dir():
        if is_dcp_dir(path):
            return "dcp" if (path / SIDE_FILE).is_file() else "dcp-foreign"
        names = set(os.listdir(path))
        if names & set(ACCELERATE_FILES) or any(n.startswith(("model", "pytorch_model")) for n in names):
            return "accelerate"
        return "unknown"
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist. Fix: check the path; torchplace.load(DIRECTORY) finds "
                              "the newest checkpoint in a directory.") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}. Fix: check the path and permissions."
                              ) from None
    if len(head) < 9 or head[8:9] == b"{":  # torchplace files are safetensors files too; a stub of
        return "safetensors"              # a few bytes gets the header reader's "truncated" message
    if zipfile.is_zipfile(path):
        return "torch-zip"
    if head[:1] == b"\x80":
        return "torch-pickle"
    return "unknown"


def torch_load(path: Path, map_location: Any, trust_pickle: bool, *, mmap: bool = False) -> Any:
    """torch.load without unrestricted pickle unless TRUST_PICKLE; refusals become CheckpointError."""
    kwargs: dict[str, Any] = {"map_location": map_location, "weights_only": not trust_pickle}
    if mmap:
        kwargs["mmap"] = True
    try:
        return torch.load(path, **kwargs)
    except pickle.UnpicklingError as exc:
        first = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported" in ln or "GLOBAL" in ln), "")
        why = f" ({first})" if first else ""
        raise CheckpointError(f"{path} is a pickle that needs code from the file to load{why}; torchplace "
                              f"does not run code from checkpoints by default. {PICKLE_FIX}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read as a torch.save file: {str(exc).splitlines()[0]}. "
                              "Fix: check that the file is complete (compare its size with the original).") from None


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def _first(obj: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if k in obj and obj[k] is not None:
            return k, obj[k]
    return None, None


def normalize(obj: Any) -> tuple[str, dict[str, Any]]:
    """(tool, state) with state in torchplace's layout: model, optimizer, scheduler, scaler, extra."""
    if _is_state_dict(obj):
        return "torch.save (state dict)", {"model": dict(obj)}
    if not isinstance(obj, Mapping):
        return "torch.save (object)", {"extra": {"object": obj}}
    if "state_dict" in obj and any(k in obj for k in ("pytorch-lightning_version", "lightning_version",
                                                        "global_step", "loops")):
        state: dict[str, Any] = {"model": dict(obj["state_dict"])}
        if obj.get("optimizer_states"):
            state["optimizer"] = obj["optimizer_states"][0]
        if obj.get("lr_schedulers"):
            state["scheduler"] = obj["lr_schedulers"][0]
        taken = {"state_dict", "optimizer_states", "lr_schedulers"}
        state["extra"] = {k: v for k, v in obj.items() if k not in taken}
        version = obj.get("pytorch-lightning_version") or obj.get("lightning_version") or "?"
        return f"lightning {version}", state
    state, taken_keys = {}, set()
    for name, keys in (("model", MODEL_KEYS), ("optimizer", OPTIMIZER_KEYS), ("scheduler", SCHEDULER_KEYS),
                       ("scaler", SCALER_KEYS)):
        key, value = _first(obj, keys)
        if key is not None and isinstance(value, Mapping):
            state[name] = dict(value)
            taken_keys.add(key)
    rest = {k: v for k, v in obj.items() if k not in taken_keys}
    if "model" not in state:
        return "torch.save (dict)", {"extra": dict(obj)}
    if rest:
        state["extra"] = rest
    return "torch.save (training dict)", state


def _accelerate_model(path: Path, load_file: Callable[[Path], dict[str, Any]],
                      map_location: Any, trust_pickle: bool) -> dict[str, Any] | None:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return load_file(path / name) if name.endswith(".safetensors") else \
                torch_load(path / name, map_location, trust_pickle)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            shards = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
            out: dict[str, Any] = {}
            for shard in shards:
                out.update(load_file(path / shard) if shard.endswith(".safetensors") else
                           torch_load(path / shard, map_location, trust_pickle))
            return out
    return None


def load_accelerate(path: Path, load_file: Callable[[Path], dict[str, Any]], map_location: Any,
                    trust_pickle: bool) -> tuple[dict[str, Any], list[str]]:
    """State of an accelerate `save_state` directory, and notes on what was left out."""
    state: dict[str, Any] = {}
    notes: list[str] = []
    model = _accelerate_model(path, load_file, map_location, trust_pickle)
    if model is not None:
        state["model"] = model
    for name, file in (("optimizer", "optimizer.bin"), ("scheduler", "scheduler.bin"), ("scaler", "scaler.pt")):
        if (path / file).is_file():
            state[name] = torch_load(path / file, map_location, trust_pickle)
    extra_models = sorted(n for n in os.listdir(path) if n.startswith("model_") and n.endswith(".safetensors"))
    if extra_models:
        state["extra"] = {n.removesuffix(".safetensors"): load_file(path / n) for n in extra_models}
    rng_files = sorted(n for n in os.listdir(path) if n.startswith("random_states_"))
    if rng_files:
        if trust_pickle:
            state.setdefault("extra", {})["random_states"] = torch_load(path / rng_files[0], "cpu", True)
        else:
            notes.append(f"{', '.join(rng_files)} left out: accelerate pickles numpy RNG state "
                         "(pass trust_pickle=True to include it)")
    if not state:
        raise CheckpointError(f"{path} is a directory with no checkpoint torchplace recognises (no model.safetensors, "
                              "pytorch_model.bin, optimizer.bin or DCP .metadata). Fix: point at a checkpoint file.")
    return state, notes
