"""Whether a starting program continues from a checkpoint: the decision `setup()` makes.

The decision is pure: it takes what every rank found in the checkpoint folder and whether the
launcher restarted the job, and returns the file to load (or none) with the reason, for the summary
setup() prints. The folder's reading and writing (`checkpoint.rotation.newest_name`, `mark_started`) and
the loading stay in the callers.

A restart torchrun does not count. When a node is started again (or replaced) while the other
nodes' workers still run (a frozen or unreachable host: their collective waits instead of failing),
torchrun's agents restart those workers as a membership change, which leaves
TORCHELASTIC_RESTART_COUNT at 0 on every node, so no rank knows it is a restart. What does tell:
the job's run id (`--rdzv-id`, one per job, the same on every node and across restarts), which rank
0 writes into the checkpoint folder (`JOB_FILE`) when the job starts there; a later start that
finds its own run id there is a restart of the same job and continues.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .. import safeio
from ..errors import CheckpointError

#: the file in checkpoint_dir naming the job (torchrun's run id) that started there last
JOB_FILE = ".torchplace-job"
MAX_JOB_FILE_BYTES = 64 * 2**10  # {"run_id": ...}: a run id is a few dozen characters

Resume = bool | Literal["auto"]


@dataclass(frozen=True)
class ResumeDecision:
    """The checkpoint to continue from (None: start from the beginning) and why."""

    path: Path | None
    reason: str


def job_id(run_id: str | None) -> str | None:
    """The id that names one job across its restarts: torchrun's run id, but not its default "none"
    (every job started without --rdzv-id has it). None outside torchrun."""
    return run_id if run_id and run_id != "none" else None


def started_here(checkpoint_dir: str | os.PathLike[str] | None, job: str | None) -> bool:
    """Whether the job JOB (a `job_id`) started in CHECKPOINT_DIR before (its `JOB_FILE` names it)."""
    if job is None or checkpoint_dir is None:
        return False
    try:  # a regular file of a few bytes: a FIFO or /dev/zero planted under the name must not block or fill memory
        record = safeio.loads(safeio.read_limited(Path(checkpoint_dir) / JOB_FILE, MAX_JOB_FILE_BYTES,
                                                  CheckpointError, ""))
    except (CheckpointError, ValueError):
        return False
    return isinstance(record, dict) and record.get("run_id") == job


def decide_resume(resume: Resume, checkpoint_dir: str | os.PathLike[str] | None, restarted: bool,
                  found: Sequence[str | None], hosts: Sequence[str] = (),
                  same_job: str | None = None) -> ResumeDecision:
    """Decide where the program starts.

    resume: "auto" continues only when the launcher restarted the job (torchrun's `--max-restarts`)
        and a complete checkpoint exists; True continues from the newest one now (and requires
        one); False never continues.
    found: the newest complete checkpoint's name as each rank sees it (rank 0 first); ranks that
        see another one have another folder, which setup() refuses rather than mix states.
    same_job: this job's run id when checkpoint_dir shows that it started there before
        (`started_here`): a restart torchrun did not count, which "auto" continues too.
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
            return ResumeDecision(None, "restarted by the launcher; no checkpoint_dir was given, so torchplace "
                                        "chose nothing to continue from (rt.resume_from is None) and the program's "
                                        "own code decides; setup(checkpoint_dir=...) lets rt.resume() continue")
        return ResumeDecision(None, "")
    if resume == "auto" and not restarted and same_job is None:
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
    why = ("resume=True" if resume is True else "restarted by the launcher" if restarted else
           f"job {same_job!r} started in this folder before (a node started again or replaced: a restart "
           "torchrun does not count)")
    if newest is None:
        if resume is True:
            raise CheckpointError(f"resume=True, but {checkpoint_dir} holds no complete torchplace checkpoint. "
                                  "Fix: point checkpoint_dir at the folder the run saved into, or drop resume=True "
                                  "to start from the beginning.")
        return ResumeDecision(None, f"{why}, but {checkpoint_dir} holds no complete checkpoint yet: starting "
                                    "from the beginning")
    path = Path(checkpoint_dir) / newest
    return ResumeDecision(path, f"{why}: continuing from {path}, the newest complete checkpoint")
