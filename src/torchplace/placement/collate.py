"""`packed_collate`: pack each batch's small tensors into one buffer inside the DataLoader's workers.

A batch of many small tensors (recommender features, detection targets, graph batches) costs the
training process a Python object and a few calls per tensor at every stage: unpickling what a
worker sent, pinning, copying, handing out. Packed in the worker, the batch reaches the training
process as one uint8 buffer (in shared memory, so sending it copies nothing), a small layout record
and the batch's skeleton; the DataLoader's pin-memory step pins one buffer (`PackedBatch` has a
`pin_memory()` method, which `torch.utils.data` calls instead of walking the batch); DeviceLoader
(or `to_device`, or `PackedBatch.to`) makes one copy of the buffer and rebuilds the batch as views
of the device buffer.

The layout (`_pack.group_layout`) groups tensors by dtype and trailing shape: a group's tensors
sit one after another (so each starts on its dtype's boundary) and a group starts on a 64-byte
boundary. One `split` (or `unbind`, for 0-dim tensors) per group makes all its views, however many
tensors there are and whatever their first dimension (variable-length sparse features included),
in a function made once per batch structure (`_build`). In a worker, the buffer is one of the
worker's slots (`_slots`), page-locked in place in the training process. Tensors larger
than `max_tensor_bytes` keep their own copy, as do tensors that cannot be viewed back from bytes
(non-contiguous, needing grad, sparse, nested, subclasses, not on the host): DeviceLoader moves
those as it moves any tensor, and the first batch with such a tensor says why, once
(`PackingWarning`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import PackingWarning
from ..shared.tree import depth_error, walk
from ..units import parse_size
from . import _build, _hostcopy, _pack, _slots

_Tensor = torch.Tensor
_warned: set[str] = set()
# Stands where a packed tensor was in the skeleton: a tensor, so the traversal's fast paths for
# dicts and lists see it; on "meta", so it has no bytes to send. One per process: a pickle keeps
# identity, so every slot of a batch unpickles as one object, which `PackedBatch.slot` names.
_SLOT = torch.empty(0, device="meta")
_names = _build.Names()


class PackedBatch:
    """A batch whose small tensors live in one uint8 `buffer`; `to(device)` gives the batch back.

    `layout` says where each packed tensor is (see `_layout`), `skeleton` is the batch with each
    packed tensor replaced by `slot` (large and unpackable tensors and every other value stay in
    it), and `note` says why some tensors were left out of the buffer (None when none were).
    `key` names the batch's structure for the cached rebuild (`_build`; None: walk the skeleton),
    `loose` is False when the skeleton holds nothing to pin or move (every tensor packed). A batch
    packed into a worker's slot (`_slots`) has `ref` in the worker and `lease` here: its bytes
    cross as the slot's number, and the slot is written again only once the batch is gone.
    """

    __slots__ = ("buffer", "count", "key", "layout", "lease", "loose", "note", "ref", "skeleton", "slot")

    def __init__(self, buffer: torch.Tensor, layout: tuple, skeleton: Any, slot: torch.Tensor, count: int,
                 note: str | None = None, key: str | None = None, loose: bool = True,
                 ref: _slots.SlotRef | None = None, lease: _slots.SlotHold | None = None) -> None:
        self.buffer, self.layout, self.skeleton, self.slot, self.count, self.note = (
            buffer, layout, skeleton, slot, count, note)
        self.key, self.loose, self.ref, self.lease = key, loose, ref, lease

    def __reduce__(self) -> tuple:
        if self.ref is not None:  # in a worker's slot: the slot's number goes, not its bytes
            return (_from_slot, (self.ref, self.layout, self.skeleton, self.slot, self.count, self.note, self.key,
                                 self.loose))
        return (PackedBatch, (self.buffer, self.layout, self.skeleton, self.slot, self.count, self.note, self.key,
                              self.loose))

    def __repr__(self) -> str:
        return (f"PackedBatch({self.count} tensors in {self.buffer.numel()} bytes on {self.buffer.device}"
                f"{', pinned' if self.buffer.is_pinned() else ''})")

    def pin_memory(self, device: Any = None) -> PackedBatch:
        """The same batch with the buffer and every other host tensor page-locked (DataLoader calls this).

        A buffer in a worker's slot is page-locked where it is, once per slot: nothing is copied.
        """
        from .transfer import pin

        buf, lease = self.buffer, self.lease
        if lease is None or not pin_slot(lease):
            pinned = pin_buffer(buf)
            if pinned is not buf:  # copied into a pinned block: the slot is free once this batch is gone
                buf, lease = pinned, None
        skeleton = pin(self.skeleton) if self.loose else self.skeleton
        if buf is self.buffer and skeleton is self.skeleton:
            return self
        return PackedBatch(buf, self.layout, skeleton, self.slot, self.count, self.note, self.key, self.loose,
                           lease=lease)

    def is_pinned(self) -> bool:
        return self.buffer.is_pinned()

    def to(self, device: Any, non_blocking: bool | None = None) -> Any:
        """The batch on DEVICE: one copy of the buffer, views of it, every other tensor moved by `to_device`."""
        from .transfer import target_device, to_device

        dev = target_device(device)
        src = self.buffer
        if self.lease is not None and dev.type not in ("cpu", "meta"):
            pin_slot(self.lease)
        buf = to_device(src, dev, non_blocking=non_blocking)
        if self.lease is not None and buf is not src:  # the slot stays busy until the copy has read it
            _hold(src, dev)
        return self.rebuild(buf, lambda t: to_device(t, dev, non_blocking=non_blocking),
                            lambda x: to_device(x, dev, non_blocking=non_blocking))

    def unpack(self) -> Any:
        """The batch where the buffer is (host): the packed tensors as views of it."""
        return self.rebuild(self.buffer, lambda t: t, lambda x: x)

    def rebuild(self, buf: torch.Tensor, tensor: Callable[[torch.Tensor], Any], other: Callable[[Any], Any]) -> Any:
        """The skeleton with views of BUF in the slots, TENSOR(t) for its tensors, OTHER(x) for objects
        with their own `.to()`. Says once why tensors were left out of the buffer, if some were."""
        if self.note is not None:
            _say(self.note)
        if self.key is not None:
            build = _build.builder(self.key, self.skeleton, self.slot, self.layout)
            if build is not None:
                return build(buf, self.skeleton, tensor, other)
        nxt: Callable[[], torch.Tensor] = iter(_pack.group_views(buf, self.layout, self.count)).__next__
        slot = self.slot

        def fn(t: torch.Tensor) -> Any:
            return nxt() if t is slot else tensor(t)

        return walk(self.skeleton, fn, other)


class PackedCollate:
    """The collate function `packed_collate` returns: COLLATE_FN, then the small tensors packed."""

    def __init__(self, collate_fn: Callable[[Any], Any] | None, max_tensor_bytes: int, slots: int | None) -> None:
        self.collate_fn = collate_fn
        self.max_tensor_bytes = max_tensor_bytes
        self.slots = _slots.SLOTS if slots is None else slots
        self.auto_slots = slots is None  # DeviceLoader may raise it to cover a deeper prefetch
        self.batched: bool | None = None  # samples to collate (True) or one batch (batch_size=None); None: guess
        self.token = _slots.claim(self)  # names this collate's rings in the training process
        self.wait_s = _slots.WAIT_S  # how long a worker waits for a free slot
        self._ring: _slots.WorkerRing | None = None
        self.no_ring: str | None = None  # why this worker packs without slots

    def __call__(self, samples: Any) -> Any:
        if self.collate_fn is not None:  # one that recurses for ever is the user's to see: only ours are wrapped
            batch = self.collate_fn(samples)
        else:  # batch_size=None hands the dataset's batch over alone, never in a list
            try:  # torch's default_collate, and our walk below, recurse once a level of nesting
                batch = _default_collate(samples, type(samples) is list if self.batched is None else self.batched)
            except RecursionError:
                raise depth_error(samples, "packed_collate") from None
        try:
            out = pack(batch, self.max_tensor_bytes, self._worker_ring(), self.wait_s)
        except RecursionError:
            raise depth_error(batch, "packed_collate") from None
        if self.no_ring is not None and type(out) is PackedBatch:  # said once, in the training process
            out.note = self.no_ring if out.note is None else f"{out.note}\n{self.no_ring}"
        return out

    def _worker_ring(self) -> _slots.WorkerRing | None:
        """This worker process's slots (made at its first batch), or None outside workers or with slots=0."""
        ring = self._ring
        if ring is not None and ring.pid == os.getpid():
            return ring
        info = torch.utils.data.get_worker_info() if self.slots else None
        if info is None:
            return None
        try:
            self._ring = _slots.WorkerRing(self.token, info.id, self.slots)
        except (RuntimeError, OSError) as exc:  # no shared memory for the flags: every batch in a fresh buffer
            self.slots = 0
            self.no_ring = (f"packed_collate: a DataLoader worker could not make its slots in shared memory ({exc}), "
                            "so each batch goes in a fresh shared buffer, which the pin-memory step copies. Fix: give "
                            "the container more shared memory (docker --shm-size), or pass slots=0 to silence this.")
            return None
        return self._ring

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_ring": None}  # a worker started by spawn makes its own

    def __setstate__(self, state: dict) -> None:
        # a spawned worker keeps the token; a copy beside a live holder of it gets its own (`claim`)
        self.__dict__.update(state)
        self.token = _slots.claim(self, state["token"])

    def __del__(self) -> None:
        try:
            _slots.forget(self.token)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        name = getattr(self.collate_fn, "__name__", None) or repr(self.collate_fn)
        return f"packed_collate({'default_collate' if self.collate_fn is None else name})"


