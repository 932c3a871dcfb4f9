"""Keep the last N checkpoints of a directory and a `latest` pointer; find the newest complete one.

Checkpoints saved with `keep_last` (or `latest=True`) carry `"rotation": true` in their metadata:
they form the directory's rotation series. After each new one is durable, the series is read
back from the headers in the directory, ordered by creation time, the `latest` pointer is
replaced atomically, and only then are the oldest beyond N deleted. Rotation never deletes a file
that is not part of the series (other files of the directory are safe), and a writer killed
between its rename and the pointer update leaves nothing behind for good: the next save finds
that checkpoint in the directory and counts it. The pointer is a small JSON file named `latest`:

    {"format": "torchplace-latest/1", "latest": "step-300.safetensors",
     "history": ["step-200.safetensors", "step-300.safetensors"]}

Resuming does not trust the pointer blindly: `complete_checkpoints` reads every torchplace header
in the directory and orders the complete ones by creation time, so a save killed after its rename
but before the pointer update, or a file damaged later, still resolves to the newest whole one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from ..errors import CheckpointError
from .atomic import write_bytes
from .format import read_header

POINTER = "latest"
POINTER_FORMAT = "torchplace-latest/1"


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
    """Point `latest` at TARGET (already durable); delete the series' oldest beyond KEEP_LAST; return them."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r}: keep at least 1 checkpoint (or None to keep all).")
    directory = target.parent
    series = [p for p in complete_checkpoints(directory, rotation_only=True) if p.name != target.name]
    series = [target] + series  # newest first
    keep, drop = (series[:keep_last], series[keep_last:]) if keep_last is not None else (series, [])
    pointer = {"format": POINTER_FORMAT, "latest": target.name, "history": [p.name for p in reversed(keep)],
               "updated_unix": time.time()}
    write_bytes(directory / POINTER, (json.dumps(pointer, indent=1) + "\n").encode())
    return [p for p in drop if _remove(p)]


def _created(path: Path, rotation_only: bool) -> float | None:
    """Creation time recorded in PATH's torchplace header, or None when PATH is not a complete one
    (or, with ROTATION_ONLY, not one saved with keep_last / latest=True)."""
    from .distributed import SIDE_FILE, is_dcp_dir

    probe = path / SIDE_FILE if is_dcp_dir(path) else path
    try:
        meta = read_header(probe).meta
    except (CheckpointError, OSError):
        return None
    if meta is None or (rotation_only and not meta.get("rotation")):
        return None
    created = meta.get("created_unix")
    return float(created) if isinstance(created, (int, float)) else 0.0


def complete_checkpoints(directory: str | os.PathLike[str], *, rotation_only: bool = False) -> list[Path]:
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
        created = _created(path, rotation_only)
        try:
            if created is not None:
                found.append((created, entry.stat().st_mtime, entry.name, path))
        except FileNotFoundError:  # removed meanwhile (another process's rotation)
            continue
    found.sort(reverse=True)
    return [item[3] for item in found]


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in DIRECTORY, or None."""
    found = complete_checkpoints(directory)
    return found[0] if found else None
