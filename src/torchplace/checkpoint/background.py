"""`torchplace.save_async`: checkpoints written while training goes on.

    pending = torchplace.save_async(f"ckpt/step-{step:06d}.safetensors", model=model, optimizer=opt,
                                    extra={"step": step}, keep_last=3)
    ...                    # train on: the file will hold the state as it was at the call
    pending.result()       # the path, or the save's CheckpointError

At the call, the state is collected and encoded as `save` does, and every tensor's bytes are copied
into a host staging buffer laid out exactly like the file's data region (from a GPU: one copy
into pinned memory, on a side stream that first waits for the work queued on the current one; the
small tensors, which the layout keeps together, are joined on the device and cross in one copy; the
call returns once the copy is complete, so training may change the model at once). A save of the same
state as the previous one (the same tensors at the same places: a training loop's) starts its copies
into the previous layout before encoding, so the device copies while the CPU encodes; the plan is
then checked to be the same (else those copies are redone). A writer thread,
started while the copy runs and held until it is done, then does what `save` does from there:
checksums, temporary file, fsync, rename, rotation.

Sharded models (FSDP, DTensor parameters) go through torch.distributed.checkpoint as with `save`:
every rank calls save_async, copies its own shards to host memory at the call (torch's stager, the
one `dcp.async_save` uses) and writes them in the background into a temporary folder, which rank 0
publishes atomically once every rank is done (`stage_sharded`). Each rank then holds a host
copy of its shards (for FSDP about 1/world size of the model and optimizer state), pinned on a GPU,
kept and reused by the next save of the same tensors.

Writer priority: the writer threads (at most MAX_BACKGROUND_WORKERS, default 4, each pwrite + CRC-32
of 16 MiB chunks) lower their own CPU priority by WRITER_NICE (default 10, Linux; best effort), so
training's threads win a contended CPU (docs/checkpoints.md). Both are module constants.

Memory: the staging buffer holds the state's tensor bytes, rounded up to 1 MiB (states up to
256 MiB) or to 256 MiB slabs (larger states); one buffer per save in flight (`max_in_flight`,
default 1: a save called while the previous one still writes waits for it first). Buffers are
kept and reused by the next save (pinned once, never per save); they grow only when the state
does. Before allocating, save_async checks that much memory is available (psutil) and refuses
with the numbers otherwise.

Errors: `SaveFuture.result()` raises the write's CheckpointError; an error nobody collected is
raised by the next save_async (which then saves nothing), and at interpreter exit pending saves
are waited for (a sharded one at most SHARDED_EXIT_WAIT_S: its collectives need every rank, and a
rank that died would hang the exit; what is abandoned is printed) and uncollected errors printed.
In a process group rank 0 copies and writes and other ranks' calls return done futures, so a call
under `if rank == 0:` works as it does for `save` (the file then holds rank 0's RNG states); with
`all_ranks=True` every rank calls it and every rank's RNG states are gathered at the call (a sharded
model: every rank writes its shards, and every future ends once rank 0 has published the folder; a
failure at the call on any one rank is raised at the call on every rank, before any collective of the save), and a
failure of any rank's write is raised on every rank at the next save_async. Call `result()`
before destroying the process group: a sharded write needs it. A forked child (a DataLoader worker)
neither writes nor waits for its parent's saves; its copies of their futures refuse result().
"""

from __future__ import annotations

import atexit
import os
import secrets
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from . import sharded as tpsharded
from .fileio import Planned, plan_file
from .rotation import rotate, series_lock
from .saving import capture_rng, check_request, collect_side, collect_state, series_info, torch_order
from .staging import HostStaging, check_memory, local_bytes
from .stream import default_workers, lower_priority

MAX_BACKGROUND_WORKERS = 4  # writer threads: enough for a disk, few enough to leave the CPU to training
WRITER_NICE = 10  # how much the writer threads lower their CPU priority (Linux nice; 0: not at all)
SHARDED_EXIT_WAIT_S = 60.0  # at exit, how long to wait for a sharded write (its collectives need every peer)


def _writer_threads(workers: int | None) -> Callable[[int], int]:
    """Writer threads for a save of so many bytes: WORKERS if given, else up to MAX_BACKGROUND_WORKERS."""
    return lambda nbytes: workers or min(MAX_BACKGROUND_WORKERS, default_workers(nbytes))