def packed_collate(collate_fn: Callable[[Any], Any] | None = None, *,
                   max_tensor_bytes: int | str = _pack.MAX_TENSOR_BYTES, slots: int | None = None) -> PackedCollate:
    """A DataLoader collate function that packs each batch's small tensors into one buffer, in the worker.

    For batches of many small tensors (recommender features, detection targets, graph batches):
    the packing runs in the DataLoader's worker processes, so the training process receives one
    buffer per batch, pins one buffer (`pin_memory=True`) and, through `DeviceLoader`, makes one
    copy per batch and hands out the batch as COLLATE_FN made it, its packed tensors views of one
    device buffer. Tensors above MAX_TENSOR_BYTES keep their own copy; tensors that cannot be
    viewed back from bytes (non-contiguous, requiring grad, sparse, subclasses) too, and the first
    batch with one says why (`PackingWarning`). Iterating the DataLoader directly gives
    `PackedBatch` objects: `torchplace.to_device(batch, device)` (or `batch.to(device)`) unpacks one.

    Each worker packs into a few slots of shared memory that it reuses, and the training process
    page-locks each slot once (on CUDA), so the pin-memory step copies nothing. A slot is written
    again only when the batch packed into it, and every view of it, is gone and its copy to the
    device has completed. Memory: SLOTS buffers of about a batch's packed bytes per worker, shared
    and (on CUDA) pinned, for the workers' lifetime. Where slots cannot be pinned or made, batches
    take the copying way, said once.

    Args:
        collate_fn: makes the batch from the samples (default: torch's `default_collate`, or with
            `batch_size=None`, when the dataset returns batches, `default_convert`, as DataLoader does).
        max_tensor_bytes: the largest tensor to pack, in bytes or as a size such as "256KiB".
        slots: slots per worker (default 6, or the DataLoader's prefetch_factor + DeviceLoader's
            prefetch + 2 when DeviceLoader wraps it, whichever is more); 0 packs each batch into a
            fresh shared buffer, which the pin-memory step copies into pinned memory.

    Returns:
        The collate function to pass as `DataLoader(..., collate_fn=...)` (picklable, for any start method).

    Raises:
        ValueError: `max_tensor_bytes` is not a size >= 0, or `slots` not an int >= 0.
        TypeError: `collate_fn` is not callable.

    Example:
        ```python
        import torch
        import torchplace as tp
        from torch.utils.data import DataLoader

        samples = [{"ids": torch.tensor([i, i + 1]), "mask": torch.tensor(i % 2 == 0)} for i in range(8)]
        loader = DataLoader(samples, batch_size=4, collate_fn=tp.packed_collate())
        for batch in tp.DeviceLoader(loader, "cpu"):
            print(batch["ids"].shape, batch["mask"].dtype)
        ```
    """
    limit = parse_size(max_tensor_bytes) if isinstance(max_tensor_bytes, str) else max_tensor_bytes
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"packed_collate(max_tensor_bytes={max_tensor_bytes!r}): give the size of the largest "
                         "tensor to pack, in bytes (an int >= 0) or as a size such as '256KiB'.")
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"packed_collate({collate_fn!r}): collate_fn must be a function that makes a batch from "
                        "a list of samples (or None for torch's default_collate).")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 0):
        raise ValueError(f"packed_collate(slots={slots!r}): give the number of pinned buffers per worker (an int "
                         ">= 0; None picks it from the prefetch depth, 0 turns them off).")
    return PackedCollate(collate_fn, limit, slots)


