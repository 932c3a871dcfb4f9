"""Pinned host staging with its side streams and events: what a copy between a device and host memory
needs to overlap with the work on the device (the checkpoint streams, the background save's copy).

Side streams are CUDA's: copies overlapped on them were measured on CUDA; other back ends copy
synchronously. A caller orders a side stream against the work it must see (`synchronize` the device
first, or `wait_stream` on the current stream) before queueing copies on it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch


def accelerators(tensors: Iterable[Any] | Mapping[Any, Any]) -> set[torch.device]:
    """The accelerator devices (any back end) that the tensors among TENSORS (a mapping: its values) live on
    (a DTensor: its local shard's): their bytes go through host staging."""
    found = set()
    for t in tensors.values() if isinstance(tensors, Mapping) else tensors:
        if isinstance(t, torch.Tensor):
            device = (t.to_local() if hasattr(t, "to_local") else t).device
            if device.type not in ("cpu", "meta"):
                found.add(device)
    return found


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """NBYTES of host memory as a flat uint8 tensor, page-locked when PINNED (so device copies run at the
    link's speed and may be asynchronous)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


class SideStreams:
    """One side stream per CUDA device, made on first use and kept."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def __call__(self, device: torch.device) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)  # cuda-only: side streams are CUDA's
        return s


def done_events(streams: Iterable[Any]) -> list[Any]:
    """An event recorded on each of STREAMS: synchronize() on it waits for what was queued there so far."""
    events = []
    for s in streams:
        event = torch.cuda.Event()  # cuda-only: events of the CUDA side streams above
        event.record(s)
        events.append(event)
    return events


class ThreadStaging:
    """Per-thread pinned buffers of NBYTES and side streams, reused across the chunks a thread copies."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes, self.pinned = nbytes, pinned
        self._local = threading.local()

    def buffer(self) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = host_buffer(self.nbytes, self.pinned)
        return buf

    def stream(self, device: torch.device) -> Any:
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = SideStreams()
        return streams(device)
