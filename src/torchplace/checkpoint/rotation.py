"""Keep the last N checkpoints of a directory and a `latest` pointer; find the newest complete one.

The pointer is a small JSON file named `latest` beside the checkpoints, replaced atomically after
each new checkpoint is durable:

    {"format": "torchplace-latest/1", "latest": "step-300.safetensors",
     "history": ["step-100.safetensors", "step-200.safetensors", "step-300.safetensors"],
     "pending_delete": []}

Rotation only ever deletes files it recorded in `history` (never other files of the directory),
and only after the pointer no longer names them; a deletion cut short by a crash stays in
`pending_delete` and is retried by the next save. Resuming does not trust the pointer blindly:
`complete_checkpoints` reads every torchplace header in the directory and orders the complete
ones by creation time, so a save killed after its rename but before the pointer update, or a
file damaged later, still resolves to the newest checkpoint that is whole.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .atomic import write_bytes
from .format import read_header

POINTER = "latest"
POINTER_FORMAT = "torchplace-latest/1"


def _plain_name(name: Any) -> bool:
    return (isinstance(name, str) and name == Path(name).name and not name.startswith(".")
            and name not in ("", POINTER))


def read_pointer(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The parsed `latest` pointer of DIRECTORY, or None if there is none or it is unreadable."""
    try:
        data = json.loads((Path(directory) / POINTER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != POINTER_FORMAT:
        return None
    for field in ("history", "pending_delete"):
        data[field] = [n for n in data.get(field) or [] if _plain_name(n)]
    return data


def _remove(path: Path) -> bool:
    """Delete a checkpoint file, or a sharded checkpoint (symlink plus the directory it names)."""
    try:
        if path.is_symlink():
            real = path.parent / os.readlink(path)
            path.unlink()
            if real.parent == path.parent and real.name.startswith("."):
                shutil.rmtree(real, ignore_errors=True)
        else:
            path.unlink()
        return True
    except FileNotFoundError:
        return False


def rotate(target: Path, keep_last: int | None) -> list[Path]:
    """Record TARGET (already durable) as the latest; delete the oldest beyond KEEP_LAST; return them."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r}: keep at least 1 checkpoint (or None to keep all).")
    directory = target.parent
    old = read_pointer(directory) or {}
    history = [n for n in old.get("history", []) if n != target.name and os.path.lexists(directory / n)]
    history.append(target.name)
    pending = [n for n in old.get("pending_delete", []) if n not in history and os.path.lexists(directory / n)]
    if keep_last is not None and len(history) > keep_last:
        pending += history[:-keep_last]
        history = history[-keep_last:]
    pointer = {"format": POINTER_FORMAT, "latest": target.name, "history": history, "pending_delete": pending,
               "updated_unix": time.time()}
    write_bytes(directory / POINTER, (json.dumps(pointer, indent=1) + "\n").encode())
    return [directory / n for n in pending if _remove(directory / n)]


def _created(path: Path) -> float | None:
    """Creation time recorded in PATH's torchplace header, or None when PATH is not a complete one."""
    from .distributed import SIDE_FILE, is_dcp_dir

    probe = path / SIDE_FILE if is_dcp_dir(path) else path
    try:
        meta = read_header(probe).meta
    except (CheckpointError, OSError):
        return None
    if meta is None:
        return None
    created = meta.get("created_unix")
    return float(created) if isinstance(created, (int, float)) else 0.0


def complete_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Torchplace checkpoints in DIRECTORY whose headers are whole, newest first.

    Only headers are read (sizes, structure, header checksum); tensor checksums are checked by
    `load`, which moves on to the next one if the newest turns out damaged.
    """
    directory = Path(directory)
    found = []
    for entry in os.scandir(directory):
        if entry.name.startswith(".") or entry.name == POINTER:
            continue
        path = Path(entry.path)
        created = _created(path)
        if created is not None:
            found.append((created, entry.stat().st_mtime, entry.name, path))
    found.sort(reverse=True)
    return [item[3] for item in found]


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in DIRECTORY, or None."""
    found = complete_checkpoints(directory)
    return found[0] if found else None