def pack(batch: Any, max_tensor_bytes: int = _pack.MAX_TENSOR_BYTES, ring: _slots.WorkerRing | None = None,
         wait_s: float = _slots.WAIT_S) -> Any:
    """BATCH as a PackedBatch, or BATCH itself when it holds fewer than two tensors to pack (in a
    DataLoader worker, only when no tensor was left out for a reason the training process must hear).

    With RING (a DataLoader worker's slots) the buffer is a free slot of it; otherwise, in a
    DataLoader worker, a fresh block of shared memory, so sending it copies nothing.
    """
    small: list[torch.Tensor] = []
    left_out: dict[str, int] = {}
    loose = False

    def fn(t: torch.Tensor) -> torch.Tensor:
        nonlocal loose
        if _pack.packable(t, max_tensor_bytes):
            small.append(t)
            return _SLOT
        loose = True
        why = _pack.why_not(t, max_tensor_bytes)
        if why is not None:
            left_out[why] = left_out.get(why, 0) + 1
        return t

    def keep(x: Any) -> Any:  # objects with their own .to() stay whole in the skeleton; DeviceLoader moves them
        nonlocal loose
        loose = True
        return x

    skeleton = walk(batch, fn, keep)
    note = None
    if left_out:
        reasons = "; ".join(f"{n} {why}" for why, n in left_out.items())
        note = (f"packed_collate left tensors out of the packed buffer ({reasons}); they travel and are copied "
                "one by one, as without packing. Fix: make them contiguous plain host tensors without "
                "requires_grad in the dataset or collate_fn, or ignore this if they are few.")
    # Nothing to gain from fewer than two: the batch goes as it is, unless a worker must send a
    # note with it (said in a worker, it would print once per worker and escape the training
    # process's warning filters): then it goes packed, with the note.
    in_worker = torch.utils.data.get_worker_info() is not None
    if len(small) < 2 and (note is None or not in_worker):
        if note is not None:
            _say(note)
        return batch
    key = tuple([(t.dtype, t.shape) for t in small])
    name = _names.key(skeleton, _SLOT, key) if small else None  # none packed: the skeleton is the batch
    if name is None and small and _build.slot_count(skeleton, _SLOT) != len(small):  # a set merged slots: unpacked
        if note is not None:
            _say(note)
        return batch
    plan = _pack.group_layout(key)
    total = plan[0]
    ref = None
    taken = ring.take(total, wait_s) if ring is not None else None
    if type(taken) is tuple:
        ref, buf = taken
    elif in_worker:  # one shared-memory block, sent as it is
        if isinstance(taken, str) and taken != "no free slot":
            note = (note + "\n" if note else "") + f"packed_collate: {taken}. Fix: pass packed_collate(slots=N) " \
                "with N above the number of batches your loop keeps per worker, or slots=0 to silence this."
        buf = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(total))
    else:
        buf = torch.empty(total, dtype=torch.uint8)
    _pack.copy(_pack.group_views(buf, plan, len(small)), small)
    return PackedBatch(buf, plan, skeleton, _SLOT, len(small), note, name, loose, ref)