class SaveFuture:
    """The outcome of one `save_async`: `result()` waits for the file; `done()` asks without waiting.

    Attributes:
        path: the checkpoint being written.
        wait_s: seconds the call waited for an earlier save to finish (`max_in_flight`).
        copy_s: seconds the call spent copying the state to host memory.
        allocated_bytes: host memory the call allocated (0 once the staging buffers are reused).
        pinned: whether the staging copy is in pinned memory (a state on a CUDA device).
        repeated: whether the copies started before the state was encoded, into the previous save's layout
            (a save of the same tensors at the same places as the previous one, as in a training loop).
        writer_nice: the writer thread's nice value once it started (Linux; None elsewhere).
        sharded_rank: this process's rank when the save is of a sharded model (every rank writes), else None.

    `stall_s` is what training waited: `wait_s + copy_s`. `result(timeout=None)` returns the path
    or raises the save's `CheckpointError` (`TimeoutError` past TIMEOUT); `exception()` returns
    that error instead of raising it.

    Example:
        ```python
        import torch
        import torchplace as tp

        model = torch.nn.Linear(4, 2)
        future = tp.save_async("async.safetensors", model=model)
        print(f"training waited {future.stall_s * 1e3:.1f} ms")
        print(future.result(timeout=60), future.done())
        ```
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.wait_s = self.copy_s = 0.0
        self.allocated_bytes = 0
        self.pinned = False
        self.repeated = False
        self.written_here = True
        self.writer_nice: int | None = None
        self.sharded_rank: int | None = None  # this process's rank, for a sharded save (every rank writes)
        self._event = threading.Event()
        self._error: CheckpointError | None = None
        self._collected = False
        self._pid = os.getpid()  # a forked child holds a copy that no thread of its own will ever finish
        self._alone: tpsharded.AloneSave | None = None  # rank 0 of a group, saving alone: told at _finish

    @property
    def stall_s(self) -> float:
        return self.wait_s + self.copy_s

    def done(self) -> bool:
        """True once the file is complete (or the save failed)."""
        return self._event.is_set()

    def exception(self, timeout: float | None = None) -> CheckpointError | None:
        """Wait like result(); return the save's error (now collected) or None."""
        if not self._event.is_set() and os.getpid() != self._pid:
            raise CheckpointError(f"the background save of {self.path} is written by process {self._pid}, which forked "
                                  f"this one ({os.getpid()}) meanwhile. Fix: call result() in process {self._pid}.")
        if not self._event.wait(timeout):
            raise TimeoutError(f"the background save of {self.path} was still writing after {timeout} s")
        self._collected = True
        return self._error

    def result(self, timeout: float | None = None) -> Path:
        """Wait (at most TIMEOUT seconds: then TimeoutError) for the file; return its path or raise its error."""
        error = self.exception(timeout)
        if error is None:
            return self.path
        try:
            raise error
        finally:  # this frame joins the error's traceback: it must not hold the error (or this future, holding it)
            del error, self

    def _finish(self, error: CheckpointError | None) -> None:
        self._error = error
        if self._alone is not None:
            try:
                self._alone.post(error)  # the other ranks' futures end with this one
            except Exception:  # noqa: BLE001 - the group may be gone at exit: the outcome stays this rank's
                pass
        self._event.set()

    def __repr__(self) -> str:
        state = "writing" if not self.done() else "failed" if self._error else "done"
        return f"SaveFuture({str(self.path)!r}, {state})"


