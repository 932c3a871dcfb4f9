"""Host buffers a background save copies the state into: reused across saves, pinned once on a GPU.

A save in the background must copy the state at the call, so training may change it at once. The
copy goes into slabs of host memory laid out like the file's data region; they are kept and reused
(pinning is slow, and the pinned-memory cache keeps blocks of power-of-two sizes), and grow only when
the state grows. `memory_problem` checks the host can hold them before anything is allocated.

A sharded model's shards are copied by torch's own stager (the one `dcp.async_save` uses), kept with
the slot: it keeps each shard's host copy for the next save of the same tensors (pinned once).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from ..shared.staging import SideStreams, accelerators, host_buffer
from ..units import format_bytes
from . import codec
from .fileio import Planned, write_planned
from .format import SMALL_TENSOR_BYTES, TensorEntry
from .stream import byte_view, write_region

SLAB_BYTES = 256 * 2**20  # a multiple of format.CHUNK_BYTES, and a power of two (pinned memory is cached in those)
SMALL_ROUND = 2**20
HEADROOM_BYTES = 512 * 2**20  # host memory left free after allocating staging buffers
JOIN_BYTES = 16 * 2**20  # at most so many bytes of small tensors joined into one copy (device memory, briefly)


class HostStaging:
    """A reusable host copy of one state's data region: one buffer, or equal slabs of SLAB_BYTES.

    Pinned when the state lives on a CUDA device, so the device-to-host copy runs at the link's speed
    without a bounce. Kept between saves; grows (allocating only the difference) when a state outgrows it.
    """

    def __init__(self) -> None:
        self.slabs: list[torch.Tensor] = []
        self.pinned = False
        self._side = SideStreams()  # the background save overlaps its device-to-host copy on CUDA side streams
        self._dcp: Any = None  # torch's StateDictStager for sharded states, made on first use
        self._dcp_pinned = False
        self.dcp_bytes = 0  # bytes of shards the DCP stager last copied (and keeps for the next save)
        self._last: _Layout | None = None  # the last copy's layout, by tree path (for start_repeat)
        self._early: _Queued | None = None  # copies start_repeat queued, until start_copy takes them
        self._targets: dict[tuple[int, int], list[tuple[int, int, torch.Tensor]]] = {}  # _put's, by (start, bytes)
        self.repeated = False  # whether the last start_copy took start_repeat's copies

    def _layout(self, nbytes: int, pinned: bool) -> tuple[list[torch.Tensor], list[int]]:
        """(slabs to keep, sizes of slabs to allocate) for holding NBYTES, pinned if PINNED."""
        usable = self.slabs if self.pinned or not pinned else []  # pageable slabs cannot take fast device copies
        if sum(s.numel() for s in usable) >= nbytes:
            return usable, []
        if nbytes <= SLAB_BYTES:  # one buffer, replaced by a bigger one
            return [], [-(-nbytes // SMALL_ROUND) * SMALL_ROUND]
        whole = [s for s in usable if s.numel() == SLAB_BYTES]  # slabs of a larger state, kept
        return whole, [SLAB_BYTES] * (-(-nbytes // SLAB_BYTES) - len(whole))

    def need(self, nbytes: int, pinned: bool) -> int:
        """Bytes that `ensure(nbytes, pinned)` would allocate (0: the buffers are reused)."""
        return sum(self._layout(nbytes, pinned)[1])

    def ensure(self, nbytes: int, pinned: bool) -> None:
        """Make room for NBYTES, allocating only what the kept buffers lack."""
        keep, sizes = self._layout(nbytes, pinned)
        if not sizes:
            return
        self.settle()  # no copy may still write into the slabs replaced
        self._last = None
        self._targets = {}
        if not keep:
            self.pinned = pinned
        self.slabs = keep  # dropped buffers go back to torch's (pinned) host cache
        self.slabs += [host_buffer(n, self.pinned) for n in sizes]

    def dcp_need(self, nbytes: int, pinned: bool) -> int:
        """Bytes that staging NBYTES of shards would allocate: those beyond what the kept stager holds
        (an estimate: its copies are reused for the same source tensors, as in a training loop)."""
        if self._dcp is None or self._dcp_pinned != pinned:
            return nbytes
        return max(0, nbytes - self.dcp_bytes)

    def dcp_stage(self, tensors: dict[str, Any], pinned: bool) -> dict[str, Any]:
        """A host copy of TENSORS (DTensors keep their sharding, with local tensors in host memory), complete
        on return; made by torch's own stager (the one DefaultStager wraps), kept for the next save: it
        reuses each tensor's host copy, pinned once."""
        try:
            from torch.distributed.checkpoint._state_dict_stager import StateDictStager
        except ImportError:
            raise CheckpointError(f"save_async of a sharded model copies its shards with torch's DCP StateDictStager, "
                                  f"which this torch ({torch.__version__}) does not have. Fix: upgrade torch, or save "
                                  "this model with tp.save (it waits for the write).") from None
        if self._dcp is None or self._dcp_pinned != pinned:
            # StateDictStager itself, not DefaultStager: torch 2.11's DefaultStager closes its StateDictStager
            # after every stage, which frees the host copies and empties its copy table, so the next stage of
            # a state holding a class object fails with KeyError: <class 'type'> (seen on the H200 run of
            # 2026-12-01). Pinned and non-blocking copies only for a state on a GPU (both need an accelerator).
            self._dcp = StateDictStager(pin_memory=pinned, share_memory=False)
            self._dcp_pinned, self.dcp_bytes = pinned, 0
        staged = self._dcp.stage(tensors, non_blocking=pinned)
        if pinned:  # the copies are complete on return: on every device they were queued on, which need
            for device in accelerators(tensors):  # not be the current one (a model moved to cuda:1 without set_device)
                torch.accelerator.synchronize(device)
        self.dcp_bytes = local_bytes(tensors)
        return dict(staged)

    def write_file(self, path: Path, planned: Planned, info: dict[str, Any], workers: int) -> None:
        """Write PLANNED to PATH with its data region from this staged copy (checksums, fsync, rename:
        as every torchplace file)."""
        def data(sink: Any, offset: int, chunk: int, n: int | None) -> list[str]:
            return write_region(sink, offset, self.slabs, planned.data_bytes, chunk, workers=n)

        write_planned(path, planned, info=info, workers=workers, data=data)

    def copy_in(self, planned: Planned) -> None:
        """Copy every tensor of PLANNED to its place in the data region; return once all copies are done."""
        self.start_copy(planned)()

    def start_repeat(self, tree: Any) -> None:
        """Queue the copies of a save of the same state as the last one before its tree is encoded: where
        TREE holds, at the paths the last copy found them, tensors of the same dtypes, shapes and devices
        (numpy arrays, such as numpy's RNG state, as the encoder stores them), each goes into the last layout
        now, so the device copies while the caller encodes the tree. Each copy is queued as soon as its
        tensor is found (the device starts on the first while the rest are looked up); where one is not
        found, the copies queued are waited for and nothing is kept: a changed state is copied once, by
        `start_copy`, which takes these copies if the plan is the same (else waits for them and copies again)."""
        last = self._last
        if last is None:
            return

        def found(e: TensorEntry, device: torch.device) -> torch.Tensor | None:
            return _leaf(tree, last.paths[e.key], e, device)

        self._early = self._queue(last.groups, found)
        if self._early is not None:
            self._early.entries = last.entries

    def repeat_plan(self) -> Planned | None:
        """The last copy's plan (layout and devices, no tree or tensors) while `start_repeat` has found every
        one of its tensors again (same dtypes, shapes and devices at the same paths), for `plan_file(like=)`."""
        last = self._last
        if self._early is None or last is None:
            return None
        return Planned(None, [], last.entries, last.devices, {}, last.paths)

    def start_copy(self, planned: Planned) -> Callable[[], None]:
        """Queue the copy of every tensor of PLANNED to its place in the data region; return the wait for it.

        On a CUDA device the copies go on that device's side stream, which first waits for the work queued
        on the current one (so they copy the state as it is at the call); each run of small tensors
        (plan_layout puts them together) is joined on the device (torch.cat) and crosses the link in one
        copy. Until the wait returns, the copies still read the tensors (kept referenced until then).
        The copies `start_repeat` queued are taken as they are when they took PLANNED's tensors into its
        layout."""
        early, self._early = self._early, None
        self.repeated = early is not None and early.holds(planned)
        if early is not None:
            if self.repeated:
                return early.wait
            early.wait()
        groups = _groups(planned)
        tensors = planned.tensors
        self._targets = {}  # a new layout: the slab views kept are those of this one alone (bounded)
        queued = self._queue(groups, lambda e, _: tensors[e.key])
        assert queued is not None  # every entry's tensor is PLANNED's
        keys = [e.key for e in planned.entries]
        self._last = _Layout(planned.entries, planned.paths, groups, planned.devices) \
            if all(k in planned.paths for k in keys) else None
        return queued.wait

    def settle(self) -> None:
        """Wait for copies `start_repeat` queued that no `start_copy` took (the call failed in between)."""
        early, self._early = self._early, None
        if early is not None:
            early.wait()

    def _queue(self, groups: dict[torch.device, list[list[TensorEntry]]],
               source: Callable[[TensorEntry, torch.device], torch.Tensor | None]) -> _Queued | None:
        """Queue the copy of each entry of GROUPS from its tensor, SOURCE(entry, device), run by run; None (once
        the copies queued are done) where SOURCE has no tensor for an entry."""
        queued = _Queued()
        for device, runs in groups.items():
            cuda = device.type == "cuda"
            if cuda:  # the side stream sees everything queued before this call
                queued.streams.append(self._side(device))
                # cuda-only: the background save overlaps its device-to-host copy on CUDA streams (measured on
                # H200); other back ends copy synchronously
                queued.streams[-1].wait_stream(torch.cuda.current_stream(device))  # cuda-only: CUDA side streams
            with torch.cuda.stream(queued.streams[-1]) if cuda else nullcontext():  # cuda-only: CUDA side streams
                for run in runs:
                    views = []
                    for e in run:
                        t = source(e, device)
                        if t is None:
                            queued.wait()
                            return None
                        queued.sources[e.key] = t
                        views.append(byte_view(t))
                    queued.keep += views
                    pieces = [(e.start, v) for e, v in zip(run, views)]
                    if len(views) > 1:
                        try:
                            pieces = [(run[0].start, torch.cat(views))]
                        except torch.OutOfMemoryError:  # no device memory for the joined run: one copy each
                            pass
                        queued.keep.append(pieces[0][1])
                    for start, src in pieces:
                        self._put(src, start, cuda)
        return queued

    def _put(self, src: torch.Tensor, start: int, non_blocking: bool) -> None:
        """Copy the flat bytes SRC to the data region at START (across slabs where it spans them); the slab
        views for each (start, size) are kept, as a repeated save copies to the same places every time."""
        targets = self._targets.get((start, src.numel()))
        if targets is None:
            targets = self._targets[(start, src.numel())] = []
            size = self.slabs[0].numel()
            pos, end = start, start + src.numel()
            while pos < end:
                k, at = divmod(pos, size)
                n = min(end - pos, size - at)
                targets.append((pos - start, pos - start + n, self.slabs[k][at:at + n]))
                pos += n
        if len(targets) == 1:
            targets[0][2].copy_(src, non_blocking=non_blocking)
            return
        for lo, hi, dst in targets:
            dst.copy_(src[lo:hi], non_blocking=non_blocking)


