"""Snapshot files: the reference snapshots shipped with torchplace, reading one, and its renamed keys.

The reference snapshots (package data under hardware/snapshots/) are recorded machines that
`--snapshot h200x2` and `read_facts(snapshot="h200x2")` name, so the docs' first commands run from
a pip install. Keys renamed to carry their unit (`memory_total` -> `memory_total_bytes`, `index` ->
`physical_index`): snapshots and `doctor --json` from before the rename hold the old keys; `upgrade`
reads either, and `with_old_keys` writes the old key beside the new one, so scripts reading
`doctor --json` and older torchplace versions (which require `index`) keep working with snapshots
written now.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import safeio
from ..errors import SnapshotError

SNAPSHOT_DIR = Path(__file__).parent / "snapshots"  # recorded machines, shipped as package data


def snapshot_names() -> list[str]:
    """The reference snapshots shipped with torchplace, by name: `--snapshot h200x2` reads one."""
    return sorted(p.stem for p in SNAPSHOT_DIR.glob("*.json"))


def snapshot_file(spec: str | os.PathLike[str]) -> Path:
    """The file a snapshot argument names: a path, or the name of a reference snapshot shipped with torchplace.

    A value that exists as a file, or that looks like a path (a directory part or a suffix), is a path;
    another one is a name, and an unknown name is refused with the names that exist."""
    path = Path(spec)
    if path.exists() or path.suffix or len(path.parts) != 1:
        return path
    named = SNAPSHOT_DIR / f"{path.name}.json"
    if named.is_file():
        return named
    raise SnapshotError(f"No snapshot named {str(spec)!r}: it is not a file here, nor one of the reference "
                        f"snapshots shipped with torchplace ({', '.join(snapshot_names()) or 'none'}). Fix: "
                        f"--snapshot h200x2 (a recorded 2 x H200 machine), or the path of a file written by "
                        f"`torchplace doctor --json > snap.json`.")


SNAPSHOT_FIX = "Fix: capture it again with `torchplace doctor --json > snap.json` on the machine to describe."
MAX_SNAPSHOT_BYTES = 16 * 2**20  # a snapshot of 8 GPUs is about 20 KiB


def load_snapshot(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a snapshot (a file, or a shipped one by name: snapshot_file) as a dict; errors name the file.

    Only a regular file of at most MAX_SNAPSHOT_BYTES is read (a FIFO or /dev/urandom is refused at
    once), and its JSON may nest at most safeio.MAX_JSON_DEPTH levels."""
    p = snapshot_file(path)
    raw = safeio.read_limited(p, MAX_SNAPSHOT_BYTES, SnapshotError, SNAPSHOT_FIX)
    try:
        data = safeio.loads(raw)
    except ValueError as exc:
        raise SnapshotError(f"Snapshot {p} could not be read as JSON: {exc}. {SNAPSHOT_FIX}") from None
    if not isinstance(data, dict):
        raise SnapshotError(f"Snapshot {p} holds a JSON {type(data).__name__}, not an object. {SNAPSHOT_FIX}")
    return data


# Keys renamed to carry their unit: old name -> new name, per record.

GPU_KEYS = {"index": "physical_index", "memory_total": "memory_total_bytes", "memory_used": "memory_used_bytes",
       "memory_free": "memory_free_bytes"}
MIG_KEYS = {"memory_total": "memory_total_bytes"}
PROCESS_KEYS = {"used_memory": "used_memory_bytes"}
HOST_KEYS = {"memory_total": "memory_total_bytes", "shm_total": "shm_total_bytes", "shm_free": "shm_free_bytes",
        "memlock_soft": "memlock_soft_bytes", "memlock_hard": "memlock_hard_bytes"}
_NESTED = {"mig": MIG_KEYS, "processes": PROCESS_KEYS}


def upgrade(data: Any, renames: dict[str, str]) -> Any:
    """A copy of DATA with each old key under its new name (the new key wins); anything not a dict as is."""
    if not isinstance(data, dict):
        return data
    out = {renames.get(k, k): v for k, v in data.items() if not (k in renames and renames[k] in data)}
    for key, nested in _NESTED.items():
        if renames is GPU_KEYS and isinstance(out.get(key), list):
            out[key] = [upgrade(item, nested) for item in out[key]]
    return out


def with_old_keys(data: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """DATA (written with the new keys) with each old key added after its new one."""
    out: dict[str, Any] = {}
    old_of = {new: old for old, new in renames.items()}
    for key, value in data.items():
        if renames is GPU_KEYS and key in _NESTED and isinstance(value, list):
            value = [with_old_keys(item, _NESTED[key]) for item in value]
        out[key] = value
        if key in old_of:
            out[old_of[key]] = value
    return out
