"""Lay many small tensors out in one buffer and view them back as tensors.

Small copies are dominated by per-copy overhead, not bandwidth: 64 tensors of 64 KiB took
792 µs as 64 copies and 96 µs as one packed copy on an H200 (docs/reference-measurements.md).
DeviceLoader uses one layout for both sides: pageable tensors are packed into a pinned host
buffer and copied once; pinned ones are copied straight into views of one device buffer.

A `Layout` is computed once per batch structure (dtypes and shapes) and cached. Tensors of
the same dtype and shape sit next to each other, so one `as_strided` + `unbind` call makes
all their views: one Python call per group instead of one per tensor, on the host (to pack)
and on the device (to unpack).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64  # bytes: each tensor starts on its own 64-byte boundary, so kernels can vectorize
MAX_TENSOR_BYTES = 256 * 1024  # above this a separate copy costs little next to its bytes
_INTEGRAL = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_DTYPES = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype)
                    and (d.is_floating_point or d.is_complex or d in _INTEGRAL))
_CACHE_SIZE = 64  # layouts kept; a loader with ever-changing shapes starts over when full
_layouts: dict[tuple, Layout] = {}


def packable(t: torch.Tensor, max_bytes: int = MAX_TENSOR_BYTES) -> bool:
    """True for a small, plain, contiguous host tensor whose bytes can be packed and viewed back.

    Tensors that need autograd, subclasses, sparse, nested (a strided nested tensor has no single
    shape to view back), quantized or non-contiguous ones keep their own copy, so packing never
    changes what a tensor is, only where its bytes live (`why_not` says which applies).
    """
    return (type(t) is torch.Tensor and t.is_cpu and t.layout is torch.strided and not t.is_nested
            and not t.requires_grad and t.dtype in _DTYPES and t.nbytes <= max_bytes and t.is_contiguous())


def why_not(t: torch.Tensor, max_bytes: int) -> str | None:
    """Why T is not packed, or None when it is only large (large tensors are meant to keep their copy)."""
    if type(t) is not torch.Tensor:
        return f"{type(t).__name__} (a tensor subclass)"
    if not t.is_cpu:
        return f"on {t.device}"
    if t.is_nested:
        return "nested"
    if t.layout is not torch.strided:
        return f"{t.layout} (not strided)"
    if t.requires_grad:
        return "requiring grad"
    if t.dtype not in _DTYPES:
        return f"of dtype {t.dtype}"
    if t.nbytes > max_bytes:
        return None
    if not t.is_contiguous():
        return "non-contiguous"
    return None


@dataclass(frozen=True)
class _Group:
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # contiguous strides of SHAPE
    offset: int  # elements of DTYPE from the buffer's start to the group's first tensor
    step: int  # elements of DTYPE from one tensor of the group to the next (64-byte aligned)
    positions: tuple[int, ...]  # where the group's tensors are in the packed list


@dataclass(frozen=True)
class Layout:
    """Where each tensor's bytes start in the packed buffer (`offsets`, bytes) and its size."""

    offsets: tuple[int, ...]
    total: int
    groups: tuple[_Group, ...] = ()
    nbytes: tuple[int, ...] = ()


def layout(tensors: Sequence[torch.Tensor]) -> Layout:
    """The (cached) layout of TENSORS: by dtype and shape, each tensor 64-byte aligned."""
    return layout_of(tuple([(t.dtype, t.shape) for t in tensors]))


def layout_of(key: tuple) -> Layout:
    """The (cached) layout for KEY, the (dtype, shape) of each tensor in order."""
    return _cached(_layouts, key, _make_layout)


