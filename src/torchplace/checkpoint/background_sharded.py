"""save_async of a sharded model (FSDP, DTensor): DCP's two steps, the copy at the call, the write behind.

`torch.distributed.checkpoint.async_save` is two steps: copy each rank's shards into host memory
(torch's DefaultStager), then `dcp.save` them from a thread. save_async takes the same two steps
itself, so that the background part is a torchplace save like the others:

- the copy happens at the call, on every rank, with a stager kept per staging slot (its host copies
  are reused by the next save of the same tensors: pinned once, on a GPU);
- `dcp.save` runs in the writer thread, after the saves called before it (call order), at the
  writer's lowered priority, on a gloo group of its own: a background thread's collectives never
  interleave with the training's on the default group, and DCP needs a CPU group (an NCCL default
  group is not one);
- then the publish that `save` does: the shards go into `.NAME.dcp-TOKEN`; once every rank's shards
  and DCP's metadata are written, rank 0 writes the side file (checksummed) and swaps the symlink
  atomically, then rotates; every rank's future ends after that, with rank 0's outcome.
"""

from __future__ import annotations

import secrets
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from . import distributed as tpdist
from .fileio import Planned, plan_file
from .rotation import rotate
from .saving import collect_side, series_info
from .staging import HostStaging, check_memory, local_bytes

# (the default group it was made for, the gloo group), both weakly: torch's registry owns them until
# destroy_process_group, after which nothing of ours may keep a group (and its threads) alive into exit
_group: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None


def writer_group() -> Any:
    """The gloo group background sharded saves use (made on first use, on every rank: a collective)."""
    global _group
    world = dist.group.WORLD
    group = _group[1]() if _group is not None and _group[0]() is world else None
    if group is None:
        group = dist.new_group(backend="gloo")
        _group = (weakref.ref(world), weakref.ref(group))
    return group


def stage_sharded(fut: Any, staging: HostStaging, target: Path, model: nn.Module, optimizer: Any,
                  side: tuple[Any, Any, Any, dict[str, Any], Any, dict[str, Any]], *, keep_last: int | None,
                  rotate_after: bool, allow_pickle: bool, max_in_flight: int,
                  threads: Callable[[int], int]) -> Callable[[], None]:
    """Copy this rank's shards of MODEL (and OPTIMIZER) and, on rank 0, the side file's state (SIDE:
    scheduler, scaler, extra, more_state, RNG tree, metadata) into STAGING; return the write to run in
    the background (every rank runs its own).

    Every step that can fail on one rank alone (rank 0's side file, each host's memory check, the
    copies) comes first; then one collective tells every rank every rank's outcome (and rank 0's
    token), so a failure anywhere raises the same CheckpointError on every rank, before any other
    collective (a rank waiting in a broadcast its peer never reaches would wait forever)."""
    rank, _ = tpdist.world()
    failure: BaseException | None = None
    try:
        staged, planned, meta, nbytes = _stage(fut, staging, target, model, optimizer, side, allow_pickle,
                                               max_in_flight)
    except BaseException as exc:  # told to every rank below, then raised
        failure = exc
    token = secrets.token_hex(4) if rank == 0 else ""
    outcomes = tpdist.all_gather((None if failure is None else f"{type(failure).__name__}: {failure}", token))
    failed = [(k, message) for k, (message, _) in enumerate(outcomes) if message is not None]
    if failed:
        reasons = "; ".join(f"rank {k}: {message}" for k, message in failed)
        error = CheckpointError(f"save_async({str(target)!r}) of a sharded model saved nothing on any rank: "
                                f"{'rank' if len(failed) == 1 else 'ranks'} {', '.join(str(k) for k, _ in failed)} "
                                f"could not copy its state ({reasons}). Nothing was written; the previous checkpoint "
                                "is untouched.")
        if failure is not None and not isinstance(failure, Exception):
            raise failure  # KeyboardInterrupt and the like, after telling the other ranks
        raise error from failure
    token = outcomes[0][1]
    group = writer_group()
    tmp_dir = tpdist.dcp_folder(target, token)
    n = threads(nbytes)

    def write() -> None:
        import torch.distributed.checkpoint as dcp

        error: BaseException | None = None
        published = False
        try:  # every rank writes its shards; DCP's coordinator (rank 0) then writes .metadata
            dcp.save(staged, storage_writer=dcp.FileSystemWriter(str(tmp_dir), thread_count=n), process_group=group)
        except BaseException as exc:
            error = _dcp_error(exc, target)
        status = (True, "", False)
        if rank == 0:
            if error is None and planned is not None:
                try:
                    info = {**meta, **series_info(target, rotate_after)}
                    staging.write_file(tmp_dir / tpdist.SIDE_FILE, planned, info, n)
                    tpdist.publish_folder(tmp_dir, target, token)
                    published = True
                    if rotate_after:
                        rotate(target, keep_last)
                except BaseException as exc:
                    error = _rotate_error(exc, target, keep_last) if published else exc
            if error is not None:
                status = (False, f"{type(error).__name__}: {error}", published)
        ok, message, published = tpdist.broadcast(status, group=group)  # every rank ends with rank 0's outcome
        if rank == 0 and not ok:
            tpdist.discard_unpublished(tmp_dir, target)
        if error is not None:
            raise error
        if not ok and published:  # the checkpoint is there: only what follows the publish failed
            raise CheckpointError(f"{target} is saved (rank 0 published it), but rank 0 failed after that: {message}")
        if not ok:
            raise CheckpointError(f"rank 0 could not save {target}, so no rank has a new checkpoint: {message}")

    return write


