"""Host buffers a background save copies the state into: reused across saves, pinned once on a GPU.

A save in the background must copy the state at the call, so training may change it at once. The
copy goes into slabs of host memory laid out like the file's data region; they are kept and reused
(pinning is slow, and the pinned-memory cache keeps blocks of power-of-two sizes), and grow only when
the state grows. `memory_problem` checks the host can hold them before anything is allocated.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from ..units import format_bytes
from .fileio import Planned
from .stream import byte_view

SLAB_BYTES = 256 * 2**20  # a multiple of format.CHUNK_BYTES, and a power of two (pinned memory is cached in those)
SMALL_ROUND = 2**20
HEADROOM_BYTES = 512 * 2**20  # host memory left free after allocating staging buffers


class HostStaging:
    """A reusable host copy of one state's data region: one buffer, or equal slabs of SLAB_BYTES.

    Pinned when the state lives on a CUDA device, so the device-to-host copy runs at the link's speed
    without a bounce. Kept between saves; grows (allocating only the difference) when a state outgrows it.
    """

    def __init__(self) -> None:
        self.slabs: list[torch.Tensor] = []
        self.pinned = False
        self._streams: dict[torch.device, Any] = {}

    @property
    def capacity(self) -> int:
        return sum(s.numel() for s in self.slabs)

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
        if not keep:
            self.pinned = pinned
        self.slabs = keep  # dropped buffers go back to torch's (pinned) host cache
        self.slabs += [torch.empty(n, dtype=torch.uint8, pin_memory=self.pinned) for n in sizes]

    def stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            # cuda-only: the background save overlaps its device-to-host copy on CUDA streams (measured on H200);
            # other back ends copy synchronously
            self._streams[device] = torch.cuda.Stream(device=device)  # cuda-only: side streams are CUDA's (above)
        return self._streams[device]

    def copy_in(self, planned: Planned) -> None:
        """Copy every tensor of PLANNED to its place in the data region; return once all copies are done."""
        size = self.slabs[0].numel() if self.slabs else 1
        used: dict[torch.device, Any] = {}
        for e in planned.entries:
            if not e.nbytes:
                continue
            t = planned.tensors[e.key]
            cuda = t.device.type == "cuda"
            if cuda and t.device not in used:  # the side stream sees everything queued before this call
                used[t.device] = self.stream(t.device)
                # cuda-only: the background save overlaps its device-to-host copy on CUDA streams (measured on
                # H200); other back ends copy synchronously
                used[t.device].wait_stream(torch.cuda.current_stream(t.device))  # cuda-only: CUDA side streams
            with torch.cuda.stream(used[t.device]) if cuda else nullcontext():  # cuda-only: CUDA side streams
                src = byte_view(t)
                pos = e.start
                while pos < e.end:
                    k, at = divmod(pos, size)
                    n = min(e.end - pos, size - at)
                    self.slabs[k][at:at + n].copy_(src[pos - e.start:pos - e.start + n], non_blocking=cuda)
                    pos += n
        for s in used.values():
            s.synchronize()


def memory_problem(need: int, available: int, *, headroom: int = HEADROOM_BYTES) -> str | None:
    """Why NEED more bytes of host memory cannot be taken when AVAILABLE are free, or None."""
    if need <= 0 or available - need >= headroom:
        return None
    return (f"needs {format_bytes(need)} more host memory for its staging copy of the state, but "
            f"{format_bytes(available)} is available (and {format_bytes(headroom)} is left free for the rest)")


def available_memory() -> int:
    """Bytes of host memory that new allocations can take now (psutil's reading)."""
    import psutil

    return int(psutil.virtual_memory().available)