@dataclass
class _Layout:
    """A copy's layout with where in the state tree each tensor was: what a save of the same state reuses."""

    entries: list[TensorEntry]
    paths: dict[str, tuple[Any, ...]]
    groups: dict[torch.device, list[list[TensorEntry]]]
    devices: dict[str, Any]


@dataclass
class _Queued:
    """Copies queued into the slabs: the side streams they run on, what they read (kept until `wait`), and
    the tensor each entry was copied from."""

    streams: list[Any] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    entries: list[TensorEntry] = field(default_factory=list)  # the whole layout they copy into

    def wait(self) -> None:
        for s in self.streams:
            s.synchronize()
        self.keep.clear()
        self.sources.clear()

    def holds(self, planned: Planned) -> bool:
        """Whether these copies are PLANNED's: the same layout, each entry copied from the very tensor
        PLANNED writes there (same memory, same strides)."""
        if planned.entries != self.entries:
            return False
        for key, s in self.sources.items():
            t = planned.tensors.get(key)
            if t is None or t.data_ptr() != s.data_ptr() or t.stride() != s.stride() or t.device != s.device:
                return False
        return True


def _leaf(tree: Any, path: tuple[Any, ...], entry: TensorEntry, device: torch.device) -> torch.Tensor | None:
    """The tensor at PATH in TREE (dict keys and list indices, as codec.encode walked it) as the encoder
    stores it, if it is a plain dense tensor of ENTRY's dtype and shape on DEVICE; else None (moved, or changed)."""
    try:
        for step in path:
            tree = tree[step]
    except (KeyError, IndexError, TypeError):
        return None
    t = codec.array_tensor(tree) if isinstance(tree, np.ndarray) else tree
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_conj() or t.is_neg() \
            or t.dtype != entry.dtype or t.shape != entry.shape or t.device != device:
        return None
    return t.detach()