def _stage(fut: Any, staging: HostStaging, target: Path, model: nn.Module, optimizer: Any,
           side: tuple[Any, Any, Any, dict[str, Any], Any, dict[str, Any]], allow_pickle: bool,
           max_in_flight: int) -> tuple[dict[str, Any], Planned | None, dict[str, Any], int]:
    """This rank's part of the call, with no collective: (the staged shards, rank 0's staged side file
    or None, its metadata, this rank's bytes of shards)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, _ = tpdist.world()
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    tensors, skeleton = tpdist.flat_tensors({"model": msd, **({"optimizer": osd} if optimizer is not None else {})})
    del msd, osd
    planned: Planned | None = None
    meta: dict[str, Any] = {}
    if rank == 0:  # the side file: scheduler, scaler, RNG, extras and the trees around the shards
        tree, meta = collect_side(model, *side[:4], skeleton, *side[4:])
        planned = plan_file(tree, allow_pickle=allow_pickle)
    nbytes = local_bytes(tensors)
    pinned = any((t.to_local() if hasattr(t, "to_local") else t).device.type == "cuda" for t in tensors.values())
    side_pinned = planned is not None and any(t.device.type == "cuda" for t in planned.tensors.values())
    need = staging.dcp_need(nbytes, pinned) + (staging.need(planned.data_bytes, side_pinned) if planned else 0)
    check_memory(f"save_async({str(target)!r}) of a sharded model", need, max_in_flight)
    staged = staging.dcp_stage(tensors, pinned)
    del tensors
    if planned is not None:
        staging.ensure(planned.data_bytes, side_pinned)
        staging.copy_in(planned)
        planned.tensors = {}  # the copy is taken: keep none of the caller's tensors alive
    fut.allocated_bytes, fut.pinned = need, pinned
    return staged, planned, meta, nbytes


def _rotate_error(exc: BaseException, target: Path, keep_last: int | None) -> CheckpointError:
    """A failure after TARGET was published (the rotation): the checkpoint is saved, say so."""
    if isinstance(exc, CheckpointError) and "was saved" in str(exc):
        return exc  # rotation's own message says it already
    error = CheckpointError(f"{target} was saved (every rank's shards, published), but rotating the series after it "
                            f"(keep_last={keep_last}, the `latest` pointer) failed: {type(exc).__name__}: {exc}. "
                            f"Fix: check {target.parent} (the older checkpoints may still be there).")
    error.__cause__ = exc
    return error


def _dcp_error(exc: BaseException, target: Path) -> BaseException:
    """DCP's failure as a CheckpointError naming each rank's error in one line (DCP's own message is
    every rank's traceback); other errors as they are."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return exc
    parts = []
    for rank, pair in sorted(failures.items()):
        cause = pair[0] if isinstance(pair, tuple) else pair
        parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
    error = CheckpointError(f"could not save {target}: torch.distributed.checkpoint failed to write the shards "
                            f"({'; '.join(parts)}); the previous checkpoint is untouched. Fix: make "
                            f"{target.parent} a writable directory that every rank sees (a shared file system "
                            "when the ranks run on several hosts).")
    error.__cause__ = exc
    return error