class Gate:
    """Holds a save's writer thread until the call's copies are complete: `open` lets it write; `cancel`
    (the call failed after starting it) lets it end without writing."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._go = False

    def open(self) -> None:
        self._go = True
        self._event.set()

    def cancel(self) -> None:
        self._event.set()

    def wait(self) -> bool:
        """Wait for open() (True) or cancel() (False)."""
        self._event.wait()
        return self._go


class BackgroundSaver:
    """Background saves of one process: staging buffers kept for reuse, saves written one after another."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._idle: list[HostStaging] = []
        self._pending: list[SaveFuture] = []
        self._failed: list[SaveFuture] = []
        self._tail: threading.Event | None = None  # set when the newest submitted save has ended

    def acquire(self, max_in_flight: int) -> tuple[HostStaging, float]:
        """Wait until fewer than MAX_IN_FLIGHT saves are pending; a staging buffer and the seconds waited."""
        start = time.perf_counter()
        with self._cond:
            while len(self._pending) >= max_in_flight:
                self._cond.wait()
            del self._idle[max_in_flight:]  # more kept than may be in use: give the memory back
            staging = self._idle.pop() if self._idle else HostStaging()
        return staging, time.perf_counter() - start

    def drop_buffers(self) -> None:
        """Free the staging buffers kept for the next save (host memory, pinned on a GPU): the next save
        allocates its own again (as the first save of a process does)."""
        with self._cond:
            self._idle.clear()

    def give_back(self, staging: HostStaging) -> None:
        with self._cond:
            self._idle.append(staging)
            self._cond.notify_all()

    def uncollected(self) -> SaveFuture | None:
        """The oldest failed save whose error nobody has seen (marked seen now), or None."""
        with self._cond:
            self._failed = [f for f in self._failed if not f._collected]
            if not self._failed:
                return None
            failed = self._failed.pop(0)
            failed._collected = True
            return failed

    def submit(self, fut: SaveFuture, staging: HostStaging, write: Callable[[], None], gate: Gate | None = None
               ) -> None:
        """Run WRITE on a writer thread of lowered priority, after the saves submitted before it (and,
        with GATE, once it opens: the thread starts while the call's copies are still running)."""
        with self._cond:
            before, self._tail = self._tail, threading.Event()
            tail = self._tail
            self._pending.append(fut)

        def run() -> None:
            if gate is None or gate.wait():
                error = written(fut, before, write, WRITER_NICE)
            else:  # the call failed after starting this thread, and raised: nothing to write or report
                error, fut._collected = None, True
                if before is not None:  # the saves after this one still wait for the ones before it
                    before.wait()
            with self._cond:
                self._pending.remove(fut)
                if error is not None:
                    self._failed.append(fut)
                self._idle.append(staging)
                self._cond.notify_all()
            fut._finish(error)
            tail.set()

        threading.Thread(target=run, name="torchplace-save-async", daemon=True).start()

    def at_exit(self) -> None:
        """Wait for pending saves; print the errors nobody collected."""
        with self._cond:
            pending = list(self._pending)
        if pending:
            names = ", ".join(str(f.path) for f in pending)
            print(f"torchplace: waiting for {len(pending)} background checkpoint save(s) to finish: {names}",
                  file=sys.stderr, flush=True)
        deadline = time.monotonic() + SHARDED_EXIT_WAIT_S
        for fut in pending:
            if fut.sharded_rank is None:
                fut._event.wait()
            elif not fut._event.wait(max(0.0, deadline - time.monotonic())):
                # its collectives wait for a peer that may be gone: exit rather than hang forever
                print(f"torchplace: abandoned the background save of {fut.path} (sharded, rank {fut.sharded_rank}): "
                      f"still writing after {SHARDED_EXIT_WAIT_S:g} s at exit (a rank that died or exited without "
                      "calling result()?); its temporary folder may be left, the previous checkpoint is untouched.",
                      file=sys.stderr, flush=True)
        while (failed := self.uncollected()) is not None:
            print(f"torchplace: a background checkpoint save failed and its error was never collected: "
                  f"{failed._error}", file=sys.stderr, flush=True)


_saver: BackgroundSaver | None = None
_saver_lock = threading.Lock()
_inherited: list[Any] = []  # in a forked child: the parent's staging buffers, never freed here


def _forget_after_fork() -> None:
    """In a forked child (a DataLoader worker): no writer thread is here; never write or wait for the parent's saves.

    The parent's staging buffers stay referenced: they are pinned through the parent's CUDA context, and
    freeing one here calls CUDA, which a forked child cannot (the worker aborts with 'initialization error').
    """
    global _saver, _saver_lock
    _saver_lock = threading.Lock()  # a thread may have held it at the fork
    if _saver is not None:
        _inherited.append(vars(_saver).copy())
        _saver.__init__()  # type: ignore[misc]  # nothing pending, nothing failed, no buffers of the parent's


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_after_fork)


def default_saver() -> BackgroundSaver:
    """This process's BackgroundSaver (made on first use, with the exit handler that waits for it)."""
    global _saver
    with _saver_lock:
        if _saver is None:
            _saver = BackgroundSaver()
            atexit.register(_saver.at_exit)
        return _saver