def _from_slot(ref: _slots.SlotRef, layout: tuple, skeleton: Any, slot: torch.Tensor, count: int, note: str | None,
               key: str | None, loose: bool) -> PackedBatch:
    """A batch a worker packed into a slot, as it arrives in the training process (unpickling)."""
    buf, lease = _slots.receive(ref)
    return PackedBatch(buf, layout, skeleton, slot, count, note, key, loose, lease=lease)


def pin_slot(lease: _slots.SlotHold) -> bool:
    """Page-lock a slot in place; where this cannot be done, say once that batches are copied instead."""
    if lease.pin():
        return True
    _say(_slots.not_pinned(lease))
    return False


def _hold(buf: torch.Tensor, dev: torch.device) -> None:
    """Keep BUF's slot busy until the copy just queued on DEV's current stream has read it."""
    from ..hardware.accelerator import device_module, has_streams

    if not has_streams(dev.type):
        return  # the copy has completed: it was synchronous
    mod = device_module(dev.type)
    event = mod.Event()
    event.record(mod.current_stream(dev))
    _slots.hold_until(event, buf)


def pin_buffer(buf: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of host buffer BUF (BUF if pinned already), copied by the helper threads."""
    if buf.is_pinned() or buf.device.type != "cpu":
        return buf
    out = torch.empty(buf.numel(), dtype=torch.uint8, pin_memory=True)
    n = buf.numel()
    chunk = _hostcopy.CHUNK_BYTES
    if n < _hostcopy.PARALLEL_BYTES:
        return out.copy_(buf)
    dst, src = out.split(chunk), buf.split(chunk)
    _hostcopy.start(dst, src, [d.numel() for d in dst])()
    return out


def _say(note: str) -> None:
    """Warn NOTE once per process."""
    if note not in _warned:
        _warned.add(note)
        warnings.warn(note, PackingWarning, stacklevel=4)


def _default_collate(samples: Any, batched: bool = True) -> Any:
    """torch's default_collate (default_convert for one batch, as the DataLoader does with
    batch_size=None), made to stack into ordinary memory even in a worker.

    In a worker, default_collate puts each stacked tensor in its own shared-memory block so that
    sending it copies nothing; packed, those tensors are not sent, only copied into the one shared
    buffer, so the blocks would be made (a file, a mapping, page faults) for nothing.
    """
    from torch.utils.data import default_collate, default_convert
    from torch.utils.data._utils import worker

    if not batched:
        return default_convert(samples)
    info = getattr(worker, "_worker_info", None)
    if info is None:
        return default_collate(samples)
    worker._worker_info = None
    try:
        return default_collate(samples)
    finally:
        worker._worker_info = info

