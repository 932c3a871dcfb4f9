"""Whether a starting program continues from a checkpoint: the decision `setup()` makes.

Pure: it takes what every rank found in the checkpoint folder and whether the launcher restarted
the job, and returns the file to load (or none) with the reason, for the summary setup() prints.
The reading (`newest_name`) and the loading stay in the callers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import CheckpointError
from .rotation import latest

Resume = bool | Literal["auto"]


@dataclass(frozen=True)
class ResumeDecision:
    """The checkpoint to continue from (None: start from the beginning) and why."""

    path: Path | None
    reason: str


def newest_name(checkpoint_dir: str | os.PathLike[str] | None) -> str | None:
    """The file name of the newest complete checkpoint in CHECKPOINT_DIR, or None (none, or no folder)."""
    if checkpoint_dir is None or not Path(checkpoint_dir).is_dir():
        return None
    found = latest(checkpoint_dir)
    return found.name if found is not None else None


def decide_resume(resume: Resume, checkpoint_dir: str | os.PathLike[str] | None, restarted: bool,
                  found: Sequence[str | None], hosts: Sequence[str] = ()) -> ResumeDecision:
    """Decide where the program starts.

    resume: "auto" continues only when the launcher restarted the job (torchrun's `--max-restarts`)
        and a complete checkpoint exists; True continues from the newest one now (and requires
        one); False never continues.
    found: the newest complete checkpoint's name as each rank sees it (rank 0 first); ranks that
        see another one have another folder, which setup() refuses rather than mix states.
    """
    if resume not in (True, False, "auto"):
        raise CheckpointError(f"resume={resume!r} is not understood. Fix: pass resume='auto' (continue "
                              "after a launcher restart), True (continue now) or False (never).")
    if resume is False:
        return ResumeDecision(None, "resume=False: starting from the beginning")
    if checkpoint_dir is None:
        if resume is True:
            raise CheckpointError("resume=True needs the folder the checkpoints are in. Fix: pass "
                                  "setup(checkpoint_dir='runs/my-run', resume=True).")
        if restarted:
            return ResumeDecision(None, "restarted by the launcher, but no checkpoint_dir was given: starting "
                                        "from the beginning (pass setup(checkpoint_dir=...) to continue)")
        return ResumeDecision(None, "")
    if resume == "auto" and not restarted:
        return ResumeDecision(None, "")
    newest = found[0] if found else None
    differ = [(rank, name) for rank, name in enumerate(found) if name != newest]
    if differ:
        rank, name = differ[0]
        host = f" on {hosts[rank]}" if rank < len(hosts) else ""
        raise CheckpointError(
            f"Rank 0 sees {newest or 'no checkpoint'} as the newest complete checkpoint in {checkpoint_dir}, "
            f"but rank {rank}{host} sees {name or 'none'} ({len(differ)} rank(s) differ): the folder is not one "
            "shared file system for every node. Fix: put checkpoint_dir on storage every node mounts at the "
            "same path (NFS, Lustre), or copy the checkpoint to every node before the restart.")
    why = "restarted by the launcher" if resume == "auto" else "resume=True"
    if newest is None:
        if resume is True:
            raise CheckpointError(f"resume=True, but {checkpoint_dir} holds no complete torchplace checkpoint. "
                                  "Fix: point checkpoint_dir at the folder the run saved into, or drop resume=True "
                                  "to start from the beginning.")
        return ResumeDecision(None, f"{why}, but {checkpoint_dir} holds no complete checkpoint yet: starting "
                                    "from the beginning")
    path = Path(checkpoint_dir) / newest
    return ResumeDecision(path, f"{why}: continuing from {path}, the newest complete checkpoint")
