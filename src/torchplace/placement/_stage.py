"""Staging one batch for DeviceLoader: host batch in, device batch (and its events) out.

Runs on the loader's worker thread, whose current stream is the loader's side stream for the
thread's whole life (`Stager.on_worker`), so every allocation and copy below lands there.

Memory: device buffers come from the side stream's pool and are marked with `record_stream`
for the consumer's stream, here, once per buffer (one for all packed tensors). When the
consumer drops a batch the allocator reuses its memory only after the consumer's stream has
passed the point of the drop. The worker never runs more than `prefetch` batches ahead of the
step the device is at (see loader._produce), so the blocks waiting for that point are bounded.

Why not allocate from the consumer's pool (no record_stream)? The side stream would then have
to wait, before every copy, for all the work the consumer's stream had queued when the buffer
was allocated, since any of it may use that reused memory. A host that runs ahead has always
queued the step just before, so each copy would wait for that step and the next step for the
copy: copies would never overlap compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..shared.tree import walk
from . import _hostcopy, _pack, _slots
from .collate import PackedBatch, pin_buffer, pin_slot
from .transfer import _Mover, _other_to, pin_tensor

_Tensor = torch.Tensor
_strided = torch.strided


class Staged(NamedTuple):
    batch: Any
    ready: Any  # event on the side stream after the copies and the transform (None: no streams)
    started: Any  # event for the consumer to record on its stream when it takes the batch
    keep: list[torch.Tensor]  # strided device tensors holding the batch, for record_stream on another stream
    source_read: Any  # event after the copies that read the caller's own pinned memory, or None


class Stager:
    """Turns one host batch into a device batch (called on the worker thread).

    With streams (MOD is torch.cuda or torch.xpu) the copies go on the SIDE stream from pinned
    memory and an event marks the batch ready; without, copies follow `to_device`'s rules.
    """

    def __init__(self, device: torch.device, mod: Any, side: Any, consumer: Any,
                 transform: Callable[[Any], Any] | None, pack: bool) -> None:
        self.device, self.mod, self.side, self.consumer = device, mod, side, consumer
        self.transform, self.pack = transform, pack
        self.streams = mod is not None
        self.host_target = device.type == "cpu"  # nothing to copy for host tensors
        self._mover = _Mover(device, None)
        self._events: list[Any] = []  # events known to be done with: reused, not remade
        self._spinning: list[Any] = []
        self.owner: Any = None  # who settles the slots this stager holds (`_slots.settle`): None, the thread
        self._native = self.streams and _switches_natively(device, side, mod)

    # -- events ---------------------------------------------------------------------------------

    def _event(self) -> Any:
        """An event whose synchronize() sleeps rather than spins: the worker may wait a whole step on one."""
        if self._events:
            return self._events.pop()
        try:
            return self.mod.Event(blocking=True)
        except TypeError:  # a backend without the flag
            return self.mod.Event()

    def _spin_event(self) -> Any:
        """An event whose synchronize() spins: waited for between two copies, where latency counts."""
        return self._spinning.pop() if self._spinning else self.mod.Event()

    def handed(self, token: Any) -> None:
        """The consumer took a batch: wait until the device reached that point, recycle the events."""
        if token is not None:
            started, ready = token
            started.synchronize()
            self._events += (started, ready)  # the consumer's wait on READY is already queued

    def source_done(self, event: Any) -> None:
        """Wait until the copies that read the caller's own pinned memory are done."""
        event.synchronize()
        self._spinning.append(event)

    def on_worker(self) -> contextlib.AbstractContextManager:
        """The worker thread's device and current stream (the side stream), for its whole life."""
        stack = contextlib.ExitStack()
        if self.streams:
            stack.enter_context(self.mod.device(self.device))
            stack.enter_context(self.mod.stream(self.side))
        return stack

    def on_side(self) -> contextlib.AbstractContextManager:
        """The side stream as current (and its device) while one batch is staged on another thread."""
        if self._native:
            return _SideStream(self.side, self.device.index)
        return self.mod.stream(self.side) if self.streams else contextlib.nullcontext()

    def hand_out(self, item: Staged) -> Any:
        """The consumer's side of taking ITEM: its stream waits for the copy; returns the token that
        tells the stager when the device has reached this point (None without streams)."""
        if item.ready is None:
            return None
        stream = self.consumer
        if not self._native or torch.accelerator.current_stream(self.device.index).stream_id != stream.stream_id:
            stream = self.mod.current_stream(self.device)
            if stream != self.consumer:  # iterated under another stream than iter() saw: protect it there too
                for t in item.keep:
                    t.record_stream(stream)
        stream.wait_event(item.ready)
        # Done once the device has finished the steps before this one and this batch's copy.
        # Recorded after the wait, nothing is queued between it and the free of the batch your
        # loop drops next (the previous one), so the stager, waiting for it, finds that memory
        # reusable; recorded before, it completed at once on an idle stream, ahead of that free.
        item.started.record(stream)
        return item.started, item.ready

    # -- one batch ------------------------------------------------------------------------------

    def __call__(self, batch: Any) -> Staged:
        if type(batch) is PackedBatch:
            return self._packed(batch)
        leaves, small, key, big, others = self._collect(batch)
        moved = list(leaves)
        keep: list[torch.Tensor] = []
        packed = gathered = ()
        if len(small) == 1:  # one small tensor: a copy of its own is as cheap
            big += small
        elif small:
            plan = _pack.layout_of(tuple(key))
            # One collate made them all: pinned (a DataLoader with pin_memory) or all pageable.
            # A pageable one among pinned ones is still copied right, only synchronously.
            if self.streams and leaves[small[0]].is_pinned():
                gathered = small
            else:
                packed = small
        wait = None
        if packed:  # pageable: packed into one pinned buffer on the host, copied once
            tensors = [leaves[i] for i in packed]
            staging = torch.empty(plan.total, dtype=torch.uint8, pin_memory=self.streams)
            wait = _hostcopy.start(_pack.views(staging, plan), tensors, plan.nbytes)  # helpers copy ...
            if self.streams:
                buf = torch.empty(plan.total, dtype=torch.uint8, device=self.device)
            else:
                wait()
                wait, buf = None, self._mover.tensor(staging)
            for i, view in zip(packed, _pack.views(buf, plan)):  # ... while this thread makes the views
                moved[i] = view
            keep.append(buf)
        direct = False
        if gathered:  # pinned already: one device buffer, copied into straight from each tensor
            tensors = [leaves[i] for i in gathered]
            dst = torch.empty(plan.total, dtype=torch.uint8, device=self.device)
            views = _pack.views(dst, plan)
            _pack.copy(views, tensors, non_blocking=True)
            for i, view in zip(gathered, views):
                moved[i] = view
            keep.append(dst)
            direct = True
        for i in big:
            moved[i], reads_source = self._one(leaves[i])
            keep.extend(_memory_of(moved[i]))
            direct = direct or reads_source
        source_read = None
        if direct:
            source_read = self._spin_event()
            source_read.record(self.side)
        if others:  # unknown internals: moved on the consumer's stream, synchronously
            with self._consumer_stream():
                for i in others:
                    x = leaves[i]
                    moved[i] = _other_to(x, self.device, False) if self.streams else self._mover.other(x)
        replacements = iter(moved)
        out = walk(batch, lambda _: next(replacements), lambda _: next(replacements))
        if wait is not None:
            wait()
            buf.copy_(staging, non_blocking=True)  # one copy; the pinned block is reused only after it
            del staging
        return self._finish(out, keep, source_read)

    def _packed(self, batch: PackedBatch) -> Staged:
        """A batch packed in the DataLoader's workers (`packed_collate`): one copy of its buffer, views
        of the device buffer in its slots, its other tensors and objects moved as in `__call__`."""
        keep: list[torch.Tensor] = []
        direct = False  # True when a copy reads the caller's own pinned memory
        src, lease = batch.buffer, batch.lease
        if not self.streams:
            buf = self._mover.tensor(src)
        elif lease is not None and pin_slot(lease):  # a worker's slot, page-locked in place (once per slot)
            buf = src.to(self.device, non_blocking=True)
            done = self._event()
            done.record(self.side)
            _slots.hold_until(done, src, self.owner)  # the slot is written again only after this copy has read it
        else:  # pinned here when the DataLoader did not pin (its pin_memory=False), by the copy helpers
            # No wait for this copy before the next pull (unlike a caller's pinned tensors): a packed
            # buffer is never written again, and torch keeps a pinned block until copies reading it end.
            buf = (src if src.is_pinned() else pin_buffer(src)).to(self.device, non_blocking=True)
        keep.append(buf)

        def tensor(t: torch.Tensor) -> torch.Tensor:
            nonlocal direct
            if t.device == self.device:
                return t
            moved, reads_source = self._one(t)
            keep.extend(_memory_of(moved))
            direct = direct or reads_source
            return moved

        def other(x: Any) -> Any:
            if not self.streams:
                return self._mover.other(x)
            with self._consumer_stream():
                return _other_to(x, self.device, False)

        out = batch.rebuild(buf, tensor, other)
        source_read = None
        if direct:
            source_read = self._spin_event()
            source_read.record(self.side)
        return self._finish(out, keep, source_read)

    def _finish(self, out: Any, keep: list[torch.Tensor], source_read: Any) -> Staged:
        """The transform, record_stream for the consumer's stream, and the ready event."""
        if not self.streams:
            return Staged(self.transform(out) if self.transform else out, None, None, [], None)
        if self.transform is not None:
            out = self.transform(out)
            keep = self._device_tensors(out)  # the transform made new tensors: find them all
        for t in keep:
            t.record_stream(self.consumer)
        ready = self._event()
        ready.record(self.side)
        return Staged(out, ready, self._event(), keep, source_read)

    def _collect(self, batch: Any) -> tuple[list[Any], list[int], list[tuple], list[int], list[int]]:
        """One pass over BATCH: its leaves in order, and the indices of the small tensors to copy
        together (with their (dtype, shape) for the layout), of the tensors to copy alone, and of
        the objects with their own `.to()`. This runs for every tensor of every batch, so the
        `_pack.packable` test is inlined.

        Small tensors are copied together in one of two ways (see __call__): pageable ones are
        packed into one pinned buffer on the host, which they need anyway to be copied
        asynchronously; pinned ones are copied straight into views of one device buffer, with no
        host memcpy. For 64 pinned tensors of 64 KiB on an H200 machine, the second took 262 µs,
        packing alone 508 µs (docs/results/experiments/, round 3).
        """
        leaves: list[Any] = []
        small: list[int] = []
        key: list[tuple] = []
        big: list[int] = []
        others: list[int] = []
        dev, limit, dtypes = self.device, _pack.MAX_TENSOR_BYTES, _pack._DTYPES
        can_pack = self.pack and not self.host_target

        def tensor(x: torch.Tensor) -> torch.Tensor:
            i = len(leaves)
            leaves.append(x)
            if type(x) is _Tensor and can_pack:
                dtype = x.dtype
                if (x.is_cpu and x.layout is _strided and not x.is_nested and not x.requires_grad and dtype in dtypes
                        and x.nbytes <= limit and x.is_contiguous()):
                    small.append(i)
                    key.append((dtype, x.shape))
                    return x
            if x.device != dev:
                big.append(i)
            return x

        def other(x: Any) -> Any:
            others.append(len(leaves))
            leaves.append(x)
            return x

        walk(batch, tensor, other)
        return leaves, small, key, big, others

    def _consumer_stream(self) -> contextlib.AbstractContextManager:
        return self.mod.stream(self.consumer) if self.streams else contextlib.nullcontext()

    def _one(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Copy one tensor; True when the copy reads the caller's own pinned memory."""
        if not self.streams:
            return self._mover.tensor(x), False
        if x.device.type != "cpu":  # another device: torch orders both streams
            return x.to(self.device, non_blocking=True), False
        if x.is_pinned():  # pinned already (the DataLoader's pin_memory): copy straight from it
            return x.to(self.device, non_blocking=True), True
        return pin_tensor(x).to(self.device, non_blocking=True), False

    def _device_tensors(self, batch: Any) -> list[torch.Tensor]:
        """One tensor per device storage in BATCH (packed views share one)."""
        seen: dict[int, torch.Tensor] = {}
        dev = self.device

        def fn(t: torch.Tensor) -> torch.Tensor:
            if t.device == dev:
                for part in _memory_of(t):  # a sparse or nested tensor: the tensors that hold its memory
                    seen.setdefault(part.untyped_storage().data_ptr(), part)
            return t

        walk(batch, fn, None)
        return list(seen.values())


class _SideStream:
    """STREAM made current for one `with` block through torch.accelerator's C++ calls, the thread's
    stream and device restored after. The device module's context manager and current_stream look the
    device up in Python several times: for a packed batch staged on the loop's thread they were the
    largest cost after the views themselves."""

    __slots__ = ("_device", "_index", "_prev", "_stream")

    def __init__(self, stream: Any, index: int) -> None:
        self._stream, self._index = stream, index

    def __enter__(self) -> None:
        acc = torch.accelerator
        self._device = acc.current_device_index()
        self._prev = acc.current_stream(self._index)
        acc.set_stream(self._stream)

    def __exit__(self, *exc: object) -> None:
        acc = torch.accelerator
        acc.set_stream(self._prev)  # makes the stream's device current too
        if self._device != self._index:
            acc.set_device_index(self._device)


def _switches_natively(device: torch.device, side: Any, mod: Any) -> bool:
    """Whether torch.accelerator switches DEVICE's current stream as its device module sees it (CUDA, XPU).
    A back end written in Python gets no C++ device guard (hardware/accelerator.py), so it is tried once
    here, and one where the two disagree keeps the device module's context manager."""
    acc = getattr(torch, "accelerator", None)
    if device.index is None or acc is None or not hasattr(acc, "set_stream"):
        return False
    try:
        current = acc.current_accelerator()
        if current is None or current.type != device.type:
            return False
        switch = _SideStream(side, device.index)
        with switch:
            seen = acc.current_stream(device.index).stream_id == side.stream_id and mod.current_stream(device) == side
        return bool(seen) and mod.current_stream(device).stream_id == switch._prev.stream_id
    except Exception:  # noqa: BLE001 - any failure means the module's own context manager is the way
        return False


def _memory_of(t: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors that hold T's memory: T itself, or a sparse tensor's indices and values, a
    nested tensor's values and offsets. torch refuses record_stream on sparse and nested tensors
    (NotImplementedError on SparseCUDA), so the batch's memory is kept for the consumer through these."""
    if t.is_nested:
        parts = [t.values()]
        if t.layout is torch.jagged:
            parts += [x for x in (t.offsets(), t.lengths()) if x is not None]
        return parts
    layout = t.layout
    if layout is _strided:
        return [t]
    if layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []
