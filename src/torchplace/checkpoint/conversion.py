"""Turn another tool's checkpoint into a torchplace one: on the CPU, prefixes stripped, no pickle.

Reads torch.save files (plain state dicts, training dicts, Lightning checkpoints), accelerate
`save_state` directories and safetensors files the same way `load` does (weights_only, mapped to
the CPU, so a file saved on a GPU converts on a machine without one), strips the `module.` /
`_orig_mod.` wrapper prefixes from the model's keys, and writes the result with
`torchplace.save`'s format, so it loads fast, verified and safely from then on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .fileio import write_file
from .reading import read_any
from .state import strip_prefixes


@dataclass
class Converted:
    """What `convert` wrote and what it changed."""

    path: Path
    source_tool: str
    stripped_prefix: str = ""
    tensors: int = 0
    notes: list[str] = field(default_factory=list)


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, trust_pickle: bool = False) -> Converted:
    """Convert the checkpoint at SRC into a torchplace checkpoint at DST (written atomically)."""
    src, dst = Path(src), Path(dst)
    tool, state, meta, notes = read_any(src, dev=torch.device("cpu"), model=None, optimizer=None,
                                     trust_pickle=trust_pickle)
    prefix = ""
    model = state.get("model")
    if isinstance(model, dict):
        prefix = strip_prefixes(list(model))
        if prefix:
            state["model"] = {k[len(prefix):]: v for k, v in model.items()}
    info = {"world_size": meta.get("world_size", 1), "objects": meta.get("objects", {}),
            "primary_device": "cpu", "converted_from": {"path": str(src), "tool": tool}}
    if "module_versions" in meta:
        info["module_versions"] = meta["module_versions"]
    write_file(dst, state, info=info)
    count = sum(1 for _ in _tensors(state))
    return Converted(dst, tool, prefix, count, list(notes))


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