def _follow(fut: SaveFuture, alone: tpsharded.AloneSave | None) -> None:
    """End FUT, another rank's, once rank 0's save ALONE is (at once where there is none to wait for)."""
    if alone is None:
        fut._finish(None)
        return

    def wait() -> None:
        try:
            alone.wait()
        except CheckpointError as exc:
            fut._finish(exc)
        else:
            fut._finish(None)

    threading.Thread(target=wait, name="torchplace-save-async-follow", daemon=True).start()


def save_async(path: str | os.PathLike[str] | nn.Module | Mapping[str, Any], f: str | os.PathLike[str] | None = None,
               /, *, model: nn.Module | Mapping[str, Any] | None = None,
               optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
               extra: Mapping[str, Any] | None = None, keep_last: int | None = None, latest: bool = False,
               rng_state: bool = True, allow_pickle: bool = False, all_ranks: bool = False, max_in_flight: int = 1,
               workers: int | None = None, **more_state: Any) -> SaveFuture:
    """`torchplace.save`, written in the background: return once the state is copied.

    Keeps save's guarantees (atomic, fsync, checksums, `keep_last` / `latest`, rank 0 writes; a
    sharded model: every rank writes its shards through torch.distributed.checkpoint into a folder
    published atomically). The checkpoint holds the state at the call: training may change the model
    as soon as this returns. Each save in flight needs a host copy of the state's tensors (this
    rank's shards for a sharded model; see the module docstring).

    `save_async(state, path)`, torch.save's order, saves STATE as `save_async(path, model=state)` for a module or
    state dict, as `save_async(path, **state)` for a dict of entries.

    Args:
        path: the file to write, as for `save`.
        f: as for `save`.
        model: as for `save`.
        optimizer: as for `save`.
        scheduler: as for `save`.
        scaler: as for `save`.
        extra: as for `save`.
        keep_last: as for `save`.
        latest: as for `save`.
        rng_state: as for `save`.
        allow_pickle: as for `save`.
        all_ranks: as for `save`: every rank calls it, every rank's RNG states are gathered and an
            earlier failure of any rank's write is raised on every rank. Without it, in a process
            group, rank 0 alone may call it (`if rank == 0:`), and another rank's call returns a future
            that ends with rank 0's write of the same path.
        max_in_flight: saves that may be writing at once (default 1: a call waits for the previous
            save to finish first).
        workers: writer threads (default: up to MAX_BACKGROUND_WORKERS, 4); they run at a CPU
            priority lowered by WRITER_NICE.
        **more_state: as for `save`.

    Returns:
        A `SaveFuture`; its `result()` returns PATH once the file (or sharded folder) is complete.

    Raises:
        CheckpointError: at the call, what `save` raises before writing (bad arguments, state that
            cannot be encoded), host memory for the copy that is not available, or an earlier
            save's error that nobody collected. Errors while writing come from
            `SaveFuture.result()`.

    Example:
        ```python
        import torch
        import torchplace as tp

        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pending = None
        for step in range(1, 4):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            pending = tp.save_async(f"step-{step}.safetensors", model=model, optimizer=opt, keep_last=2)
        print(pending.result())  # wait for the last one before exiting
        ```
    """
    if f is not None or not isinstance(path, (str, os.PathLike)):  # save_async(state, path), as torch.save
        where, state, _ = torch_order("save_async", path, f, {"model": model, "optimizer": optimizer,
                                                              "scheduler": scheduler, "scaler": scaler,
                                                              "extra": extra, **more_state})
        return save_async(where, **state, keep_last=keep_last, latest=latest, rng_state=rng_state,
                          allow_pickle=allow_pickle, all_ranks=all_ranks, max_in_flight=max_in_flight, workers=workers)
    target = check_request(path, keep_last, more_state)
    if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
        raise ValueError(f"max_in_flight={max_in_flight!r}: allow at least 1 save in flight.")
    sharded = model if isinstance(model, nn.Module) and tpsharded.is_sharded(model) else None
    saver = default_saver()
    rank, world_size = tpsharded.world()
    rotate_after = keep_last is not None or latest
    collective = world_size > 1 and (sharded is not None or all_ranks)
    if collective:  # bounded: a call under `if rank == 0:` raises naming the absent ranks instead of hanging
        tpsharded.join_ranks(target, "saving a sharded model" if sharded is not None else "save_async(all_ranks=True)")
    staging: HostStaging | None = None
    posted: tpsharded.AloneSave | None = None  # rank 0's save alone, once the other ranks were told it began
    waited = 0.0
    if rank == 0 or sharded is not None:  # the ranks that write
        staging, waited = saver.acquire(max_in_flight)
    try:
        _raise_earlier_failure(saver, target, world_size if collective else 1)
        rng_tree = capture_rng(rng_state, world_size if collective else 1)
        fut = SaveFuture(target)
        fut.wait_s = waited
        alone = tpsharded.AloneSave(target) if world_size > 1 and not collective else None
        if staging is None:  # another rank: rank 0 writes, and this future ends with rank 0's
            fut.written_here = False
            _follow(fut, alone)
            return fut
        if alone is not None:
            alone.post(writing=True)
            fut._alone = posted = alone
        start = time.perf_counter()
        info: dict[str, Any] = {"world_size": world_size, "rotation": rotate_after}
        if world_size > 1 and not collective and rng_tree is not None:
            info["rng_rank"] = rank  # only rank 0's generators: the others' are not in the file
        if sharded is not None:
            fut.sharded_rank = rank
            write = stage_sharded(fut, staging, target, sharded, optimizer,
                                  (scheduler, scaler, extra, more_state, rng_tree, info), keep_last=keep_last,
                                  rotate_after=rotate_after, allow_pickle=allow_pickle,
                                  max_in_flight=max_in_flight, threads=_writer_threads(workers))
            copied: Callable[[], None] = _copied  # the shards' copies are complete already
        else:
            tree, meta = collect_state(model, optimizer, scheduler, scaler, extra, more_state, rng_tree, info)
            staging.start_repeat(tree)  # the same state as last time: its copies run while the tree is encoded
            planned = plan_file(tree, allow_pickle=allow_pickle, like=staging.repeat_plan())
            del tree
            write, copied = _stage_file(fut, staging, planned, meta, keep_last=keep_last,
                                        rotate_after=rotate_after, max_in_flight=max_in_flight,
                                        threads=_writer_threads(workers))
    except BaseException as exc:
        if posted is not None:  # the other ranks' futures fail with this call
            posted.post(exc)
        if staging is not None:
            staging.settle()  # copies start_repeat queued may still be writing into it
            saver.give_back(staging)
        raise
    gate = Gate()
    saver.submit(fut, staging, write, gate)  # the writer thread starts while the copies run; it owns STAGING now
    try:
        copied()
    except BaseException as exc:
        if fut._alone is not None:  # cancelled: the writer's end must not tell the other ranks it wrote
            fut._alone.post(exc)
            fut._alone = None
        gate.cancel()
        raise
    fut.copy_s = time.perf_counter() - start
    gate.open()
    return fut


