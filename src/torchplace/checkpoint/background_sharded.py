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
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from . import distributed as tpdist
from .fileio import Planned, plan_file, write_planned
from .rotation import rotate
from .saving import collect_side, series_info
from .staging import HostStaging, check_memory, local_bytes
from .stream import write_region

_group: tuple[Any, Any] | None = None  # (the default group it was made for, the gloo group)


def writer_group() -> Any:
    """The gloo group background sharded saves use (made on first use, on every rank: a collective)."""
    global _group
    world = dist.group.WORLD
    if _group is None or _group[0] is not world:
        _group = (world, dist.new_group(backend="gloo"))
    return _group[1]


def stage_sharded(fut: Any, staging: HostStaging, target: Path, model: nn.Module, optimizer: Any,
                  side: tuple[Any, Any, Any, dict[str, Any], Any, dict[str, Any]], *, keep_last: int | None,
                  rotate_after: bool, allow_pickle: bool, max_in_flight: int,
                  threads: Callable[[int], int]) -> Callable[[], None]:
    """Copy this rank's shards of MODEL (and OPTIMIZER) and, on rank 0, the side file's state (SIDE:
    scheduler, scaler, extra, more_state, RNG tree, metadata) into STAGING; return the write to run in
    the background (every rank runs its own)."""
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
    token = tpdist.broadcast(secrets.token_hex(4))
    group = writer_group()
    tmp_dir = tpdist.dcp_folder(target, token)
    n = threads(nbytes)

    def write() -> None:
        import torch.distributed.checkpoint as dcp

        error: BaseException | None = None
        try:  # every rank writes its shards; DCP's coordinator (rank 0) then writes .metadata
            dcp.save(staged, storage_writer=dcp.FileSystemWriter(str(tmp_dir), thread_count=n), process_group=group)
        except BaseException as exc:
            error = _dcp_error(exc, target)
        status = (True, "")
        if rank == 0:
            if error is None and planned is not None:
                try:
                    _write_side(tmp_dir / tpdist.SIDE_FILE, planned, staging,
                                {**meta, **series_info(target, rotate_after)}, n)
                    tpdist.publish_folder(tmp_dir, target, token)
                    if rotate_after:
                        rotate(target, keep_last)
                except BaseException as exc:
                    error = exc
            if error is not None:
                status = (False, f"{type(error).__name__}: {error}")
        ok, message = tpdist.broadcast(status, group=group)  # every rank ends with rank 0's outcome
        if rank == 0 and not ok and not (target.is_symlink() and target.resolve() == tmp_dir.resolve()):
            shutil.rmtree(tmp_dir, ignore_errors=True)  # never published: nothing points at it
        if error is not None:
            raise error
        if not ok:
            raise CheckpointError(f"rank 0 could not save {target}, so no rank has a new checkpoint: {message}")

    return write


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


def _write_side(path: Path, planned: Planned, staging: HostStaging, info: dict[str, Any], workers: int) -> None:
    """Write the side file from its staged copy (checksums, fsync, rename: as every torchplace file)."""
    def data(sink: Any, offset: int, chunk: int, n: int | None) -> list[str]:
        return write_region(sink, offset, staging.slabs, planned.data_bytes, chunk, workers=n)

    write_planned(path, planned, info=info, workers=workers, data=data)