def _cached(cache: dict, key: tuple, make: Callable[[tuple], Any]) -> Any:
    """CACHE[KEY], made by MAKE(KEY) the first time; a full cache starts over (ever-changing shapes)."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= _CACHE_SIZE:
            cache.clear()
        found = cache[key] = make(key)
    return found


def _make_layout(key: tuple) -> Layout:
    members: dict[tuple, list[int]] = {}
    for i, (dtype, shape) in enumerate(key):
        members.setdefault((dtype, tuple(shape)), []).append(i)
    offsets = [0] * len(key)
    nbytes = [0] * len(key)
    groups, end = [], 0
    for (dtype, shape), positions in members.items():
        itemsize = dtype.itemsize
        numel = 1
        strides = []
        for size in reversed(shape):
            strides.append(numel)
            numel *= size
        step_bytes = -(-numel * itemsize // ALIGN) * ALIGN
        for n, i in enumerate(positions):
            offsets[i] = end + n * step_bytes
            nbytes[i] = numel * itemsize
        groups.append(_Group(dtype, shape, tuple(reversed(strides)), end // itemsize, step_bytes // itemsize,
                             tuple(positions)))
        end += step_bytes * len(positions)
    return Layout(tuple(offsets), max(end, ALIGN), tuple(groups), tuple(nbytes))


def views(buf: torch.Tensor, plan: Layout) -> list[torch.Tensor]:
    """The packed tensors as views of BUF (a uint8 buffer of `plan.total` bytes, on any device)."""
    out: list = [None] * len(plan.offsets)
    typed: dict[torch.dtype, torch.Tensor] = {}
    for g in plan.groups:
        flat = typed.get(g.dtype)
        if flat is None:  # one reinterpretation per dtype; the total is a multiple of every itemsize
            flat = typed[g.dtype] = buf.view(g.dtype)
        if len(g.positions) == 1:
            out[g.positions[0]] = flat.as_strided(g.shape, g.strides, g.offset)
            continue
        stacked = flat.as_strided((len(g.positions), *g.shape), (g.step, *g.strides), g.offset)
        for i, view in zip(g.positions, stacked.unbind(0)):
            out[i] = view
    return out


def copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], *, non_blocking: bool = False) -> None:
    """dst[i].copy_(src[i]) for all i, in one call (the GIL is released while it runs)."""
    try:
        torch._foreach_copy_(list(dst), list(src), non_blocking=non_blocking)
    except (AttributeError, RuntimeError, TypeError):
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=non_blocking)


# -- the layout of packed_collate's buffers: one region per dtype and trailing shape ----------------

_grouped: dict[tuple, tuple] = {}


def group_layout(key: tuple) -> tuple:
    """The (cached) layout for tensors of KEY's (dtype, shape)s as packed_collate lays them out."""
    return _cached(_grouped, key, _group_layout)


def group_views(buf: torch.Tensor, plan: tuple, count: int) -> list[torch.Tensor]:
    """The packed tensors, in batch order, as views of BUF (one split or unbind per group)."""
    _, ordered, groups = plan
    if ordered:  # one group holding the tensors in batch order: its split is the answer
        dtype, rows, offset, nbytes, sizes, _ = groups[0]
        region = buf[offset:offset + nbytes].view(dtype).view(rows)
        return list(region.unbind(0) if sizes is None else region.split(sizes))
    out: list[Any] = [None] * count
    for dtype, rows, offset, nbytes, sizes, positions in groups:
        region = buf[offset:offset + nbytes].view(dtype).view(rows)
        for i, view in zip(positions, region.unbind(0) if sizes is None else region.split(sizes)):
            out[i] = view
    return out


def _group_layout(key: tuple) -> tuple:
    """(total bytes, ordered, groups) for tensors of KEY's (dtype, shape)s, grouped by dtype and trailing shape.

    A group is (dtype, shape of its rows, byte offset, bytes, first-dimension sizes or None for
    0-dim tensors, positions in the batch). Plain tuples: the record is pickled with every batch.
    """
    members: dict[tuple, list[int]] = {}
    for i, (dtype, shape) in enumerate(key):
        members.setdefault((dtype, tuple(shape[1:]) if len(shape) else None), []).append(i)
    groups, end = [], 0
    for (dtype, trailing), positions in members.items():
        end = -(-end // ALIGN) * ALIGN
        if trailing is None:
            sizes, rows = None, (len(positions),)
        else:
            sizes = tuple(key[i][1][0] for i in positions)
            rows = (sum(sizes), *trailing)
        numel = 1
        for n in rows:
            numel *= n
        nbytes = numel * dtype.itemsize
        groups.append((dtype, rows, end, nbytes, sizes, tuple(positions)))
        end += nbytes
    total = max(-(-end // ALIGN) * ALIGN, ALIGN)
    ordered = len(groups) == 1
    return (total, ordered, tuple(groups))