def _copied() -> None:
    pass


def _raise_earlier_failure(saver: BackgroundSaver, target: Path, world_size: int) -> None:
    """Raise, on every rank, a background save's error that nobody collected (on any rank)."""
    failed = saver.uncollected()
    if world_size > 1:  # every rank learns of every rank's failure
        messages = tpsharded.all_gather(str(failed._error) if failed is not None else None)
        first = next(((k, m) for k, m in enumerate(messages) if m is not None), None)
        if first is not None and failed is None:
            raise CheckpointError(f"rank {first[0]}'s earlier background save failed, so this "
                                  f"save_async({str(target)!r}) saved nothing on any rank: {first[1]} (Call "
                                  "save_async again to save now.)")
    if failed is not None:
        raise CheckpointError(f"an earlier background save failed and its error was never collected, so this "
                              f"save_async({str(target)!r}) saved nothing: {failed._error} (Call SaveFuture.result() "
                              "to collect a save's error; call save_async again to save now.)") from failed._error


def _stage_file(fut: SaveFuture, staging: HostStaging, planned: Planned, meta: dict[str, Any], *,
                keep_last: int | None, rotate_after: bool, max_in_flight: int,
                threads: Callable[[int], int]) -> tuple[Callable[[], None], Callable[[], None]]:
    """Start copying PLANNED's tensors into STAGING (the file's data region); return (the write of the
    file, the wait for the copies: the caller's tensors may change once it returns)."""
    target = fut.path
    # cuda-only: pinned staging serves the CUDA streams above
    pinned = any(t.device.type == "cuda" for t in planned.tensors.values())
    need = staging.need(planned.data_bytes, pinned)
    check_memory(f"save_async({str(target)!r})", need, max_in_flight)
    staging.ensure(planned.data_bytes, pinned)
    fut.allocated_bytes, fut.pinned = need, staging.pinned
    copied = staging.start_copy(planned)  # holds what the copies read until they are done
    fut.repeated = staging.repeated
    planned.tensors = {}  # keep none of the caller's tensors alive past that
    n = threads(planned.data_bytes)

    def write() -> None:
        with series_lock(target.parent, rotate_after):  # another writer of the series waits its turn
            staging.write_file(target, planned, {**meta, **series_info(target, rotate_after)}, n)
            if rotate_after:
                rotate(target, keep_last)

    return write, copied


