"""Pack many small host tensors into one buffer, copy it once, and view it back as tensors.

Small copies are dominated by per-copy overhead, not bandwidth: 64 tensors of 64 KiB took
792 µs as 64 copies and 96 µs as one packed copy on an H200 (docs: MEASUREMENTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

ALIGN = 64  # bytes: each tensor starts on its own 64-byte boundary, so kernels can vectorize
MAX_TENSOR_BYTES = 256 * 1024  # above this a separate copy costs little next to its bytes
_INTEGRAL = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def packable(t: torch.Tensor, max_bytes: int = MAX_TENSOR_BYTES) -> bool:
    """True for a small, plain, contiguous host tensor whose bytes can be packed and viewed back.

    Tensors that need autograd, subclasses, sparse, quantized or non-contiguous ones keep their
    own copy, so packing never changes what a tensor is, only where its bytes live.
    """
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout is torch.strided
            and not t.requires_grad and not t.is_quantized and t.nbytes <= max_bytes
            and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype in _INTEGRAL)
            and t.is_contiguous())


@dataclass(frozen=True)
class Layout:
    """Where each tensor's bytes start in the packed buffer, and the buffer's size."""

    offsets: tuple[int, ...]
    total: int


def layout(tensors: Sequence[torch.Tensor]) -> Layout:
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.nbytes // ALIGN) * ALIGN
    return Layout(tuple(offsets), max(end, ALIGN))


def pack(tensors: Sequence[torch.Tensor], plan: Layout, *, pin: bool) -> torch.Tensor:
    """One uint8 host buffer (page-locked if PIN) holding every tensor's bytes at PLAN's offsets."""
    buf = torch.empty(plan.total, dtype=torch.uint8, pin_memory=pin)
    dst = unpack(buf, tensors, plan)
    try:
        torch._foreach_copy_(dst, list(tensors))  # one call for the whole list
    except (AttributeError, RuntimeError, TypeError):
        for d, s in zip(dst, tensors):
            d.copy_(s)
    return buf


def unpack(buf: torch.Tensor, like: Sequence[torch.Tensor], plan: Layout) -> list[torch.Tensor]:
    """Tensors shaped like LIKE that view BUF (on whatever device BUF lives) at PLAN's offsets."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    base = buf.storage_offset()
    out = []
    for t, offset in zip(like, plan.offsets):
        view = typed.get(t.dtype)
        if view is None:  # one reinterpretation per dtype; the total is a multiple of every itemsize
            view = typed[t.dtype] = buf.view(t.dtype)
        out.append(view.as_strided(t.shape, t.stride(), (base + offset) // t.element_size()))
    return out
