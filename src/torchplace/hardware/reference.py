"""The reference snapshots shipped with torchplace (package data under hardware/snapshots/): recorded
machines that `--snapshot h200x2` and `read_facts(snapshot="h200x2")` name, so the docs' first
commands run from a pip install."""

from __future__ import annotations

import os
from pathlib import Path

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