# -- the writer thread's part: wait for the saves before it, write at a lowered CPU priority, and hand back
# the error without frames (the future keeps it; frames would keep the staging) --


def written(fut: Any, before: threading.Event | None, write: Callable[[], None], nice: int) -> CheckpointError | None:
    """Run WRITE (after BEFORE is set) at NICE more than the caller's nice value; its CheckpointError
    (without frames) or None. FUT's writer_nice records the priority it ran at."""
    try:
        fut.writer_nice = lower_priority(nice)
        if before is not None:  # saves reach the disk (and the rotation series) in call order
            before.wait()
        write()
    except CheckpointError as exc:
        return without_frames(exc)
    except BaseException as exc:  # reported through the future, never lost in a thread
        error = CheckpointError(f"the background save of {fut.path} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return without_frames(error)
    return None


def without_frames(error: CheckpointError) -> CheckpointError:
    """ERROR with its chain's tracebacks kept as text (a note, Python 3.11+) instead of frames.

    The future keeps its error; frames would keep what they reach (the write's closures, the staging
    buffers, the frame that caught the error and so the error again): a reference cycle that only a
    garbage collection frees, and one in a forked DataLoader worker frees the parent's pinned memory.
    """
    told = traceback.TracebackException.from_exception(error)
    lines = list(told.format())
    text = "".join(lines[:len(lines) - len(list(told.format_exception_only()))])  # the message is said already
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    if hasattr(error, "add_note"):
        error.add_note(f"torchplace: raised in the background writer thread:\n{text.rstrip()}")
    return error


# -- save_async of a sharded model (FSDP, DTensor): DCP's two steps, the copy at the call, the write behind --
# `torch.distributed.checkpoint.async_save` is two steps: copy each rank's shards into host memory
# (torch's DefaultStager), then `dcp.save` them from a thread. save_async takes the same two steps
# itself, so that the background part is a torchplace save like the others:
#
# - the copy happens at the call, on every rank, with a stager kept per staging slot (its host copies
#   are reused by the next save of the same tensors: pinned once, on a GPU);
# - `dcp.save` runs in the writer thread, after the saves called before it (call order), at the
#   writer's lowered priority, on a gloo group of its own: a background thread's collectives never
#   interleave with the training's on the default group, and DCP needs a CPU group (an NCCL default
#   group is not one);
# - then the publish that `save` does: the shards go into `.NAME.dcp-TOKEN`; once every rank's shards
#   and DCP's metadata are written, rank 0 writes the side file (checksummed) and swaps the symlink
#   atomically, then rotates; every rank's future ends after that, with rank 0's outcome.

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
    rank, _ = tpsharded.world()
    failure: BaseException | None = None
    try:
        staged, planned, meta, nbytes = _stage(fut, staging, target, model, optimizer, side, allow_pickle,
                                               max_in_flight)
    except BaseException as exc:  # told to every rank below, then raised
        failure = exc
    token = secrets.token_hex(4) if rank == 0 else ""
    outcomes = tpsharded.all_gather((None if failure is None else f"{type(failure).__name__}: {failure}", token))
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
    tmp_dir = tpsharded.dcp_folder(target, token)
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
                    staging.write_file(tmp_dir / tpsharded.SIDE_FILE, planned, info, n)
                    tpsharded.publish_folder(tmp_dir, target, token)
                    published = True
                    if rotate_after:
                        rotate(target, keep_last)
                except BaseException as exc:
                    error = _rotate_error(exc, target, keep_last) if published else exc
            if error is not None:
                status = (False, f"{type(error).__name__}: {error}", published)
        ok, message, published = tpsharded.broadcast(status, group=group)  # every rank ends with rank 0's outcome
        if rank == 0 and not ok:
            tpsharded.discard_unpublished(tmp_dir, target)
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

    rank, _ = tpsharded.world()
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    tensors, skeleton = tpsharded.flat_tensors({"model": msd, **({"optimizer": osd} if optimizer is not None else {})})
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