def _groups(planned: Planned) -> dict[torch.device, list[list[TensorEntry]]]:
    """PLANNED's tensors with bytes by device, each device's in data-region order as the pieces copied
    at once: a tensor of SMALL_TENSOR_BYTES or more alone, neighbours smaller than that together (up to
    JOIN_BYTES a piece)."""
    out: dict[torch.device, list[list[TensorEntry]]] = {}
    last: list[TensorEntry] = []  # the piece of small tensors being filled, if the previous entry was one
    joined = 0
    for e in planned.entries:
        if not e.nbytes:
            continue
        device = planned.tensors[e.key].device
        small = e.nbytes < SMALL_TENSOR_BYTES
        if small and last and planned.tensors[last[-1].key].device == device and joined + e.nbytes <= JOIN_BYTES:
            last.append(e)
            joined += e.nbytes
            continue
        out.setdefault(device, []).append([e])
        last, joined = (out[device][-1], e.nbytes) if small else ([], 0)
    return out


def memory_problem(need: int, available: int, *, headroom: int = HEADROOM_BYTES) -> str | None:
    """Why NEED more bytes of host memory cannot be taken when AVAILABLE are free, or None."""
    if need <= 0 or available - need >= headroom:
        return None
    return (f"needs {format_bytes(need)} more host memory for its staging copy of the state, but "
            f"{format_bytes(available)} is available (and {format_bytes(headroom)} is left free for the rest)")


def local_bytes(tensors: dict[str, Any]) -> int:
    """Bytes of TENSORS held by this process (a DTensor's local shard, not its global size)."""
    total = 0
    for t in tensors.values():
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def check_memory(what: str, need: int, max_in_flight: int) -> None:
    """Refuse (CheckpointError naming WHAT) when NEED more bytes of host memory cannot be taken now."""
    problem = memory_problem(need, available_memory()) if need > 0 else None  # reused buffers: nothing to ask
    if problem:
        raise CheckpointError(f"{what} {problem}; nothing was saved. Fix: free host memory, lower max_in_flight "
                              f"(now {max_in_flight}), or use torchplace.save, which needs no host copy.")


def available_memory() -> int:
    """Bytes of host memory that new allocations can take now (psutil's reading)."""
    import psutil

    return int(psutil.virtual_memory().available)
